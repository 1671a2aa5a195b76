"""A model of a subject's dyn sets as nf_tables keeps them, for the lease book's tests: timed
elements that expire by themselves, a transaction applied all or nothing, and the two refusals
a DNS learn can meet (egressd.fleetnft.contents.dyn_add's docstring; tests/kernel/test_ports_load.py
shows them on a real kernel):

* a pipapo element (a port range) that partly overlaps one the set holds is refused
  (``File exists``); the same element again renews its timeout;
* deleting an element the set does not hold (never written, deleted, or expired) is refused
  (``No such file or directory``);
* with ``port_size`` (the port-scoped sets' ``size``, egressd.subject.leases.port_elems_cap), an
  add that takes a port-scoped set past it is refused (``ENFILE``). Counted over what was
  written and not deleted or flushed, expired or not: the kernel counts an expired element
  until its garbage collection removes it, so this refuses no later than nf_tables would.

Besides what is live, it keeps what was *written* and not deleted or flushed (expired or not):
the lease book's ``held`` promises exactly that for the port-scoped elements."""

from __future__ import annotations

from dataclasses import dataclass, field

from egressd.addr import IPAddress, IPNetwork, host_network
from egressd.kernel.applier import NftError
from egressd.kernel.ops import (
    AddPortElems,
    AddTimed,
    DeleteElement,
    DeletePortElems,
    FlushSet,
    NetlinkBatch,
    Op,
    PortElem,
)
from egressd.policy.scope import Scope
from egressd.subject.ranges import placement

Key = IPAddress | PortElem  # an address (dyn, dynr) or a port element (dynp, dynpx)


@dataclass
class DynKernel:
    nft_id: str = "s"
    now: float = 0.0
    live: dict[str, dict[Key, float]] = field(default_factory=dict)  # set -> key -> expiry
    written: dict[str, set[Key]] = field(default_factory=dict)  # set -> keys not deleted/flushed
    port_size: int = 0  # the port-scoped sets' size (0: unbounded)

    def apply(self, batch: NetlinkBatch, now: float) -> None:
        """One transaction at ``now``: every op, or (NftError) nothing."""
        work = DynKernel(
            self.nft_id, now, {n: dict(d) for n, d in self.live.items()}, port_size=self.port_size
        )
        work.written = {n: set(keys) for n, keys in self.written.items()}
        for elems in work.live.values():  # the kernel's garbage collection
            for key in [k for k, exp in elems.items() if exp <= now]:
                del elems[key]
        for op in batch.ops:
            work._op(op)
        self.now, self.live, self.written = work.now, work.live, work.written

    def _op(self, op: Op) -> None:
        if isinstance(op, FlushSet):
            self.live[op.name] = {}
            self.written[op.name] = set()
        elif isinstance(op, AddTimed):
            for ip, seconds in op.leases:
                self._add(op.name, ip, seconds, ranged=False)
        elif isinstance(op, AddPortElems):
            for elem, seconds in zip(op.elems, op.seconds, strict=True):
                self._add(op.name, elem, seconds, ranged=not op.exact and elem[2] < elem[3])
        elif isinstance(op, DeleteElement):
            self._delete(op.name, op.key)
        elif isinstance(op, DeletePortElems):
            for elem in op.elems:
                self._delete(op.name, elem)
        else:
            raise AssertionError(f"not a dyn-set op: {op!r}")

    def _add(self, name: str, key: Key, seconds: int, *, ranged: bool) -> None:
        live = self.live.setdefault(name, {})
        if ranged and isinstance(key, tuple) and key not in live:
            net, proto, lo, hi = key
            for other in live:
                if not isinstance(other, tuple):
                    continue
                o_net, o_proto, o_lo, o_hi = other
                if o_net == net and o_proto == proto and o_lo <= hi and lo <= o_hi:
                    raise NftError(f"Error: Could not process rule: File exists ({key} over {other})")
        live[key] = self.now + seconds
        written = self.written.setdefault(name, set())
        written.add(key)
        if self.port_size and isinstance(key, tuple) and len(written) > self.port_size:
            raise NftError(
                f"Error: Could not process rule: Too many open files in system ({name} over {self.port_size})"
            )

    def _delete(self, name: str, key: Key) -> None:
        live = self.live.setdefault(name, {})
        if key not in live:
            raise NftError(f"Error: Could not process rule: No such file or directory ({key})")
        del live[key]
        self.written.setdefault(name, set()).discard(key)

    # ---- views -------------------------------------------------------------------------------

    def keys_of(self, ip: IPAddress, *, written: bool = False) -> set[tuple[str, Key]]:
        """(set kind, key) of everything the kernel holds live at :attr:`now` (``written``:
        has written and not deleted, expired or not) for ``ip``."""
        out: set[tuple[str, Key]] = set()
        net = host_network(ip)
        prefix = f"subj_{self.nft_id}_"
        for name in set(self.live) | set(self.written):
            if written:
                keys = self.written.get(name, set())
            else:
                keys = {k for k, exp in self.live.get(name, {}).items() if exp > self.now}
            out |= {(name.removeprefix(prefix), k) for k in keys if _of(ip, net, k)}
        return out

    def port_keys_of(self, ip: IPAddress, *, written: bool = False) -> set[tuple[str, Key]]:
        return {(kind, key) for kind, key in self.keys_of(ip, written=written) if not kind.startswith("dyn_")}

    def live_count(self, name: str) -> int:
        return sum(exp > self.now for exp in self.live.get(name, {}).values())

    def forget(self, ip: IPAddress) -> None:
        """The kernel's garbage collection caught up with ``ip``, all of whose elements expired:
        nothing written for it remains."""
        assert not self.keys_of(ip), (ip, self.keys_of(ip))
        net = host_network(ip)
        for name, keys in self.written.items():
            self.written[name] = {k for k in keys if not _of(ip, net, k)}


def _of(ip: IPAddress, net: IPNetwork, key: Key) -> bool:
    """Is ``key`` (an address, or a port element on ``net``, the address's host network) ``ip``'s?"""
    return key == ip or (isinstance(key, tuple) and key[0] == net)


def expected_port_keys(ip: IPAddress, ports: Scope, shared: Scope) -> set[tuple[str, Key]]:
    """Where dyn_add writes ``ports`` for ``ip`` under the shared ranges ``shared``."""
    fam = "v4" if ip.version == 4 else "v6"
    place = placement(ports, shared)
    net = host_network(ip)
    out: set[tuple[str, Key]] = {(f"dynpx_{fam}", (net, p, lo, hi)) for p, lo, hi in place.single}
    out |= {(f"dynp_{fam}", (net, p, lo, hi)) for p, lo, hi in place.pipapo}
    if place.hashed:
        out.add((f"dynr_{fam}", ip))
    return out
