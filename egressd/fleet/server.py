"""aiohttp surface of the fleet profile (docs/reference/http-api.md "Fleet profile")."""

from __future__ import annotations

import ipaddress
import os
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from egressd.actionhandler.api import Result
from egressd.actionhandler.control import ControlPlane
from egressd.actionhandler.envelope import (
    API_VERSION,
    MAX_BODY_BYTES,
    EnvelopeError,
    LifecycleHook,
    RemoveBinding,
    SetBinding,
    parse_action,
)
from egressd.fleet.proxyroute import ProxyRouteAPI
from egressd.metrics import OPENMETRICS_CONTENT_TYPE, EgressMetrics
from egressd.subject.model import subject_for_uid
from egressd.web.body import BodyTooLarge, incomplete, read_limited, text
from egressd.web.serving import BodyIncomplete, InFlight
from egressd.web.transport import FORWARDED_PROTO, VaultTransport
from egressd.web.vaultapi import Reply
from egressd.web.writes import after_writes

log = structlog.get_logger("egressd.http")

ACTIONS_PATH = "/_fastlet/v1/actions"
STATUS_PATH = "/_fastlet/v1/actions/status"
MITM_CA_PATH = "/v1/mitm/ca"
MITM_CA_FINGERPRINT_HEADER = "X-Egressd-Mitm-Ca-Fingerprint"

_OPERATION_NAMES = {
    SetBinding: "SET_BINDING",
    LifecycleHook: "LIFECYCLE_HOOK",
    RemoveBinding: "REMOVE_BINDING",
}


def new_instance_id() -> str:
    return f"egress-{os.getpid()}-{secrets.token_hex(6)}"


class FleetHTTP:
    def __init__(
        self,
        control: ControlPlane,
        metrics: EgressMetrics,
        *,
        instance_id: str | None = None,
        extra_health: Callable[[], str | None] | None = None,
        status_extra: Callable[[], dict[str, Any]] | None = None,
        name_check: bool = False,
        proxy: ProxyRouteAPI | None = None,
        mitm_ca: Callable[[], tuple[str, str] | None] | None = None,
        before_scrape: Callable[[], Awaitable[None]] | None = None,
        vault_transport: VaultTransport | None = None,
        annotate_subjects: Callable[[list[dict[str, Any]]], Awaitable[dict[str, Any]]] | None = None,
        suggestion: Callable[[str], dict[str, Any] | None] | None = None,
    ) -> None:
        # egressctl suggest (docs/reference/behaviour.md §19): uid -> a policy, None when unknown.
        self._suggestion = suggestion
        self.proxy = proxy
        self.vault_transport = vault_transport or VaultTransport()
        # Adds kernel drop counts and recent denials to /v1/subjects (docs/reference/behaviour.md §15).
        self._annotate_subjects = annotate_subjects
        # () -> (public certificate PEM, SHA-256 hex of its DER), or None while the MITM is off.
        self._mitm_ca = mitm_ca
        self._before_scrape = before_scrape
        self.control = control
        self.metrics = metrics
        self.instance_id = instance_id or new_instance_id()
        self._extra_health = extra_health
        self._status_extra = status_extra
        self.name_check = name_check  # EGRESSD_NAME_CHECK with the MITM (docs/reference/behaviour.md §18)
        # Actions and proxy-route writes whose body was read run to their end (docs/reference/behaviour.md §14.10).
        self.inflight = InFlight(feed=control.feed)

    def health_problem(self) -> str | None:
        if not self.control.enforcement_ready:
            return "enforcement not installed"
        revoking = self.control.revoking()
        if revoking:
            # The kernel still holds more than these subjects may have (docs/reference/behaviour.md §14.6).
            names = ", ".join(sorted(subject_for_uid(uid) for uid in revoking))
            return f"revocation pending: {names}"
        if self._extra_health is not None:
            return self._extra_health()
        return None

    def app(self) -> web.Application:
        # client_max_size is a second line of defence; read_limited refuses first.
        app = web.Application(client_max_size=MAX_BODY_BYTES + 1, middlewares=[after_writes(self.control.feed)])
        self.inflight.attach(app)
        app.router.add_route("*", "/healthz", self.healthz)
        app.router.add_route("*", STATUS_PATH, self.status)
        app.router.add_route("*", ACTIONS_PATH, self.actions)
        app.router.add_route("*", "/metrics", self.metrics_handler)
        app.router.add_route("*", "/v1/subjects", self.subjects)
        app.router.add_route("*", "/v1/explain", self.explain)
        app.router.add_route("*", "/v1/subjects/{uid}/suggestion", self.suggestion)
        app.router.add_route("*", MITM_CA_PATH, self.mitm_ca)
        if self.proxy is not None:
            for path in (
                "/v1/sandboxfleets/{tail:.*}",
                "/credential-vault",
                "/credential-vault/{tail:.*}",
                "/policy",
            ):
                app.router.add_route("*", path, self.proxy_route)
        return app

    async def proxy_route(self, request: web.Request) -> web.Response:
        assert self.proxy is not None
        try:
            body = await read_limited(request)
        except BodyTooLarge:
            return text(413, f"request body exceeds {MAX_BODY_BYTES} bytes", headers={"Connection": "close"})
        except BodyIncomplete:
            return incomplete()
        reply = await self.inflight.run(self._proxy_reply(request, body))
        headers = {"Allow": reply.allow} if reply.allow else None
        if reply.encoded is not None:
            return web.Response(
                body=reply.encoded,
                status=reply.status,
                headers=headers,
                content_type="application/json",
                charset="utf-8",
            )
        if reply.json is not None:
            return web.json_response(reply.json, status=reply.status, headers=headers)
        if reply.text is not None:
            return text(reply.status, reply.text, headers=headers)
        return web.Response(status=reply.status, headers=headers)

    async def _proxy_reply(self, request: web.Request, body: bytes) -> Reply:
        assert self.proxy is not None
        try:
            secure = self.vault_transport.allows(request.remote, request.headers.get(FORWARDED_PROTO))
            return await self.proxy.handle(
                request.method, request.rel_url.raw_path, request.headers, body, secure_transport=secure
            )
        except Exception:
            log.exception("proxy_route.crashed", method=request.method)
            return Reply(500, text="internal error")

    async def healthz(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "HEAD"):
            return text(405, "method not allowed", headers={"Allow": "GET"})
        problem = self.health_problem()
        ca = self._mitm_ca() if self._mitm_ca is not None else None
        headers = {MITM_CA_FINGERPRINT_HEADER: ca[1]} if ca else {}
        if problem:
            return text(503, problem, headers=headers)
        return web.Response(status=200, text="ok", content_type="text/plain", headers=headers)

    async def status(self, request: web.Request) -> web.Response:
        if request.method != "GET":
            return text(405, "method not allowed", headers={"Allow": "GET"})
        body: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "ready": self.health_problem() is None,
            "instanceId": self.instance_id,
            "nameCheck": self.name_check,  # docs/reference/behaviour.md §18
        }
        if self._mitm_ca is not None:
            ca = self._mitm_ca()
            body["mitmCaFingerprint"] = ca[1] if ca else None
        if self._status_extra is not None:
            body.update(self._status_extra())
        return web.json_response(body)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        if request.method != "GET":
            return text(405, "method not allowed", headers={"Allow": "GET"})
        if self._before_scrape is not None:
            await self._before_scrape()  # e.g. the kernel's audit counters
        # Exemplars (the audit decision ids) exist only in OpenMetrics; Prometheus asks for it
        # in Accept when exemplar storage is on. Everyone else gets the 0.0.4 text as before.
        if "application/openmetrics-text" in request.headers.get("Accept", ""):
            return web.Response(
                body=self.metrics.render(openmetrics=True).encode(),
                headers={"Content-Type": OPENMETRICS_CONTENT_TYPE, "X-Content-Type-Options": "nosniff"},
            )
        return web.Response(
            text=self.metrics.render(),
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    async def suggestion(self, request: web.Request) -> web.Response:
        """A policy that would have admitted the subject's recent denials (read-only)."""
        if request.method != "GET":
            return text(405, "method not allowed", headers={"Allow": "GET"})
        doc = self._suggestion(request.match_info["uid"]) if self._suggestion is not None else None
        if doc is None:
            return text(404, "no active subject with that uid")
        return web.json_response(doc)

    async def subjects(self, request: web.Request) -> web.Response:
        """Operator view for egressctl (loopback only, like the rest of the fleet API)."""
        if request.method != "GET":
            return text(405, "method not allowed", headers={"Allow": "GET"})
        subjects = self.control.report.describe()
        extra = await self._annotate_subjects(subjects) if self._annotate_subjects is not None else {}
        return web.json_response({"subjects": subjects, **extra})

    async def explain(self, request: web.Request) -> web.Response:
        """Operator view for ``egressctl explain``: ?ip=<sandbox source ip>&target=<name or ip>,
        or ?hostUid=<host uid>&target=... for a host-uid sandbox (docs/reference/behaviour.md §17)."""
        if request.method != "GET":
            return text(405, "method not allowed", headers={"Allow": "GET"})
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | int
        host_uid = request.query.get("hostUid")
        if host_uid is not None:
            if not host_uid.strip().isascii() or not host_uid.strip().isdigit():
                return text(400, "hostUid must be a host uid (an integer)")
            ip = int(host_uid.strip())
        else:
            try:
                ip = ipaddress.ip_address(request.query.get("ip", "").strip())
            except ValueError:
                return text(400, "ip must be the sandbox's source IP address")
        target = request.query.get("target", "").strip()
        if not target:
            return text(400, "target (a name or an IP) is required")
        port_text = request.query.get("port")
        port: int | None = None
        if port_text is not None:
            port = int(port_text) if port_text.strip().isascii() and port_text.strip().isdigit() else 0
            if not 1 <= port <= 65535:
                return text(400, "port must be a TCP port (1..65535)")
        doc = self.control.report.explain(ip, target, port, self.name_check)
        try:
            target_ip = ipaddress.ip_address(target.split("/", 1)[0])
        except ValueError:
            target_ip = None  # a name: the kernel holds addresses, not names
        if target_ip is not None:
            doc["kernelView"] = await self.control.report.kernel_membership(ip, target_ip)
        return web.json_response(doc)

    async def mitm_ca(self, request: web.Request) -> web.Response:
        """The MITM CA's public certificate for ``egressctl ca`` (never the key)."""
        if request.method not in ("GET", "HEAD"):
            return text(405, "method not allowed", headers={"Allow": "GET"})
        ca = self._mitm_ca() if self._mitm_ca is not None else None
        if ca is None:
            return text(404, "mitm disabled")
        pem, fingerprint = ca
        return web.Response(
            status=200,
            text=pem,
            content_type="application/x-pem-file",
            headers={MITM_CA_FINGERPRINT_HEADER: fingerprint},
        )

    async def actions(self, request: web.Request) -> web.Response:
        if request.method != "POST":
            return text(405, "method not allowed", headers={"Allow": "POST"})
        try:
            body = await read_limited(request)
        except BodyTooLarge:
            self.metrics.actions.inc("unknown", "413")
            return text(413, f"request body exceeds {MAX_BODY_BYTES} bytes", headers={"Connection": "close"})
        except BodyIncomplete:
            self.metrics.actions.inc("unknown", "400")
            return incomplete()
        # From here on the action runs to its end even if the client goes away: a handler
        # cancelled (by a disconnect or by shutdown) stops waiting, the action does not.
        return await self.inflight.run(self._act(body))

    async def _act(self, body: bytes) -> web.Response:
        try:
            uids = self.control.table
            action = parse_action(body, uid_range=uids.uids.uid_range, own_uid=uids.own_uid)
        except EnvelopeError as exc:
            self.metrics.actions.inc("invalid", "400")
            return text(400, f"invalid action envelope: {exc}")
        op = _OPERATION_NAMES[type(action)]
        try:
            result = await self.control.handle(action)
        except Exception:
            # Never a traceback to the caller; the subject is left as closed as the plan allows.
            log.exception("action.crashed", operation=op, uid=action.uid)
            result = Result(500, "internal error")
        self.metrics.actions.inc(op, str(result.status))
        if result.status == 200:
            return web.json_response({})
        # A 400 reason can quote part of the binding input, which is never logged.
        reason = "invalid binding input" if result.status == 400 else result.reason
        log.info("action.refused", operation=op, uid=action.uid, code=result.status, reason=reason)
        return text(result.status, result.reason)
