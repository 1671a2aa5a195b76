"""The ruleset backend protocol: what the subject engine needs from a profile's kernel side.

The engine (:class:`egressd.engine.subjects.SubjectEngine`) owns every decision about a
subject's DNS leases, narrowings, flow cuts and verified destinations; a backend owns how its
ruleset holds them. Two implementations: the fleet's per-subject netlink objects
(:class:`egressd.fleetnft.backend.FleetBackend`) and the sidecar's whole-table ruleset with the
reference names (:class:`egressd.sidecarnft.backend.SidecarBackend`, one implicit subject).
Each also gives the start-up self-test its probes (:mod:`egressd.engine.selftest` runs them) and
reads its refusal counters (:mod:`egressd.engine.refusals` exports them).
A backend's transactions fail with :mod:`egressd.engine.errors`' two errors.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from egressd.addr import IPAddress
from egressd.engine.selftest import Probes
from egressd.policy import NetworkPolicy
from egressd.policy.ipsets import Prefix
from egressd.subject.leases import Grant

#: A tracked flow: (source, original destination, protocol, original destination port). The
#: source is None where the backend's flows are the whole namespace's (the sidecar): the
#: destination, protocol and port decide them. The port is None for a protocol without ports.
Flow = tuple[IPAddress | None, IPAddress, str, int | None]


@dataclass(frozen=True, slots=True)
class Refusals:
    """What a backend's refusal counters say (docs/reference/behaviour.md §15): packets refused
    per subject, by its nft id, and, where the backend can tell them apart, those of sources
    that are no subject (None: it cannot)."""

    by_subject: Mapping[str, int]
    unattributed: int | None = None


class RulesetBackend(Protocol):
    #: Whether this backend's kernel lets an audit policy's would-deny through (the fleet's audit
    #: objects). Where it does not, a would-deny flow is refused by the kernel and cut with it.
    passes_would_deny: bool
    @property
    def name_check(self) -> bool:
        """EGRESSD_NAME_CHECK in force (docs/reference/behaviour.md §18): the kernel opens UDP 443 of
        a DNS-learned address only for an explicit udp rule."""
        ...

    def may_hold(self, exc: BaseException) -> bool:
        """Whether the kernel may hold leases whose :meth:`add_leases` raised ``exc``: the engine
        then records them, so its book is never narrower than a kernel whose narrowings it
        rewrites from the book."""
        ...

    def kernel_denies(self, effective: NetworkPolicy) -> tuple[Sequence[Prefix], Sequence[Prefix]]:
        """The IPv4 and IPv6 deny prefixes this backend's kernel holds for ``effective``: a
        lease they cover never survives a narrowing (docs/reference/behaviour.md §14.1)."""
        ...

    async def add_leases(self, uid: str, admitted: list[Grant]) -> None:
        """Put learned leases (address, seconds, scope) into ``uid``'s dynamic allow sets, before the
        DNS answer leaves. Raises RulesetRefused (nothing applied) or RulesetUncertain."""
        ...

    async def tracked_flows(
        self, sources: Mapping[str, Collection[IPAddress]]
    ) -> Mapping[str, Sequence[Flow]] | None:
        """The tracked flows of each subject's ``sources`` (uid -> source addresses), in the
        order to judge them; None when the flow table could not be read (nothing is cut)."""
        ...

    async def cut_flow(self, flow: Flow) -> None:
        """End one tracked flow (raises when the kernel refused)."""
        ...

    def flow_fields(self, flow: Flow) -> dict[str, str]:
        """What a failed cut of ``flow`` logs (never more than addresses)."""
        ...

    def refusals(self, counters: Mapping[str, int]) -> Refusals:
        """The refusal counts among the table's named counters (one netlink dump)."""
        ...

    def probes(self, scratch_table: str) -> Probes[Any]:
        """The kernel features this backend's ruleset needs, for the start-up self-test."""
        ...
