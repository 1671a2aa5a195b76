"""The fleet's per-subject interception of named ports (docs/reference/behaviour.md §18).

80, 443 and the extra ports are intercepted for every MITM source by the header's fixed
rules. The ports a subject's ``http``/``https`` rules name (:func:`egressd.policy.mitmports.named_ports`)
are intercepted for that subject alone: its source addresses (``mitm_ports_v4/v6``, keyed
``saddr . tcp . port range``) and its host uids (``uid_mitm_ports``, keyed ``skuid . tcp .
port range``) are elements of table-wide sets read by fixed nat rules, so a subject's rules
still never change. The elements follow its policy and its keys, in the same transaction as
the set contents they go with.

The sets are table-wide, so what a subject holds there is tracked here (like the
``sandbox_nets`` union of :class:`egressd.fleetnft.steps.SandboxNets`): a change deletes
exactly the subject's held elements and adds the new ones. When a transaction carrying such
a change went unanswered, what the kernel holds is not known; the next change then empties
both sets and refills them with every subject's elements, the doubtful subject's old and new
ones together (intercepting more only makes the MITM check more names: it never opens
anything).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from egressd.addr import IPAddress
from egressd.fleetnft.table import mitm_ports_set
from egressd.kernel.ops import AddPortElems, DeletePortElems, FlushSet, NetlinkBatch, Op, PortElem
from egressd.nftsyntax import IPNetwork, family
from egressd.policy.scope import PortRange, Scope

#: (set name, key prefix): where a subject's elements go, one per key and port range.
Key = tuple[str, IPNetwork]


def uid_key(host_uid: int) -> IPNetwork:
    """A host uid as the first field of a ``uid_mitm_ports`` element. ``meta skuid`` loads a
    host-endian u32, but nft turns a host-endian field of an interval concatenation into big
    endian before the lookup (a ``byteorder`` expression in the rule: ranges compare as
    big-endian numbers), so the key holds the uid big-endian: the 4 bytes of the IPv4-shaped
    field the port-scoped element encoder writes in network order."""
    return ipaddress.IPv4Network(host_uid)


def address_key(ip: IPAddress) -> Key:
    return mitm_ports_set(family(ip)), ipaddress.ip_network(ip)


@dataclass(frozen=True, slots=True)
class Interception:
    """What a subject has intercepted beyond the fixed ports: its keys, on each port range."""

    keys: frozenset[Key] = frozenset()
    ranges: tuple[PortRange, ...] = ()

    def elements(self) -> dict[str, tuple[PortElem, ...]]:
        out: dict[str, list[PortElem]] = {}
        for name, net in sorted(self.keys, key=lambda k: (k[0], str(k[1]))):
            out.setdefault(name, []).extend((net, "tcp", lo, hi) for lo, hi in self.ranges)
        return {name: tuple(elems) for name, elems in out.items() if elems}

    def union(self, other: Interception) -> Interception:
        return Interception(self.keys | other.keys, Scope.of(tcp=self.ranges + other.ranges).tcp)

    def with_keys(self, keys: Iterable[Key]) -> Interception:
        return Interception(frozenset(keys), self.ranges)


NONE = Interception()


def _fam(name: str) -> str:
    return "v6" if name.endswith("_v6") else "v4"


def _adds(elements: dict[str, tuple[PortElem, ...]]) -> list[Op]:
    return [AddPortElems(name, _fam(name), elems) for name, elems in elements.items()]


def _deletes(elements: dict[str, tuple[PortElem, ...]]) -> list[Op]:
    return [DeletePortElems(name, _fam(name), elems) for name, elems in elements.items()]


class NamedPorts:
    """What each subject holds in the named-port sets (by subject uid), and the ops that
    change it. ``sets``: the set names the table has (none without the MITM: then every
    change is empty)."""

    def __init__(self, sets: tuple[str, ...]) -> None:
        self.sets = sets
        self.held: dict[str, Interception] = {}
        #: Subjects whose last change may or may not have landed: (old, new) candidates.
        self.doubt: dict[str, Interception] = {}

    def forget_all(self) -> None:
        """The table was reset: the sets are empty."""
        self.held, self.doubt = {}, {}

    def wanted(self, uid: str) -> Interception:
        """What the subject should hold now, as far as this tracker knows (doubt included)."""
        return self.held.get(uid, NONE)

    def changed(
        self, batch: NetlinkBatch, uid: str, want: Interception
    ) -> tuple[NetlinkBatch, Callable[[], None]]:
        """``batch`` plus, in the same transaction, the ops that make the kernel hold ``want``
        for ``uid``; and the commit to call once the transaction is known to have landed."""
        return self.changed_many(batch, {uid: want})

    def changed_many(
        self, batch: NetlinkBatch, wants: dict[str, Interception]
    ) -> tuple[NetlinkBatch, Callable[[], None]]:
        """:meth:`changed` for several subjects in one transaction."""
        if not self.sets:
            return batch, lambda: None
        olds = {uid: self.held.get(uid, NONE) for uid in wants}
        if not self.doubt and all(olds[u].elements() == w.elements() for u, w in wants.items()):
            return batch, lambda: self._hold_all(wants)
        refilled = {u: state for u, state in self.doubt.items() if u not in wants}
        if self.doubt:
            ops = self._refill(wants)
        else:
            ops = [op for u in wants for op in _deletes(olds[u].elements())]
            ops += [op for w in wants.values() for op in _adds(w.elements())]
        # Until the commit, what the kernel holds for these subjects is either state (an
        # unanswered or failed send leaves it so): the next change refills from scratch.
        for uid, want in wants.items():
            self.doubt[uid] = self.doubt.get(uid, olds[uid]).union(want)

        def commit() -> None:
            for other, state in refilled.items():
                self._hold(other, state)  # the refill wrote the union for it
                self.doubt.pop(other, None)
            self._hold_all(wants)
            for uid in wants:
                self.doubt.pop(uid, None)

        return batch + NetlinkBatch(batch.table, tuple(ops)), commit

    def _hold_all(self, wants: dict[str, Interception]) -> None:
        for uid, want in wants.items():
            self._hold(uid, want)

    def _hold(self, uid: str, state: Interception) -> None:
        if state == NONE:
            self.held.pop(uid, None)
        else:
            self.held[uid] = state

    def _refill(self, wants: dict[str, Interception]) -> list[Op]:
        """Every set emptied and refilled with every subject's elements: ``wants`` for those,
        the union of both candidates for a subject in doubt, what is held for the rest."""
        everyone = dict(self.held)
        everyone.update(self.doubt)
        everyone.update(wants)
        ops: list[Op] = [FlushSet(name) for name in self.sets]
        merged: dict[str, list[PortElem]] = {}
        for state in everyone.values():
            for name, elems in state.elements().items():
                merged.setdefault(name, []).extend(elems)
        ops += _adds({name: tuple(elems) for name, elems in merged.items()})
        return ops
