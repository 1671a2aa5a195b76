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


#: Above this many (old rule, new rule) pairs, :func:`names_narrow` asks for identical rules.
_EDIT_SEARCH_MAX = 1 << 16


def names_narrow(old: NetworkPolicy, new: NetworkPolicy) -> bool:
    """May a name that ``old`` admits be refused, or merely audited, under ``new``?

    Conservative: False only when ``new``'s domain rules are ``old``'s with some deny rules
    taken out and some allow rules put in, the others in the same order, its defaultAction is
    no narrower and auditing is not switched off. Each such edit alone never turns an allowed
    name into a denied one under first-match evaluation: a name whose first match was a
    removed deny falls to a later rule or the default, and an inserted allow can only become a
    name's first match in place of a rule that came after it."""
    if old.default_action is Verdict.ALLOW and new.default_action is Verdict.DENY:
        return True
    if old.audit and not new.audit:
        return True
    was = [(r.action, r.target) for r in old.egress if r.kind is TargetKind.DOMAIN]
    now = [(r.action, r.target) for r in new.egress if r.kind is TargetKind.DOMAIN]
    if was == now:
        return False
    if (len(was) + 1) * (len(now) + 1) > _EDIT_SEARCH_MAX:
        return True
    return not _edited_by_widening(was, now)


def _edited_by_widening(was: list[tuple[Verdict, str]], now: list[tuple[Verdict, str]]) -> bool:
    """Is ``now`` ``was`` with deny rules taken out and allow rules put in? (A search over the
    alignments: (i, j) = ``was[:i]`` turned into ``now[:j]``.)"""
    seen = {(0, 0)}
    todo = [(0, 0)]
    while todo:
        i, j = todo.pop()
        if (i, j) == (len(was), len(now)):
            return True
        steps = []
        if i < len(was) and j < len(now) and was[i] == now[j]:
            steps.append((i + 1, j + 1))
        if i < len(was) and was[i][0] is Verdict.DENY:
            steps.append((i + 1, j))  # taken out
        if j < len(now) and now[j][0] is Verdict.ALLOW:
            steps.append((i, j + 1))  # put in
        for step in steps:
            if step not in seen:
                seen.add(step)
                todo.append(step)
    return False
