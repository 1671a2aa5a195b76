"""DNS-layer evaluation of a policy (§5): domain rules in order, first match wins."""

from __future__ import annotations

from dataclasses import dataclass, field

from egressd.policy.model import NetworkPolicy, Rule, TargetKind, Verdict


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome for one name; ``rule`` (and ``index`` in ``egress``) None when the defaultAction applied."""

    verdict: Verdict
    rule: Rule | None
    index: int | None = field(default=None, compare=False)


def normalise_name(name: str) -> str:
    """Lower-case and strip one trailing dot (``WWW.Example.COM.`` -> ``www.example.com``)."""
    name = name.lower()
    return name[:-1] if name.endswith(".") else name


def domain_matches(pattern: str, name: str) -> bool:
    """Exact equality, or ``*.x.com`` matching names with at least one extra label.

    A wildcard never matches its apex: ``*.x.com`` matches ``a.x.com`` and ``a.b.x.com``
    but not ``x.com``. Both sides are normalised first.
    """
    return _matches(normalise_name(pattern), normalise_name(name))


def _matches(pattern: str, name: str) -> bool:
    """:func:`domain_matches` on already-normalised sides (policy targets are normalised at
    parse time, so the per-query loop does not redo it for every rule)."""
    if pattern == name:
        return True
    if not pattern.startswith("*."):
        return False
    suffix = pattern[1:]  # ".x.com"
    return name.endswith(suffix) and len(name) > len(suffix) and not name[: -len(suffix)].endswith(".")


def evaluate_domain(policy: NetworkPolicy, name: str) -> Decision:
    """The first domain rule matching ``name`` decides; IP/CIDR rules play no part here."""
    name = normalise_name(name)
    for i, rule in enumerate(policy.egress):
        if rule.kind is TargetKind.DOMAIN and _matches(rule.target, name):
            return Decision(rule.action, rule, i)
    return Decision(policy.default_action, None)
