"""Request rules in the MITM child (docs/reference/behaviour.md §19), the pure part: the view of a
subject's policy that decides requests to one name (as ``GET /_requests`` sends it,
:mod:`egressd.mitm.requests`), and the decision of one request with it.

A view holds only the domain rules that match its name, with their indices in the subject's
effective policy, so :func:`egressd.policy.requests.decide_request` runs on them alone and the
index it returns is mapped back. Decisions are remembered per view (bounded): a view is
immutable, and is itself dropped when the narrowing map says the policy changed.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Final

from egressd.policy.model import NetworkPolicy, PolicyError, Rule, Verdict, parse_rule
from egressd.policy.reqpath import readings
from egressd.policy.requests import (
    ASTERISK,
    RequestDecision,
    RequestReason,
    request_path,
    target_refusal,
    without_query,
)
from egressd.policy.scope import rule_scope

MAX_DECISIONS: Final = 1024
#: The reason when egressd's view could not be had (never an admission).
LOOKUP_FAILED: Final = "request_rules_unavailable"
#: A plain-HTTP request naming no host, of a subject with request rules.
NO_HOST: Final = "no_host"


@dataclass(frozen=True, slots=True)
class Judgement:
    """One request's outcome: ``forward`` (audit lets a would-deny through), ``denied`` (the
    rules refuse it, or would in audit), the deciding rule's index in the effective policy."""

    forward: bool
    denied: bool
    reason: str
    rule: int | None


class RuleIndex:
    """First match over one name's rules without trying every rule: the rules that admit a
    (port, method) are indexed once (lazily, per pair) by exact path and by path prefix, so a
    decision costs a few dict lookups per path reading whatever the number of rules. It decides
    exactly as :func:`egressd.policy.requests.decide_request` (tests/unit/mitm/test_mitm_reqview.py
    compares them on random policies)."""

    def __init__(self, policy: NetworkPolicy) -> None:
        self.policy = policy
        self._by: dict[tuple[int, str], tuple[int | None, dict[str, int], dict[str, int]]] = {}

    def _index(self, port: int, method: str) -> tuple[int | None, dict[str, int], dict[str, int]]:
        key = (port, method)
        got = self._by.get(key)
        if got is not None:
            return got
        anypath: int | None = None
        exact: dict[str, int] = {}
        prefix: dict[str, int] = {}
        for i, rule in enumerate(self.policy.egress):
            if not rule.scope.admits("tcp", port) or (
                rule.methods is not None and method not in rule.methods
            ):
                continue
            if rule.paths is None:
                anypath = i if anypath is None else anypath
                continue
            for pattern in rule.paths:
                table, text = (prefix, pattern[:-1]) if pattern.endswith("*") else (exact, pattern)
                table.setdefault(text, i)
        got = (anypath, exact, prefix)
        if len(self._by) < MAX_DECISIONS:
            self._by[key] = got
        return got

    def first(self, port: int, method: str, path: str) -> int | None:
        anypath, exact, prefix = self._index(port, method)
        best = anypath
        hit = exact.get(path)
        if hit is not None and (best is None or hit < best):
            best = hit
        if prefix:
            for k in range(len(path) + 1):
                hit = prefix.get(path[:k])
                if hit is not None and (best is None or hit < best):
                    best = hit
        return best

    def decide(self, port: int, method: str, target: str) -> RequestDecision:
        """:func:`egressd.policy.requests.decide_request` for this view's name."""
        refused = target_refusal(method, target)
        if refused is not None:
            return refused
        method = method.upper()
        path = request_path(target)
        forms = (ASTERISK,) if path == ASTERISK else readings(path)
        if forms is None:
            return RequestDecision(Verdict.DENY, None, RequestReason.PATH_TRICK)
        allowed: RequestDecision | None = None
        for form in forms:
            i = self.first(port, method, form)
            if i is None:
                decision = RequestDecision(self.policy.default_action, None, RequestReason.DEFAULT)
            else:
                decision = RequestDecision(self.policy.egress[i].action, i, RequestReason.RULE)
            if not decision.allowed:
                return decision
            allowed = allowed or decision
        assert allowed is not None
        return allowed


@dataclass(slots=True)
class RuleView:
    subject: str
    judged: bool
    policy: NetworkPolicy  # the rules matching the name, in order
    indices: tuple[int, ...]  # their indices in the effective policy
    audit: bool = False
    always_deny: int = 0
    _memo: OrderedDict[tuple[int, str, str], Judgement] = field(default_factory=OrderedDict)
    _index: RuleIndex | None = None

    def judge(self, port: int, method: str, target: str) -> Judgement:
        key = (port, method, target)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        if self._index is None:
            self._index = RuleIndex(self.policy)
        out = self._judge(self._index.decide(port, method, target))
        self._memo[key] = out
        if len(self._memo) > MAX_DECISIONS:
            self._memo.popitem(last=False)
        return out

    def _judge(self, decision: RequestDecision) -> Judgement:
        rule = self.indices[decision.rule] if decision.rule is not None else None
        reason = decision.reason.value
        if decision.allowed:
            return Judgement(True, False, reason, rule)
        hard = rule is not None and rule < self.always_deny  # operator always-deny: enforced in audit
        return Judgement(self.audit and not hard, True, reason, rule)


#: The views' rules are renamed to this one name (a view is about one name: only its matching
#: rules are in it, so their targets need not be matched again).
_NAME: Final = "request.view.invalid"


def _strings(value: object) -> tuple[str, ...] | None:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        return None
    return tuple(value)


def _view_rule(doc: dict[str, Any], where: str, bases: dict[str, Rule]) -> Rule | None:
    """One rule of a view, renamed to the view's name (its free-text ``name`` dropped: it decides
    nothing). egressd validated it when the policy was written; its methods and paths are taken
    as sent (re-validating thousands of path patterns would stall the worker at every policy
    change), checked only for their shape; the rest is parsed once per distinct shape."""
    doc = {**doc, "target": _NAME}
    doc.pop("name", None)
    methods, paths = doc.pop("methods", None), doc.pop("paths", None)
    key = json.dumps(doc, sort_keys=True)
    base = bases.get(key)
    if base is None:
        base = bases[key] = parse_rule(doc, where)
    if methods is None and paths is None:
        return base
    m = _strings(methods) if methods is not None else None
    p = _strings(paths) if paths is not None else None
    if (methods is not None and m is None) or (
        paths is not None and (p is None or not all(x.startswith("/") for x in p))
    ):
        return None
    if m is not None and any(x != x.upper() for x in m):
        return None
    scope = rule_scope(base.protocol or "https", base.ports)
    return replace(base, scope=scope, methods=m, paths=p)


def parse_view(body: bytes) -> RuleView | None:
    """A ``GET /_requests`` reply body; None when malformed (the caller refuses)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    subject, judged, default = doc.get("subject"), doc.get("judged"), doc.get("defaultAction")
    audit, always, rules = doc.get("audit", False), doc.get("alwaysDeny", 0), doc.get("rules")
    if not isinstance(subject, str) or not isinstance(judged, bool) or not isinstance(audit, bool):
        return None
    if default not in ("allow", "deny") or not isinstance(rules, list):
        return None
    if not isinstance(always, int) or isinstance(always, bool) or always < 0:
        return None
    parsed = []
    indices = []
    bases: dict[str, Rule] = {}
    try:
        for item in rules:
            if not (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], int)
                and isinstance(item[1], dict)
            ):
                return None
            rule = _view_rule(item[1], f"egress[{item[0]}]", bases)
            if rule is None:
                return None
            parsed.append(rule)
            indices.append(item[0])
    except PolicyError:
        return None
    policy = NetworkPolicy(Verdict(default), tuple(parsed))
    return RuleView(subject, judged, policy, tuple(indices), audit, always)


def request_target(path: str) -> str:
    """What :func:`decide_request` takes as the target: the origin-form path with its query
    (mitmproxy turns absolute-form and HTTP/2's ``:path`` into it); ``*`` for a target that is no
    path (``OPTIONS *``, a CONNECT's authority-form): only rules without ``paths`` match it."""
    return path if path.startswith("/") else ASTERISK


def refusal_body(
    subject: str, host: str | None, method: str, path: str, reason: str, rule: int | None
) -> str:
    """The 403's JSON body: no query string, no header value."""
    return json.dumps(
        {
            "error": "egress_denied",
            "subject": subject,
            "host": host,
            "method": method,
            "path": without_query(path),
            "reason": reason,
            "rule": rule,
        }
    )


def report_doc(host: str, port: int, method: str, path: str, judgement: Judgement) -> dict[str, object]:
    """What the child reports to egressd (``POST /_requests``) of a refused (or, in audit, a
    would-refuse) request: no query string, no header value."""
    return {
        "host": host,
        "port": port,
        "method": method,
        "path": without_query(path),
        "reason": judgement.reason,
        "rule": judgement.rule,
        "audit": judgement.forward,
    }
