"""DNS-layer evaluation of a policy (§5): domain rules in order, first match wins."""

from __future__ import annotations

from dataclasses import dataclass, field

from egressd.policy.model import NetworkPolicy, Rule, TargetKind, Verdict
from egressd.policy.scope import Scope


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


def _decides_name(rule: Rule, name: str) -> bool:
    """A domain rule matching ``name`` that decides names: every one but a deny with
    ``methods``/``paths``, which denies requests, not the name (§19)."""
    if rule.kind is not TargetKind.DOMAIN or not _matches(rule.target, name):
        return False
    return rule.action is Verdict.ALLOW or not rule.judges_requests


def evaluate_domain(policy: NetworkPolicy, name: str) -> Decision:
    """Whether ``name`` is answered (and learned), and the rule that says so.

    Domain rules in order, first match wins, per protocol and port (§18): a rule that names
    ports or a protocol decides only those, later rules and the defaultAction the rest. The
    name is allowed when some port of it is (the lease opens just those, :func:`name_scope`);
    the deciding rule is then the first allow rule that opened a port (None: the
    defaultAction). Denied: the first deny rule matching it (None: the defaultAction).
    Without ports and protocols this is plain first-match. IP/CIDR rules play no part here.
    """
    name = normalise_name(name)
    undecided = Scope.WHOLE
    first_deny: tuple[Rule, int] | None = None
    for i, rule in enumerate(policy.egress):
        if not _decides_name(rule, name):
            continue
        if rule.action is Verdict.ALLOW:
            if not undecided.intersect(rule.scope).is_empty():
                return Decision(Verdict.ALLOW, rule, i)
        elif first_deny is None:
            first_deny = (rule, i)
        undecided = undecided.minus(rule.scope)
        if undecided.is_empty():
            break
    if policy.default_action is Verdict.ALLOW and not undecided.is_empty():
        return Decision(Verdict.ALLOW, None)
    if first_deny is not None:
        return Decision(Verdict.DENY, first_deny[0], first_deny[1])
    return Decision(policy.default_action, None)


def name_scope(policy: NetworkPolicy, name: str) -> Scope:
    """The protocols and ports on which ``name`` may be reached (§18): first match per port
    over the domain rules matching it, the defaultAction for the ports no rule decides. Empty:
    the name is denied. What a DNS lease of the name opens, and what the MITM's name check
    admits for it."""
    name = normalise_name(name)
    undecided = Scope.WHOLE
    opened = Scope.EMPTY
    for rule in policy.egress:
        if not _decides_name(rule, name):
            continue
        if rule.action is Verdict.ALLOW:
            opened = opened.union(undecided.intersect(rule.scope))
        undecided = undecided.minus(rule.scope)
        if undecided.is_empty():
            break
    if policy.default_action is Verdict.ALLOW:
        opened = opened.union(undecided)
    return opened


def name_denied_by_rule(policy: NetworkPolicy, name: str) -> bool:
    """A deny rule, not just the defaultAction, refuses ``name`` on every port (§18: such a name is
    refused by SNI and Host on any address, also under ``defaultAction: allow``)."""
    decision = evaluate_domain(policy, name)
    return decision.verdict is Verdict.DENY and decision.rule is not None


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
    was = [(r.action, r.target, r.scope, r.methods, r.paths) for r in old.egress if r.kind is TargetKind.DOMAIN]
    now = [(r.action, r.target, r.scope, r.methods, r.paths) for r in new.egress if r.kind is TargetKind.DOMAIN]
    if was == now:
        return False
    if (len(was) + 1) * (len(now) + 1) > _EDIT_SEARCH_MAX:
        return True
    return not _edited_by_widening(was, now)


_RuleKey = tuple[Verdict, str, Scope, tuple[str, ...] | None, tuple[str, ...] | None]


def _edited_by_widening(was: list[_RuleKey], now: list[_RuleKey]) -> bool:
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
