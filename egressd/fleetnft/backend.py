"""The fleet's ruleset backend: per-subject netlink objects in the shared table.

Implements :class:`egressd.engine.backend.RulesetBackend` for the fleet profile. Learned leases
go into the subject's ``dyn`` sets in one netlink batch (sent inline: the DNS answer waits for
it); the deny prefixes a narrowing respects are those of the subject's static sets (in audit
mode the hard denies only); tracked flows are per (source, destination) of the subject's own
source addresses, and a cut deletes exactly that pair.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from egressd.addr import IPAddress
from egressd.engine.backend import Flow, Refusals
from egressd.engine.selftest import Probes, no_probes
from egressd.engine.subjects import unless_refused
from egressd.fleetnft.contents import dyn_add, policy_contents
from egressd.fleetnft.table import UNATTRIBUTED_COUNTER, TableConfig, dropped_counter_subject
from egressd.kernel.applier import Transactions
from egressd.kernel.conntrack import flush_flow, read_flow_dests
from egressd.policy import NetworkPolicy
from egressd.policy.ipsets import Prefix
from egressd.subject.leases import Grant
from egressd.subject.model import nft_id, subject_for_uid


def fleet_refusals(counters: Mapping[str, int]) -> Refusals:
    """Each subject's ``subj_<id>_dropped`` by nft id, and ``unattributed_dropped`` (the refusals
    of sources that are no subject)."""
    by_subject: dict[str, int] = {}
    for name, packets in counters.items():
        nft_id = dropped_counter_subject(name)
        if nft_id is not None:
            by_subject[nft_id] = packets
    return Refusals(by_subject, counters.get(UNATTRIBUTED_COUNTER, 0))


class FleetBackend:
    #: The subject's audit objects pass a would-deny (docs/reference/behaviour.md §8.3; the policy
    #: language's audit mode: docs/reference/policy-language.md).
    passes_would_deny = True

    @property
    def name_check(self) -> bool:
        return self.table.checks_names

    def __init__(
        self,
        table: TableConfig,
        tx: Transactions,
        *,
        probes: Callable[[str], Probes[Any]] | None = None,
    ) -> None:
        self.table = table
        self.tx = tx
        # The start-up self-test's probes (none: a backend built for tests, never self-tested).
        self.probes: Callable[[str], Probes[Any]] = probes if probes is not None else no_probes

    def may_hold(self, exc: BaseException) -> bool:
        # The per-subject dyn sets are rewritten from the book on every narrowing: a lease the
        # kernel may hold must be in the book, or a narrowing would not revoke it.
        return unless_refused(exc)

    def kernel_denies(self, effective: NetworkPolicy) -> tuple[Sequence[Prefix], Sequence[Prefix]]:
        contents = policy_contents(effective)
        return contents["deny_v4"], contents["deny_v6"]

    async def add_leases(self, uid: str, admitted: list[Grant]) -> None:
        batch = dyn_add(
            self.table.table, nft_id(subject_for_uid(uid)), admitted, replace=self.table.renew_by_replace
        )
        await self.tx.run_batch(batch, op="dynamic_add")

    async def tracked_flows(
        self, sources: Mapping[str, Collection[IPAddress]]
    ) -> Mapping[str, Sequence[Flow]] | None:
        every = sorted({ip for ips in sources.values() for ip in ips}, key=str)
        flows = await read_flow_dests(every)
        if flows is None:
            return None
        return {
            uid: [
                (src, dst, proto, port)
                for src in sorted(set(ips), key=str)
                for dst, proto, port in sorted(flows.get(src, ()), key=str)
            ]
            for uid, ips in sources.items()
        }

    async def cut_flow(self, flow: Flow) -> None:
        src, dst, proto, port = flow
        if src is None:  # the fleet's flows always have their subject's source
            raise ValueError("a fleet flow without a source")
        await flush_flow(src, dst, proto, port)

    def flow_fields(self, flow: Flow) -> dict[str, str]:
        return {"source_ip": str(flow[0])}

    def refusals(self, counters: Mapping[str, int]) -> Refusals:
        return fleet_refusals(counters)

