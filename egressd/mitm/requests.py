"""The daemon's side of request rules in the MITM (docs/reference/behaviour.md §19):
``GET /_requests`` and ``POST /_requests`` on the private ``_active`` socket.

The child decides each request itself, with :func:`egressd.policy.requests.decide_request`
on the part of the subject's effective policy that can decide a request to one name: the
*view* (:func:`view_of`) that ``GET /_requests?clientIp=…[&port=…]&name=…`` returns. It keeps
the view under the narrowing sequence map's stamp (:mod:`egressd.mitm.seqmap`; every policy
change bumps the client's slot before its caller is answered), so a decision costs no round
trip, and a changed policy applies to the next request. A view that cannot be had refuses
(fail closed).

Reply 200 ``{"subject": "s-<uid>", "judged": bool, "defaultAction", "audit", "alwaysDeny",
"rules": [[index, rule], …]}``: ``judged`` whether some rule with ``methods``/``paths``
matches the name (without ``name``: whether any rule of the subject has them, for plain HTTP,
whose Host is not known when the connection is opened); ``rules`` the domain rules matching
the name, each with its 0-based index in the effective policy's ``egress``. 404: no active
subject behind the client (the child refuses); 400: a malformed query.

``POST /_requests`` (same client query, JSON body ``{"host","method","path","reason","rule",
"audit"}``) reports what the child refused (or, in audit mode, would have refused): counted
in the subject's drop count, logged, posted to the deny webhook with method and path, kept in
the recent denials. The child answers the client before it reports.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import structlog
from aiohttp import web

from egressd.addr import IPAddress
from egressd.mitm.names import NameRefusals, NameReport, _ip, _port
from egressd.mitm.protocol import REQUESTS_PATH
from egressd.policy.audit import new_decision_id, safe_token
from egressd.policy.evaluate import domain_matches, normalise_name
from egressd.policy.model import NetworkPolicy, TargetKind
from egressd.policy.requests import judges_requests
from egressd.subject.model import subject_for_uid

log = structlog.get_logger("egressd.mitm")

MAX_FIELD: Final = 2048

#: The profile's answer: the subject behind (client address, host-uid MITM port) and its
#: effective policy; None: no active subject there.
PolicyOf = Callable[[IPAddress, int | None], tuple[str, NetworkPolicy] | None]
#: Where a refused request goes besides the count and the log: (uid, host, port, method, path).
RequestDenied = Callable[[str, str, int | None, str, str], None]


def view_of(uid: str, policy: NetworkPolicy, name: str | None) -> dict[str, Any]:
    """The part of ``policy`` that decides requests to ``name`` (see the module docstring)."""
    doc: dict[str, Any] = {
        "subject": subject_for_uid(uid),
        "defaultAction": policy.default_action.value,
        "audit": policy.audit,
        "alwaysDeny": policy.always_deny,
    }
    if name is None:
        doc["judged"] = any(r.judges_requests for r in policy.egress)
        doc["rules"] = []
        return doc
    host = normalise_name(name)
    doc["judged"] = judges_requests(policy, host)
    doc["rules"] = (
        [
            [i, rule.to_json()]
            for i, rule in enumerate(policy.egress)
            if rule.kind is TargetKind.DOMAIN and domain_matches(rule.target, host)
        ]
        if doc["judged"]
        else []
    )
    return doc


@dataclass(frozen=True, slots=True)
class RequestReport:
    """A refused (or audit would-refuse) request, as the child reports it."""

    host: str
    port: int | None
    method: str
    path: str
    reason: str
    rule: int | None
    audit: bool


def parse_report(doc: object) -> RequestReport | None:
    if not isinstance(doc, dict):
        return None
    host, method, path, reason = (doc.get(k) for k in ("host", "method", "path", "reason"))
    if not all(isinstance(v, str) and len(v) <= MAX_FIELD for v in (host, method, path, reason)):
        return None
    rule, port, audit = doc.get("rule"), doc.get("port"), doc.get("audit", False)
    if rule is not None and (not isinstance(rule, int) or isinstance(rule, bool) or rule < 0):
        return None
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535):
        return None
    if not isinstance(audit, bool):
        return None
    assert (
        isinstance(host, str)
        and isinstance(method, str)
        and isinstance(path, str)
        and isinstance(reason, str)
    )
    return RequestReport(host, port, method, path.split("?", 1)[0], reason, rule, audit)


class RequestRefusals:
    """Counts (in the subject's name-check refusal count, exported with the kernel's drops),
    logs and posts the request rules' refusals."""

    def __init__(
        self,
        refusals: NameRefusals,
        denied: RequestDenied | None = None,
        would_deny: Callable[[str, str], None] | None = None,
    ) -> None:
        self.refusals = refusals
        self._denied = denied
        # Audit mode: (subject, rule label) of a request the policy would refuse, passed.
        self._would_deny = would_deny
        # The name check's per-subject log budget (LOG_PER_SECOND), a window of its own.
        self._lines = NameReport(NameRefusals())

    def __call__(self, uid: str, report: RequestReport) -> None:
        if not report.audit:
            self.refusals.add(uid)
            if self._denied is not None:
                self._denied(uid, report.host, report.port, report.method, report.path)
        elif self._would_deny is not None:
            rule = "default" if report.rule is None else f"egress[{report.rule}]"
            self._would_deny(subject_for_uid(uid), rule)
        suppressed = self._lines.may_log(uid)
        if suppressed is None:
            return
        log.info(
            "mitm.request_would_refuse" if report.audit else "mitm.request_refused",
            subject=safe_token(subject_for_uid(uid)),
            host=safe_token(report.host),
            port=report.port,
            method=safe_token(report.method),
            path=safe_token(report.path),
            reason=report.reason,
            rule=report.rule,
            audit=report.audit,
            decision_id=new_decision_id(),
            suppressed=suppressed or None,
        )


def add_requests_route(app: web.Application, policy_of: PolicyOf, report: RequestRefusals | None) -> None:
    async def handle(request: web.Request) -> web.Response:
        query = request.query
        client = _ip(query.get("clientIp"))
        listen_text = query.get("port")
        listen = _port(listen_text) if listen_text is not None else None
        name = query.get("name") or None
        if client is None or (listen_text is not None and listen is None):
            return web.Response(status=400, headers={"Cache-Control": "no-store"})
        if name is not None and (len(name) > 253 or not name.isascii()):
            return web.Response(status=400, headers={"Cache-Control": "no-store"})
        try:
            held = policy_of(client, listen)
        except Exception as exc:  # fail closed: the child refuses on anything but a 200
            log.warning("mitm.request_rules_failed", error=type(exc).__name__)
            return web.Response(status=503, headers={"Cache-Control": "no-store"})
        if held is None:
            return web.Response(status=404, headers={"Cache-Control": "no-store"})
        uid, policy = held
        if request.method == "POST":
            try:
                parsed = parse_report(json.loads(await request.read()))
            except ValueError:
                parsed = None
            if parsed is None:
                return web.Response(status=400)
            if report is not None:
                report(uid, parsed)
            return web.Response(status=204)
        if request.method != "GET":
            return web.Response(status=405, headers={"Allow": "GET, POST"})
        return web.Response(
            status=200,
            body=json.dumps(view_of(uid, policy, name)).encode(),
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    app.router.add_route("*", REQUESTS_PATH, handle)
