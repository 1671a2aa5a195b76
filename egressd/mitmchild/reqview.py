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
from dataclasses import dataclass, field
from typing import Final

from egressd.policy.model import NetworkPolicy, PolicyError, Verdict, parse_rule
from egressd.policy.requests import ASTERISK, RequestDecision, decide_request

MAX_DECISIONS: Final = 1024
#: The reason when egressd's view could not be had (never an admission).
LOOKUP_FAILED: Final = "request_rules_unavailable"


@dataclass(frozen=True, slots=True)
class Judgement:
    """One request's outcome: ``forward`` (audit lets a would-deny through), ``denied`` (the
    rules refuse it, or would in audit), the deciding rule's index in the effective policy."""

    forward: bool
    denied: bool
    reason: str
    rule: int | None


@dataclass(slots=True)
class RuleView:
    subject: str
    judged: bool
    policy: NetworkPolicy  # the rules matching the name, in order
    indices: tuple[int, ...]  # their indices in the effective policy
    audit: bool = False
    always_deny: int = 0
    _memo: OrderedDict[tuple[int, str, str], Judgement] = field(default_factory=OrderedDict)

    def judge(self, port: int, method: str, target: str) -> Judgement:
        key = (port, method, target)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        out = self._judge(decide_request(self.policy, _NAME, port, method, target))
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
    try:
        for item in rules:
            if not (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], int)
                and isinstance(item[1], dict)
            ):
                return None
            rule = dict(item[1])
            rule["target"] = _NAME
            parsed.append(parse_rule(rule, f"egress[{item[0]}]"))
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
            "path": path.split("?", 1)[0].split("#", 1)[0],
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
        "path": path.split("?", 1)[0].split("#", 1)[0],
        "reason": judgement.reason,
        "rule": judgement.rule,
        "audit": judgement.forward,
    }
