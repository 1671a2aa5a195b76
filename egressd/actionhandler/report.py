"""What operators see: /v1/subjects, /v1/explain (with the kernel's own view) and the gauges.

Read-only: nothing here changes a subject or the kernel. The decision shown is the policy
layer's (policy/explain.py); the kernel view is read from the kernel itself, one netlink
dump per set, never from egressd's own bookkeeping (the kernel side's reader:
fleetnft/kernelview.py).
"""

from __future__ import annotations

import time
from typing import Any

from egressd.actionhandler.policies import EffectivePolicies
from egressd.actionhandler.revocation import Revocations
from egressd.actionhandler.shared import Shared
from egressd.addr import IPAddress, unmap_ip
from egressd.engine.errors import RulesetRefused
from egressd.engine.plansteps import PlanKernel, TableKnobs
from egressd.policy import NetworkPolicy
from egressd.policy.explain import explain as explain_target
from egressd.subject.leases import LeaseBook
from egressd.subject.registry import AnyBinding, Entry, HostBinding, State
from egressd.vault.store import VaultStore


class Report:
    def __init__(
        self,
        shared: Shared,
        kernel: PlanKernel,
        policies: EffectivePolicies,
        revocations: Revocations,
        leases: dict[str, LeaseBook],
        vaults: dict[str, VaultStore],
    ) -> None:
        self._shared = shared
        self._kernel = kernel
        self._policies = policies
        self._revocations = revocations
        self._leases = leases
        self._vaults = vaults

    def _entry_of(self, source: IPAddress | int) -> Entry | None:
        """The subject behind a source address, or behind a host uid (an ``int``, docs/reference/behaviour.md §17)."""
        if isinstance(source, int):
            return self._shared.registry.resolve_host_uid(source)
        return self._shared.registry.resolve(unmap_ip(source))

    def explain(
        self, source_ip: IPAddress | int, target: str, port: int | None = None, name_check: bool = False
    ) -> dict[str, Any]:
        """``source_ip`` is a sandbox address, or an ``int``: a host uid. ``port``: a TCP port;
        ``name_check``: whether the MITM checks names on the wire (docs/reference/behaviour.md §18)."""
        entry = self._entry_of(source_ip)
        now = time.monotonic()
        book = self._leases.get(entry.uid) if entry else None
        out = explain_target(
            state=entry.state.value if entry else None,
            effective=self._policies.effective_for(entry) if entry else None,
            leases=book.live(now) if book is not None else {},
            target=target,
            now=now,
            port=port,
            name_check=name_check,
            taught=(lambda ip: book.names_of(ip, now)) if book is not None else None,
        )
        if isinstance(source_ip, int):
            out["hostUid"] = source_ip
        else:
            out["sourceIp"] = str(source_ip)
        if entry is not None:
            out["subject"] = entry.subject
        return out

    async def kernel_membership(self, source_ip: IPAddress | int, target: IPAddress) -> dict[str, Any]:
        """What the kernel itself holds for ``target`` in the source's subject (explain):
        whether the source (an address, or a host uid) is in the dispatch map, and which of
        the subject's sets cover the address (with the remaining lifetime of a DNS lease)."""
        target = unmap_ip(target)
        registry, reader = self._shared.registry, self._kernel.reader
        entry = self._entry_of(source_ip)
        try:
            out: dict[str, Any] = {
                "available": True,
                "dispatched": await reader.dispatched(source_ip),
                "sets": [],
            }
            if entry is None or not registry.kernel(entry.uid).objects:
                return out
            out["sets"] = await reader.covering(entry.nft_id, target)
        except RulesetRefused as exc:
            return {"available": False, "error": str(exc)[:200]}
        return out

    def rules_count(self) -> dict[tuple[str, ...], float]:
        """Rules in the table: each installed subject's fixed rules."""
        registry, reader = self._shared.registry, self._kernel.reader
        views = [registry.kernel(e.uid) for e in registry]
        return {(): float(sum(reader.rules_per_subject(audit=v.audit, ranges=v.ranges) for v in views if v.rules))}

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
                    **_binding_fields(e.binding, self._kernel.table),
                    **_worker_field(e.binding, self._kernel, e.uid),
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


def _binding_fields(binding: AnyBinding | None, table: TableKnobs) -> dict[str, Any]:
    """The dispatch key of ``egressctl subjects``: an address and gateway, or a host uid and
    its ports (docs/reference/behaviour.md §17)."""
    if isinstance(binding, HostBinding):
        return {
            "sourceIp": None,
            "gateway": None,
            "hostUid": binding.host_uid,
            "dnsPort": table.uids.dns_port(binding.slot),
            "mitmPort": table.uids.mitm_port(binding.slot) if table.mitm else None,
        }
    return {
        "sourceIp": str(binding.ip) if binding else None,
        "gateway": str(binding.gateway) if binding and binding.gateway else None,
    }


def _worker_field(binding: AnyBinding | None, kernel: PlanKernel, uid: str) -> dict[str, Any]:
    """``mitmWorker``: the MITM worker its intercepted connections go to (EGRESSD_MITM_WORKERS),
    None without the MITM or before the subject has its MITM entries."""
    if not kernel.table.mitm or binding is None:
        return {"mitmWorker": None}
    return {"mitmWorker": kernel.steps.mitm_worker(uid, binding)}


def _policy_summary(policy: NetworkPolicy | None) -> dict[str, Any] | None:
    if policy is None:
        return None
    return {"defaultAction": policy.default_action.value, "rules": len(policy.egress)}
