"""Request rules (docs/reference/behaviour.md §19): which HTTP requests a policy admits. Pure.

A rule with ``methods`` or ``paths`` makes its name's requests part of the policy: each request
to such a name is decided by the first rule, in policy order, that matches its name, port,
method and path (a rule without ``methods``/``paths`` matches every request), the
``defaultAction`` when none does. The path is judged in every way a server may read it
(:func:`egressd.policy.reqpath.readings`); the request passes only when every reading does.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Final

from egressd.policy.evaluate import _matches, normalise_name
from egressd.policy.mitmports import never_intercepted
from egressd.policy.model import NetworkPolicy, Rule, TargetKind, Verdict
from egressd.policy.reqpath import readings, target_problem


class RequestReason(enum.StrEnum):
    RULE = "rule"  # a rule decided (allowed or denied)
    DEFAULT = "default_action"  # no rule matched
    PATH_TRICK = "path_not_canonical"  # a path that reads differently to different servers
    METHOD_TRICK = "method_not_token"  # a method that is no RFC 9110 token (``GET /user``)


@dataclass(frozen=True, slots=True)
class RequestDecision:
    """``rule``: 0-based index in the policy's ``egress`` of the deciding rule (None: the
    defaultAction, or a path trick)."""

    verdict: Verdict
    rule: int | None
    reason: RequestReason

    @property
    def allowed(self) -> bool:
        return self.verdict is Verdict.ALLOW


def judges_requests(policy: NetworkPolicy, name: str) -> bool:
    """Some rule with ``methods``/``paths`` matches ``name``: its requests are judged (and its
    TLS connections decrypted to judge them)."""
    name = normalise_name(name)
    return any(
        rule.judges_requests and rule.kind is TargetKind.DOMAIN and _matches(rule.target, name)
        for rule in policy.egress
    )


def _path_matches(path: str, pattern: str) -> bool:
    if pattern.endswith("*"):
        return path.startswith(pattern[:-1])
    return path == pattern


def _rule_matches(rule: Rule, port: int, method: str, path: str) -> bool:
    if not rule.scope.admits("tcp", port):
        return False
    if rule.methods is not None and method not in rule.methods:
        return False
    return rule.paths is None or any(_path_matches(path, p) for p in rule.paths)


#: An RFC 9110 method token. HTTP/2 lets a ``:method`` carry spaces (``GET /user``), and
#: mitmproxy writes it into the HTTP/1 request line upstream as it came: ``GET /user /repos/x``.
_TOKEN: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def method_problem(method: str) -> bool:
    """True when ``method`` is not a token: the upstream may read another method and path."""
    return _TOKEN.fullmatch(method) is None


def target_refusal(method: str, target: str) -> RequestDecision | None:
    """The refusal of a request whose method or request-target reads differently to different
    servers, whatever the rules say; None when both are clean."""
    if method_problem(method):
        return RequestDecision(Verdict.DENY, None, RequestReason.METHOD_TRICK)
    if target_problem(target):
        return RequestDecision(Verdict.DENY, None, RequestReason.PATH_TRICK)
    return None


#: A request-target that is no path (``OPTIONS *``): only rules without ``paths`` match it.
ASTERISK: Final = "*"


def without_query(target: str) -> str:
    """A request-target without its query and fragment (what a refusal may show of it)."""
    return target.split("?", 1)[0].split("#", 1)[0]


def request_path(target: str) -> str:
    """The path of a request-target without query and fragment (``""`` -> ``/``)."""
    return without_query(target) or "/"


def decide_request(policy: NetworkPolicy, name: str, port: int, method: str, target: str) -> RequestDecision:
    """The decision for one request to ``name`` on TCP ``port``: ``method`` as sent (judged
    upper-cased, as the strictest server reads it), ``target`` the origin-form path with its
    query (the MITM turns absolute-form and HTTP/2's ``:path`` into it)."""
    name = normalise_name(name)
    refused = target_refusal(method, target)
    if refused is not None:
        return refused
    method = method.upper()
    path = request_path(target)
    forms = (ASTERISK,) if path == ASTERISK else readings(path)
    if forms is None:
        return RequestDecision(Verdict.DENY, None, RequestReason.PATH_TRICK)
    rules = [
        (i, rule)
        for i, rule in enumerate(policy.egress)
        if rule.kind is TargetKind.DOMAIN and _matches(rule.target, name)
    ]
    allowed: RequestDecision | None = None
    for form in forms:
        decision = _first_match(policy, rules, port, method, form)
        if not decision.allowed:
            return decision
        allowed = allowed or decision
    assert allowed is not None
    return allowed


def _first_match(
    policy: NetworkPolicy, rules: list[tuple[int, Rule]], port: int, method: str, path: str
) -> RequestDecision:
    for i, rule in rules:
        if _rule_matches(rule, port, method, path):
            return RequestDecision(rule.action, i, RequestReason.RULE)
    return RequestDecision(policy.default_action, None, RequestReason.DEFAULT)


#: The TCP ports the MITM intercepts, as the running daemon configured it (None: not known, as in
#: pure callers and tools: no check). Set once at start-up by :func:`set_intercepted_ports`.
_intercepted: frozenset[int] | None = None


def intercepted_ports(mitm: bool, extra: tuple[int, ...]) -> frozenset[int]:
    """The ports whose requests the MITM can judge: none without it, else 80, 443 and the extras."""
    return frozenset({80, 443, *extra}) if mitm else frozenset()


def set_intercepted_ports(ports: frozenset[int] | None) -> None:
    """The daemon's MITM: ``frozenset()`` when it is off, else the ports it is redirected
    (80, 443 and ``OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS``)."""
    global _intercepted
    _intercepted = ports


def daemon_intercepted_ports() -> frozenset[int] | None:
    """The ports every subject's TCP is intercepted on, as :func:`set_intercepted_ports` set
    them (None: not known; ``frozenset()``: the MITM is off)."""
    return _intercepted


def unenforceable_problem(policy: NetworkPolicy, ports: frozenset[int] | None = None) -> str | None:
    """A one-line 400 reason when some rule's ``methods``/``paths`` could not be enforced by
    this daemon: without the MITM, or on a port the MITM never sees (53, 853: their requests
    would pass unjudged). Every other port such a rule names is intercepted for its subject
    (:mod:`egressd.policy.mitmports`). None when all can be (or nothing is known about the MITM)."""
    ports = _intercepted if ports is None else ports
    if ports is None:
        return None
    for i, rule in enumerate(policy.egress):
        if not rule.judges_requests:
            continue
        if not ports:
            return f"egress[{i}]: methods and paths need the MITM (OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT=1)"
        if never_intercepted(rule.scope):
            return f"egress[{i}].ports: methods and paths cannot be judged on the DNS ports 53 and 853"
    return None
