"""The sidecar's ruleset backend: the whole table ``inet opensandbox``, one implicit subject.

Implements :class:`egressd.engine.backend.RulesetBackend` for the sidecar profile. Learned
leases go into the table's ``dyn_allow`` sets by a libnftables script; a narrowing rebuilds the
whole table in one transaction (:func:`egressd.sidecarnft.ruleset.ruleset`); tracked flows are
the namespace's outbound ones, judged by their original destination alone (``ct state
established`` is accepted first, so a narrowing must cut them). Flows to the namespace's own
addresses (the API's clients, loopback) are never offered for a cut.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

import structlog

from egressd.addr import IPAddress, unmap_ip
from egressd.engine.backend import Flow, Refusals
from egressd.engine.selftest import Probes, no_probes
from egressd.kernel.conntrack import (
    Dest,
    carries_mark,
    conntrack_delete,
    conntrack_mark,
    flow_selector,
    original_flow,
    original_tuple,
    read_table,
    reply_source,
    zoned,
)
from egressd.policy import NetworkPolicy, ip_sets
from egressd.policy.ipsets import Prefix
from egressd.sidecarnft.ruleset import (
    DROPPED_COUNTER,
    REVOKED_FLOW_MARK,
    SidecarTable,
    delete_table,
    dyn_add,
    ruleset,
)
from egressd.subject.leases import Grant
from egressd.subject.model import nft_id, subject_for_uid

log = structlog.get_logger("egressd.sidecar.flows")


class Kernel(Protocol):
    """What the backend needs from the kernel shell (KernelTransactions, or a fake in tests)."""

    async def run_script(self, script: str, *, op: str) -> None: ...


def answered_by_proxy(line: str, dest: Dest) -> bool:
    """Is this tracked flow the app's DNS, redirected to the local DNS proxy (the
    ``dns_redirect`` chain: every udp/tcp 53 the namespace sends, bar the exempt nameservers)?
    Its original destination never sees a packet, and the proxy answers it by the policy, so a
    narrowing has nothing to cut there; deleting its entry would only lose the answer to a
    query in flight (its reply could no longer be mapped back) or end a DNS-over-TCP session."""
    _, proto, port = dest
    if port != 53 or proto not in ("udp", "tcp"):
        return False
    answered_from = reply_source(line)
    return answered_from is not None and answered_from.is_loopback


def outbound_flows(conntrack_text: str, local: Iterable[IPAddress]) -> set[Dest]:
    """Original (destination, protocol, port) of tracked flows, minus those to the namespace's
    own addresses, the DNS the local proxy answers, the forwarder's (zone 1) and the flows
    already cut (pure): a narrowing judges them by port and protocol too (§18)."""
    own = set(local)
    out: set[Dest] = set()
    for line in conntrack_text.splitlines():
        t = original_flow(line)
        if t is None or carries_mark(line, REVOKED_FLOW_MARK) or zoned(line):
            continue
        dst = t[1][0]
        if dst in own or dst.is_loopback or answered_by_proxy(line, t[1]):
            continue
        out.add(t[1])
    return out


def outbound_destinations(conntrack_text: str, local: Iterable[IPAddress]) -> set[IPAddress]:
    """Original destinations of tracked flows, minus the namespace's own addresses (pure)."""
    own = set(local)
    out: set[IPAddress] = set()
    for line in conntrack_text.splitlines():
        t = original_tuple(line)
        if t is None:
            continue
        dst = t[1]
        if dst in own or dst.is_loopback:
            continue
        out.add(dst)
    return out


def local_addresses() -> set[IPAddress]:
    """Every address configured in this network namespace (netlink)."""
    from pyroute2 import IPRoute

    addrs: set[IPAddress] = set()
    with IPRoute() as ipr:
        for msg in ipr.get_addr():
            raw = msg.get_attr("IFA_ADDRESS")
            if raw:
                try:
                    addrs.add(unmap_ip(ipaddress.ip_address(str(raw).split("%", 1)[0])))
                except ValueError:
                    continue
    return addrs


async def read_outbound() -> list[Dest] | None:
    """The namespace's outbound flow destinations, sorted (None: the conntrack table or the
    local addresses could not be read; without the latter we could cut the API's own clients)."""
    text = await read_table()
    if text is None:
        return None
    try:
        local = await asyncio.to_thread(local_addresses)
    except Exception as exc:
        log.warning("conntrack.cut_skipped", error=str(exc)[:200])
        return None
    return sorted(outbound_flows(text, local), key=str)


#: The uid of the sidecar's one implicit subject (every client of the namespace is it), and its nft id.
SIDECAR_UID = "sidecar"
SIDECAR_NFT_ID = nft_id(subject_for_uid(SIDECAR_UID))


def sidecar_refusals(counters: Mapping[str, int]) -> Refusals:
    """The table's one counter ``dropped`` is the one subject's; every source is the subject."""
    return Refusals({SIDECAR_NFT_ID: counters.get(DROPPED_COUNTER, 0)})


class SidecarBackend:
    #: The sidecar refuses audit policies; its table enforces every deny.
    passes_would_deny = False

    @property
    def name_check(self) -> bool:
        return self.table.checks_names

    def __init__(
        self,
        table: SidecarTable,
        kernel: Kernel,
        *,
        probes: Callable[[str], Probes[Any]] | None = None,
        outbound: Callable[[], Any] = read_outbound,
    ) -> None:
        self.table = table
        self.kernel = kernel
        # The start-up self-test's probes (none: a backend built for tests, never self-tested).
        self.probes: Callable[[str], Probes[Any]] = probes if probes is not None else no_probes
        self._outbound = outbound

    # ---- RulesetBackend ----------------------------------------------------------------------

    def may_hold(self, exc: BaseException) -> bool:
        # Every narrowing rebuilds the whole table from the book, which drops whatever the
        # kernel took beyond it: a failed add is never recorded (nor verified for the MITM).
        return False

    def kernel_denies(self, effective: NetworkPolicy) -> tuple[Sequence[Prefix], Sequence[Prefix]]:
        sets = ip_sets(effective)
        return sets.deny_v4, sets.deny_v6

    async def add_leases(self, uid: str, admitted: list[Grant]) -> None:
        await self.kernel.run_script(dyn_add(self.table, admitted), op="dynamic_add")

    async def tracked_flows(
        self, sources: Mapping[str, Collection[IPAddress]]
    ) -> Mapping[str, Sequence[Flow]] | None:
        destinations = await self._outbound()
        if destinations is None:
            return None
        flows: list[Flow] = [(None, dst, proto, port) for dst, proto, port in destinations]
        return {uid: flows for uid in sources}

    async def cut_flow(self, flow: Flow) -> None:
        """Mark the flows to ``flow``'s destination (and protocol and port) as cut, keeping
        their entries: the egress chain accepts established packets only without the mark, so
        the app's next packets are judged as a new flow's and refused. A deleted entry would be
        rebuilt by the upstream's next packet, inbound, with the app's side as its reply
        direction, and so "established" again (a streamed download outlived the narrowing)."""
        _, dst, proto, port = flow
        await conntrack_mark(["-d", str(dst), *flow_selector(proto, port)], dst.version, REVOKED_FLOW_MARK)

    async def forget_dns_flows(self) -> None:
        """Delete every tracked udp/tcp flow to port 53 (start-up: the next packet of each is
        NATed afresh, ``SidecarEngine._forget_dns_flows``)."""
        for version in (4, 6):
            for proto in ("udp", "tcp"):
                await conntrack_delete(flow_selector(proto, 53), version)

    def flow_fields(self, flow: Flow) -> dict[str, str]:
        return {"destination": str(flow[1])}

    def refusals(self, counters: Mapping[str, int]) -> Refusals:
        return sidecar_refusals(counters)


    # ---- the whole table ---------------------------------------------------------------------

    async def rebuild(
        self, effective: NetworkPolicy, kept: Sequence[Grant] = (), dropped: int = 0
    ) -> int:
        """Replace the whole table with one for ``effective`` holding the ``kept`` leases and a
        refusal counter starting at ``dropped``, in one transaction; returns its rule count."""
        script = ruleset(self.table, effective, kept, dropped)
        await self.kernel.run_script(script, op="static_apply")
        return sum(1 for line in script.splitlines() if line.startswith("add rule "))

    async def remove(self) -> None:
        """Delete the table (the sidecar's shutdown)."""
        await self.kernel.run_script(delete_table(self.table), op="reset")
