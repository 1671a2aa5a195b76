"""The whole-candidate checks of a vault write (docs/reference/behaviour.md §6, 14.7), in order: size,
references, ambiguity, coverage, ignore_hosts."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from egressd.policy.model import NetworkPolicy
from egressd.vault.ambiguity import check_ambiguity
from egressd.vault.coverage import check_coverage, check_ignore_hosts
from egressd.vault.parse import check_references
from egressd.vault.types import DEFAULT_LIMITS, Binding, Credential, VaultLimits, _binding_label, _over_limit

__all__ = ["check_size", "validate_candidate"]


def check_size(credentials: int, bindings: Iterable[Binding], limits: VaultLimits = DEFAULT_LIMITS) -> None:
    """A whole candidate within the caps (14.7): what a PATCH adds on top of an existing vault
    counts with what is already there."""
    items = list(bindings)
    if credentials > limits.credentials:
        raise _over_limit("credentials", credentials, limits.credentials, "credentials")
    if len(items) > limits.bindings:
        raise _over_limit("bindings", len(items), limits.bindings, "bindings")
    for b in items:
        if len(b.match.hosts) > limits.hosts_per_binding:
            raise _over_limit(
                "hosts", len(b.match.hosts), limits.hosts_per_binding, f"{_binding_label(b)}.match.hosts"
            )
        if len(b.match.paths) > limits.paths_per_binding:
            raise _over_limit(
                "paths", len(b.match.paths), limits.paths_per_binding, f"{_binding_label(b)}.match.paths"
            )


def validate_candidate(
    credentials: Mapping[str, Credential],
    bindings: Iterable[Binding],
    policy: NetworkPolicy | None,
    ignore_hosts: Sequence[re.Pattern[str]] = (),
    limits: VaultLimits = DEFAULT_LIMITS,
) -> None:
    """The whole-vault checks, in order: size, references, ambiguity, coverage, ignore_hosts."""
    ordered = sorted(bindings, key=lambda b: b.name)
    check_size(len(credentials), ordered, limits)
    check_references(credentials, ordered)
    check_ambiguity(ordered)
    check_coverage(ordered, policy)
    check_ignore_hosts(ordered, (*ignore_hosts, *limits.ignore_hosts))
