"""What operators see: /v1/subjects, /v1/explain (with the kernel's own view) and the gauges.

Read-only: nothing here changes a subject or the kernel. The decision shown is the policy
layer's (policy/explain.py); the kernel view is read from the kernel itself, one netlink
dump per set, never from egressd's own bookkeeping.
"""

from __future__ import annotations

import ipaddress
import time
from typing import Any

from egressd.actionhandler.policies import EffectivePolicies
from egressd.actionhandler.revocation import Revocations
from egressd.actionhandler.shared import Shared
from egressd.fleetnft.builder import dispatch_map, family, rules_per_subject, subject_set
from egressd.kernel.applier import NftError
from egressd.kernel.netlink import element_covering
from egressd.policy import NetworkPolicy
from egressd.policy.explain import explain as explain_target
from egressd.subject.leases import LeaseBook
from egressd.subject.model import IPAddress, unmap_ip
from egressd.subject.registry import State
from egressd.vault.store import VaultStore


class Report:
    def __init__(
        self,
        shared: Shared,
        policies: EffectivePolicies,
        revocations: Revocations,
        leases: dict[str, LeaseBook],
        vaults: dict[str, VaultStore],
    ) -> None:
        self._shared = shared
        self._policies = policies
        self._revocations = revocations
        self._leases = leases
        self._vaults = vaults

    def explain(self, source_ip: IPAddress, target: str) -> dict[str, Any]:
        entry = self._shared.registry.resolve(unmap_ip(source_ip))
        now = time.monotonic()
        book = self._leases.get(entry.uid) if entry else None
        out = explain_target(
            state=entry.state.value if entry else None,
            effective=self._policies.effective_for(entry) if entry else None,
            leases=book.live(now) if book is not None else {},
            target=target,
            now=now,
        )
        out["sourceIp"] = str(source_ip)
        if entry is not None:
            out["subject"] = entry.subject
        return out

    async def kernel_membership(self, source_ip: IPAddress, target: IPAddress) -> dict[str, Any]:
        """What the kernel itself holds for ``target`` in the source's subject (explain):
        whether the source is in the dispatch map, and which of the subject's sets cover the
        address (with the remaining lifetime of a DNS lease)."""
        source_ip, target = unmap_ip(source_ip), unmap_ip(target)
        registry, table = self._shared.registry, self._shared.table.table
        dump = self._shared.tx.list_set_elements
        entry = registry.resolve(source_ip)
        try:
            dispatched = element_covering(
                source_ip, await dump(table, dispatch_map(family(source_ip))), interval=False
            )
            out: dict[str, Any] = {"available": True, "dispatched": dispatched is not None, "sets": []}
            if entry is None or not registry.kernel(entry.uid).objects:
                return out
            for kind, interval in (("deny", True), ("allow", True), ("dyn", False)):
                name = subject_set(entry.nft_id, kind, family(target))
                hit = element_covering(target, await dump(table, name), interval=interval)
                if hit is None:
                    continue
                element, end = hit
                item: dict[str, Any] = {
                    "set": name,
                    "element": _element_text(element.key, end, interval=interval),
                }
                if element.expires_ms is not None:
                    item["expiresInS"] = round(element.expires_ms / 1000)
                out["sets"].append(item)
        except NftError as exc:
            return {"available": False, "error": str(exc)[:200]}
        return out

    def rules_count(self) -> dict[tuple[str, ...], float]:
        """Rules in the table: each installed subject's fixed rules."""
        registry = self._shared.registry
        installed = sum(1 for e in registry if registry.kernel(e.uid).rules)
        return {(): float(rules_per_subject(self._shared.table) * installed)}

    def state_counts(self) -> dict[tuple[str, ...], float]:
        counts = self._shared.registry.counts()
        return {(s.value,): float(n) for s, n in counts.items()}

    def describe(self) -> list[dict[str, Any]]:
        registry = self._shared.registry
        out = []
        now = time.monotonic()
        for e in sorted(registry, key=lambda e: e.uid):
            pol = e.policy if e.state is State.ACTIVE else None
            out.append(
                {
                    "subject": e.subject,
                    "uid": e.uid,
                    "state": e.state.value,
                    # The kernel refused a narrowing and egressd is retrying it (14.6).
                    "revoking": e.uid in self._revocations.pending,
                    "sourceIp": str(e.binding.ip) if e.binding else None,
                    "gateway": str(e.binding.gateway) if e.binding and e.binding.gateway else None,
                    "specGeneration": e.spec_generation,
                    "pending": e.pending is not None,
                    "kernelInstalled": registry.kernel(e.uid).objects,
                    "policy": _policy_summary(pol),
                    # Audit (shadow) mode of the ACTIVE policy only: deny-first never audits.
                    "auditMode": bool(pol is not None and pol.audit),
                    "vaultRevision": self._vaults[e.uid].revision if e.uid in self._vaults else None,
                    "leases": len(self._leases[e.uid].live(now)) if e.uid in self._leases else 0,
                }
            )
        return out


def _element_text(start: bytes, end: bytes | None, *, interval: bool) -> str:
    """A set element as nft would print it: an address, or an interval [start, end) as CIDR(s)
    (``end`` None in an interval set: up to the top of the address space)."""
    first = ipaddress.ip_address(start)
    if not interval:
        return str(first)
    top = (1 << (8 * len(start))) - 1
    last = ipaddress.ip_address(int.from_bytes(end, "big") - 1 if end is not None else top)
    nets = ipaddress.summarize_address_range(first, last)
    return ", ".join(str(n.network_address) if n.num_addresses == 1 else str(n) for n in nets)


def _policy_summary(policy: NetworkPolicy | None) -> dict[str, Any] | None:
    if policy is None:
        return None
    return {"defaultAction": policy.default_action.value, "rules": len(policy.egress)}
