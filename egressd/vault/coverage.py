"""Whether a vault's binding hosts can be injected at all (docs/reference/behaviour.md §6 Coverage): each
host is covered by an explicit allow rule of the egress policy, and none is a MITM
``ignore_hosts`` pass-through."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from egressd.policy.evaluate import domain_matches, evaluate_domain
from egressd.policy.model import NetworkPolicy, TargetKind, Verdict
from egressd.vault.types import (
    SCHEME_PORTS,
    Binding,
    VaultError,
    _ancestors,
    _binding_label,
    _wildcard_suffix,
    echo,
)

__all__ = ["check_coverage", "check_ignore_hosts", "host_covered"]


def _probe_name(host: str) -> str:
    suffix = _wildcard_suffix(host)
    return host if suffix is None else f"probe.{suffix}"


def host_covered(policy: NetworkPolicy, host: str) -> bool:
    """The host (wildcards probed as ``probe.<suffix>``) evaluates to allow **and** an explicit
    allow rule names it: a domain rule equal to the host, or a ``*.`` rule matching the probe.
    defaultAction allow alone never covers."""
    probe = _probe_name(host)
    if evaluate_domain(policy, probe).verdict is not Verdict.ALLOW:
        return False
    for rule in policy.egress:
        if rule.kind is not TargetKind.DOMAIN or rule.action is not Verdict.ALLOW:
            continue
        if rule.target == host:
            return True
        if rule.target.startswith("*.") and domain_matches(rule.target, probe):
            return True
    return False


class _DomainIndex:
    """A policy's domain rules indexed for :func:`host_covered`'s two questions, O(labels) per
    host instead of a walk over every rule (14.7: a vault of 16 384 hosts against a policy of
    4096 rules would otherwise be 67 M rule matches). Same answers as the walk: the first
    matching rule is the one with the lowest index among the exact target and the ``*.``
    targets of the name's proper ancestors."""

    def __init__(self, policy: NetworkPolicy) -> None:
        self.policy = policy
        self.first: dict[str, int] = {}  # target -> index of its first domain rule
        self.allow: set[str] = set()  # targets of allow domain rules
        for k, rule in enumerate(policy.egress):
            if rule.kind is not TargetKind.DOMAIN:
                continue
            if rule.action is Verdict.DENY and rule.judges_requests:
                continue  # it denies requests, not the name (§19): no say in the name's coverage
            self.first.setdefault(rule.target, k)
            if rule.action is Verdict.ALLOW:
                self.allow.add(rule.target)

    def _wildcards(self, name: str) -> Iterable[str]:
        """``*.`` targets that may match ``name``: one per proper ancestor."""
        for ancestor in list(_ancestors(name))[1:]:
            yield f"*.{ancestor}"

    def verdict(self, name: str) -> Verdict:
        best = self.first.get(name)
        for target in self._wildcards(name):
            k = self.first.get(target)
            if k is not None and (best is None or k < best):
                best = k
        return self.policy.default_action if best is None else self.policy.egress[best].action

    def covers(self, host: str) -> bool:
        probe = _probe_name(host)
        if self.verdict(probe) is not Verdict.ALLOW:
            return False
        return host in self.allow or any(t in self.allow for t in self._wildcards(probe))


def check_coverage(bindings: Iterable[Binding], policy: NetworkPolicy | None) -> None:
    """Every binding host is covered by ``policy`` (§6 Coverage); bindings need a policy."""
    ordered = sorted(bindings, key=lambda b: b.name)
    if not ordered:
        return
    if policy is None:
        raise VaultError(
            "credential bindings require an egress policy, and there is none to check them against",
            "bindings",
        )
    index = _DomainIndex(policy)
    seen: dict[str, bool] = {}  # hosts repeat across bindings: each is decided once
    for binding in ordered:
        for k, host in enumerate(binding.match.hosts):
            covered = seen.get(host)
            if covered is None:
                covered = seen[host] = index.covers(host)
            if not covered:
                raise VaultError(
                    f"host {echo(host)} is not covered by an explicit allow rule of the egress policy",
                    f"{_binding_label(binding)}.match.hosts[{k}]",
                )


def check_ignore_hosts(bindings: Iterable[Binding], ignore_hosts: Sequence[re.Pattern[str]]) -> None:
    """No binding host (wildcards probed as ``probe.<suffix>``) may match a mitmproxy
    ``ignore_hosts`` pattern, tried on ``host`` and ``host:port`` for each of its schemes."""
    if not ignore_hosts:
        return
    for binding in sorted(bindings, key=lambda b: b.name):
        ports = [SCHEME_PORTS[s] for s in binding.match.schemes]
        for k, host in enumerate(binding.match.hosts):
            probe = _probe_name(host)
            candidates = [probe, *(f"{probe}:{p}" for p in ports)]
            if any(rex.search(c) for rex in ignore_hosts for c in candidates):
                raise VaultError(
                    f"host {echo(host)} matches the MITM ignore_hosts list, so it can never be injected",
                    f"{_binding_label(binding)}.match.hosts[{k}]",
                )
