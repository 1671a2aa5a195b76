"""The sidecar HTTP surface (docs/reference/behaviour.md §5, §6, §13; reference/egress-api.yaml).

``/policy`` (GET, POST/PUT replace, PATCH merge, DELETE by target), ``/credential-vault``
and its sub-resources, ``/healthz`` and ``/metrics``. With a token configured, ``/policy``
and ``/credential-vault*`` need ``OPENSANDBOX-EGRESS-AUTH`` (constant-time compare); the
401 never says whether a token is configured. Vault writes answer 412 until every
prerequisite of transparent credential injection holds (§6). Error bodies are one line of
text/plain and never quote a credential value or the token.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from egressd.actionhandler.envelope import MAX_BODY_BYTES
from egressd.feed import VaultChanged
from egressd.metrics import EgressMetrics
from egressd.policy import PolicyError, policy_mode, rule_cap_problem
from egressd.policy.requests import unenforceable_problem
from egressd.sidecar.engine import SidecarEngine
from egressd.sidecarnft.backend import SIDECAR_UID
from egressd.vault.offload import off_loop
from egressd.vault.parse import parse_create, parse_mutation
from egressd.vault.store import VaultStore
from egressd.vault.types import DEFAULT_LIMITS, VaultError, VaultLimits
from egressd.web.body import BodyTooLarge, incomplete, read_limited, text
from egressd.web.route import UID_HEADER, Resource, RouteError, classify
from egressd.web.serving import BodyIncomplete, InFlight
from egressd.web.transport import (
    FORWARDED_PROTO,
    REFUSAL_STATUS,
    REFUSAL_TEXT,
    VAULT_WRITE_METHODS,
    VaultTransport,
)
from egressd.web.vaultapi import NO_MATCH, Reply, edited_policy, vault_write
from egressd.web.writes import after_writes, refused_untouched

MITM_CA_FINGERPRINT_HEADER = "X-Egressd-Mitm-Ca-Fingerprint"
#: Audit (shadow) mode exists in the fleet profile only: the sidecar ruleset has no would-deny
#: rules, so accepting it would answer names the kernel then drops. Refused, never half-applied.
AUDIT_UNSUPPORTED = "mode: 'audit' is not supported by the sidecar profile (fleet only)"

log = structlog.get_logger("egressd.sidecar.http")

AUTH_HEADER = "OPENSANDBOX-EGRESS-AUTH"
_POLICY_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_VAULT_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_VAULT_WRITES = ("POST", "PUT", "PATCH")


@dataclass(frozen=True, slots=True)
class VaultPrerequisites:
    """What §6 requires before the sidecar accepts a vault write."""

    token_set: bool
    mitm_transparent: bool
    ssl_insecure: bool
    mode: str
    mitm_ready: Callable[[], bool] = lambda: False

    def problem(self) -> str | None:
        """Why vault writes are refused now (412), or None. Checked in a fixed order."""
        if not self.token_set:
            return "credential vault requires OPENSANDBOX_EGRESS_TOKEN to be set"
        if not self.mitm_transparent:
            return "credential vault requires OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT"
        if self.ssl_insecure:
            return "credential vault is disabled while OPENSANDBOX_EGRESS_MITMPROXY_SSL_INSECURE is on"
        if self.mode != "dns+nft":
            return "credential vault requires OPENSANDBOX_EGRESS_MODE=dns+nft"
        if not self.mitm_ready():
            return "credential proxy (transparent MITM) is not ready"
        return None


def token_matches(configured: str | None, presented: str | None) -> bool:
    """Constant-time comparison; no token configured means every request passes."""
    if configured is None:
        return True
    if presented is None:
        return False
    return hmac.compare_digest(
        presented.encode("utf-8", "surrogateescape"), configured.encode("utf-8", "surrogateescape")
    )


def _response(reply: Reply) -> web.Response:
    headers = {"Allow": reply.allow} if reply.allow else None
    if reply.encoded is not None:  # a vault write's answer, encoded in the vault worker
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


class SidecarHTTP:
    def __init__(
        self,
        engine: SidecarEngine,
        metrics: EgressMetrics,
        *,
        token: str | None,
        max_rules: int,
        prerequisites: VaultPrerequisites,
        extra_health: Callable[[], str | None] | None = None,
        mitm_ca: Callable[[], tuple[str, str]] | None = None,
        vault_limits: VaultLimits = DEFAULT_LIMITS,
        vault_transport: VaultTransport | None = None,
        before_scrape: Callable[[], Awaitable[None]] | None = None,
        name_check: bool = False,
    ) -> None:
        self.engine = engine
        self.name_check = name_check  # EGRESSD_NAME_CHECK with the MITM (docs/reference/behaviour.md §18)
        self._before_scrape = before_scrape  # e.g. the kernel's refusal counter (docs/reference/behaviour.md §15)
        self.vault_limits = vault_limits
        self.vault_transport = vault_transport or VaultTransport()
        self._mitm_ca = mitm_ca
        self.metrics = metrics
        self._token = token
        self.max_rules = max_rules
        self.prerequisites = prerequisites
        self._extra_health = extra_health
        self.vault: VaultStore | None = None
        # Policy and vault writes are serialised: a policy change checks vault coverage and
        # then awaits the kernel; no vault write may slip in between.
        self._lock = asyncio.Lock()
        # A write whose body was read runs to its end whatever the client does (docs/reference/behaviour.md §14.10).
        self.inflight = InFlight(feed=engine.feed)

    @property
    def enforcement_mode(self) -> str:
        return self.engine.table.mode

    # ---- app ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES + 1, middlewares=[after_writes(self.engine.feed)])
        self.inflight.attach(app)
        app.router.add_route("*", "/healthz", self.healthz)
        app.router.add_route("*", "/metrics", self.metrics_handler)
        app.router.add_route("*", "/policy", self._guarded(self.policy))
        app.router.add_route("*", "/credential-vault", self._guarded(self.credential_vault))
        app.router.add_route("*", "/credential-vault/{tail:.*}", self._guarded(self.credential_vault))
        return app

    def _guarded(
        self, handler: Callable[[web.Request, bytes], Awaitable[web.Response]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def wrapped(request: web.Request) -> web.Response:
            if not token_matches(self._token, request.headers.get(AUTH_HEADER)):
                refused_untouched(request)
                # Same answer for a missing and a wrong token.
                return text(401, "unauthorized")
            try:
                body = await read_limited(request)
            except BodyTooLarge:
                refused_untouched(request)
                return text(
                    413, f"request body exceeds {MAX_BODY_BYTES} bytes", headers={"Connection": "close"}
                )
            except BodyIncomplete:
                refused_untouched(request)
                return incomplete()
            return await self.inflight.run(run(request, body))

        async def run(request: web.Request, body: bytes) -> web.Response:
            try:
                return await handler(request, body)
            except Exception:
                log.exception("sidecar.http_crashed", method=request.method, path=request.path)
                return text(500, "internal error")

        return wrapped

    def health_problem(self) -> str | None:
        if not self.engine.enforcement_ready:
            return "enforcement not installed"
        if self._extra_health is not None:
            return self._extra_health()
        return None

    async def healthz(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "HEAD"):
            return text(405, "method not allowed", headers={"Allow": "GET"})
        problem = self.health_problem()
        # The MITM CA's fingerprint, so a sandbox image can check the CA it trusts.
        headers = {MITM_CA_FINGERPRINT_HEADER: self._mitm_ca()[1]} if self._mitm_ca is not None else {}
        if problem:
            return text(503, problem, headers=headers)
        return web.Response(status=200, text="ok", content_type="text/plain", headers=headers)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "HEAD"):
            return text(405, "method not allowed", headers={"Allow": "GET"})
        if self._before_scrape is not None:
            await self._before_scrape()
        return web.Response(
            text=self.metrics.render(),
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Content-Type-Options": "nosniff"},
        )

    # ---- /policy -----------------------------------------------------------------------------

    def _status(self, **extra: Any) -> dict[str, Any]:
        return {
            "status": "ok",
            "mode": policy_mode(self.engine.user),
            "enforcementMode": self.enforcement_mode,
            **extra,
        }

    async def policy(self, request: web.Request, body: bytes) -> web.Response:
        method = request.method
        if method not in _POLICY_METHODS:
            return text(405, "method not allowed", headers={"Allow": ", ".join(_POLICY_METHODS)})
        if method == "GET":
            return web.json_response(self._status(policy=self.engine.user.to_json(), nameCheck=self.name_check))
        async with self._lock:
            current = self.engine.user
            try:
                new, reason = edited_policy(method, current, body)
            except PolicyError as exc:
                return text(400, f"invalid policy: {exc.without_input()}")
            if new.audit:
                return text(400, f"invalid policy: {AUDIT_UNSUPPORTED}")
            if reason == NO_MATCH:
                return web.json_response(self._status(reason=reason))  # nothing removed, nothing applied
            problem = unenforceable_problem(new)  # §19: request rules only where the MITM judges them
            if problem is not None:
                return text(400, f"invalid policy: {problem}")
            problem = rule_cap_problem(new, self.max_rules)
            if problem is not None:
                return text(413, problem)
            if self.vault is not None:
                try:
                    self.vault.check_policy(self.engine.effective_for(new))
                except VaultError as exc:
                    return text(400, f"policy change uncovers a credential binding: {exc}")
            result = await self.engine.set_policy(new)
            if result.status != 200:
                return text(result.status, result.reason)
            extra = {"reason": reason} if reason else {}
            return web.json_response(self._status(**extra))

    # ---- /credential-vault -------------------------------------------------------------------

    async def credential_vault(self, request: web.Request, body: bytes) -> web.Response:
        try:
            # The fleet's route table, with the implicit subject as the sandbox id.
            req = classify(request.rel_url.raw_path, {UID_HEADER: SIDECAR_UID})
        except RouteError as exc:
            return text(exc.status, exc.reason)
        allowed = _VAULT_METHODS if req.resource is Resource.VAULT else ("GET",)
        method = request.method
        if method not in allowed:
            return text(405, "method not allowed", headers={"Allow": ", ".join(allowed)})
        if method in VAULT_WRITE_METHODS and not self.vault_transport.allows(
            request.remote, request.headers.get(FORWARDED_PROTO)
        ):
            # Before the body is even parsed: a credential that crossed a plain network is
            # refused, not validated (OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS).
            return text(REFUSAL_STATUS, REFUSAL_TEXT)
        if method in _VAULT_WRITES:
            # A malformed body is a 400 whatever the prerequisites (it could never succeed);
            # a well-formed one then waits for them (412). Values never reach the reason.
            # In the vault worker (14.7): DNS answers keep their latency meanwhile.
            shape = await off_loop(_shape_problem, method, body, self.vault_limits)
            if shape is not None:
                return text(400, shape)
            problem = self.prerequisites.problem()
            if problem is not None:
                return text(412, problem)
        async with self._lock:
            # Every vault change takes this lock, held across the threaded validation: writes
            # stay in arrival order and a /policy change cannot slip in between.
            reply, store = await vault_write(
                method,
                req.resource,
                req.name,
                body,
                lambda: self.vault,
                lambda: self.engine.effective,
                self.vault_limits,
            )
            self.vault = store
        if method != "GET":
            # After every vault write: the MITM child drops its cached snapshot (docs/reference/behaviour.md
            # §14.9). One sandbox per namespace: every cached client holds this one vault.
            self.engine.feed.publish(VaultChanged())
            log.info(
                "vault.write", method=method, code=reply.status, revision=store.revision if store else None
            )
        return _response(reply)


def _shape_problem(method: str, body: bytes, limits: VaultLimits = DEFAULT_LIMITS) -> str | None:
    """Why a vault write body is malformed (§6 shapes), or None; no state is consulted."""
    try:
        obj = json.loads(body) if body.strip() else None
    except (ValueError, RecursionError):
        return "body is not valid JSON"
    try:
        if method == "PATCH":
            parse_mutation(obj, limits)
        else:
            parse_create(obj, limits)
    except VaultError as exc:
        return str(exc)
    return None
