"""The proxy-route surface (docs/reference/actions-protocol.md §4): per-subject credential vault and /policy pushes.

:meth:`ProxyRouteAPI.handle` is transport-free (method, path, headers, body in; :class:`Reply`
out) so the same code serves HTTP and the replay of cached pushes. Bodies and vault values
are never logged; error replies are one line and never quote a credential value.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from egressd.actionhandler.api import SubjectListener
from egressd.actionhandler.control import ControlPlane
from egressd.policy import (
    PolicyError,
    policy_mode,
    rule_cap_problem,
)
from egressd.subject.model import subject_for_uid
from egressd.subject.registry import Entry, State
from egressd.vault.pending import PendingFull
from egressd.vault.types import VaultError
from egressd.web.route import Resource, RouteError, RouteRequest, classify
from egressd.web.transport import REFUSAL_STATUS, REFUSAL_TEXT, VAULT_WRITE_METHODS
from egressd.web.vaultapi import NO_MATCH, Reply, edited_policy, vault_write

log = structlog.get_logger("egressd.proxyroute")

_VAULT_METHODS = ("GET", "PUT", "POST", "PATCH", "DELETE")
_POLICY_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_PENDING_REASON = "subject not registered yet; push cached"
_DENYING_REASON = "subject denying; SET_BINDING input is authoritative"


class ProxyRouteAPI(SubjectListener):
    def __init__(
        self, control: ControlPlane, *, max_rules: int = 4096, clock: Callable[[], float] = time.monotonic
    ):
        self.control = control
        self.credentials = control.credentials  # the vaults, their pending pushes and limits
        self.max_rules = max_rules
        self.clock = clock
        control.listeners.append(self)

    # ---- entry point -----------------------------------------------------------------------

    async def handle(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        *,
        secure_transport: bool = True,
    ) -> Reply:
        """``secure_transport``: whether the request's transport may carry a vault write
        (OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS, decided by the HTTP shell)."""
        try:
            req = classify(path, headers)
        except RouteError as exc:
            return Reply(exc.status, text=exc.reason)
        allowed = self._allowed(req)
        if method not in allowed:
            return Reply(405, text="method not allowed", allow=", ".join(allowed))
        if req.resource is Resource.VAULT and method in VAULT_WRITE_METHODS and not secure_transport:
            # Refused before it is cached or parsed, like the sidecar.
            return Reply(REFUSAL_STATUS, text=REFUSAL_TEXT)
        async with self.control.locks.hold(req.uid):
            return await self._handle_locked(method, req, body, cache=True)

    @staticmethod
    def _allowed(req: RouteRequest) -> tuple[str, ...]:
        if req.resource is Resource.VAULT:
            return _VAULT_METHODS
        if req.resource is Resource.POLICY:
            return _POLICY_METHODS
        return ("GET",)

    async def _handle_locked(self, method: str, req: RouteRequest, body: bytes, *, cache: bool) -> Reply:
        entry = self.control.registry.get(req.uid)
        if entry is None:
            if method == "GET":
                return Reply(404, text="sandbox not registered")
            if not cache:
                return Reply(404, text="sandbox not registered")
            try:
                self.credentials.pending_pushes.add(
                    req.uid, method, req.suffix, body, req.generation, self.clock()
                )
            except PendingFull:
                return Reply(503, text="too many pending pushes for this sandbox; retry later")
            if req.resource is Resource.POLICY:
                return Reply(202, json={"status": "pending", "reason": _PENDING_REASON})
            return Reply(202)
        if req.resource is Resource.POLICY:
            return await self._policy(method, entry, body)
        return await self._vault(method, req, body)

    # ---- vault -----------------------------------------------------------------------------

    async def _vault(self, method: str, req: RouteRequest, body: bytes) -> Reply:
        # Called with the subject lock held (handle() and the replay in registered()), and
        # every other change to this subject's vault takes that lock too: the lock is held
        # across the threaded validation, so writes of one subject stay in arrival order.
        uid = req.uid
        reply, store = await vault_write(
            method,
            req.resource,
            req.name,
            body,
            lambda: self.credentials.stores.get(uid),
            lambda: self.credentials.coverage_policy(uid),
            self.credentials.limits,
        )
        if store is None:
            self.credentials.stores.pop(uid, None)
        else:
            self.credentials.stores[uid] = store
        if method != "GET":
            self.credentials.view_changed(uid)  # the MITM child drops its snapshot (14.9)
        if method in ("PUT", "POST", "PATCH"):
            revision = store.revision if store is not None else None
            log.info(
                "vault.write",
                subject=subject_for_uid(uid),
                method=method,
                code=reply.status,
                revision=revision,
            )
        return reply

    # ---- /policy (PROPOSED in §4) ----------------------------------------------------------

    async def _policy(self, method: str, entry: Entry, body: bytes) -> Reply:
        if method == "GET":
            out: dict[str, Any] = {
                "status": entry.state.value,
                "mode": policy_mode(entry.policy),
                # "mode" is deny_all/allow_all/enforcing (SDK contract); audit is reported apart.
                "auditMode": _audit_mode(entry),
            }
            if entry.state is State.ACTIVE and entry.policy is not None:
                out["policy"] = entry.policy.to_json()
            return Reply(200, json=out)
        if entry.state is not State.ACTIVE or entry.policy is None:
            return Reply(202, json={"status": "pending", "reason": _DENYING_REASON})
        try:
            new, reason = edited_policy(method, entry.policy, body)
        except PolicyError as exc:
            return Reply(400, text=f"invalid policy: {exc.without_input()}")
        if reason == NO_MATCH:
            # Nothing removed: nothing changes, not even a transaction.
            return Reply(
                200,
                json={
                    "status": "ok",
                    "mode": policy_mode(entry.policy),
                    "enforcementMode": "dns+nft",
                    "reason": reason,
                },
            )
        problem = rule_cap_problem(new, self.max_rules)
        if problem is not None:
            # 400 like every other fleet input refusal (docs/reference/behaviour.md §14.5); the sidecar says 413.
            return Reply(400, text=problem)
        store = self.credentials.stores.get(entry.uid)
        if store is not None:
            try:
                store.check_policy(self.control.policies.effective(new))
            except VaultError as exc:
                return Reply(400, text=f"policy change uncovers a credential binding: {exc}")
        result = await self.control.apply_user_policy_locked(entry, new)
        if result.status != 200:
            return Reply(result.status, text=result.reason)
        out = {"status": "ok", "mode": policy_mode(new), "auditMode": new.audit, "enforcementMode": "dns+nft"}
        if reason:
            out["reason"] = reason
        return Reply(200, json=out)

    # ---- lifecycle -------------------------------------------------------------------------

    async def registered(self, entry: Entry) -> None:
        """After a successful non-null SET_BINDING: replay cached pushes in arrival order."""
        pushes = self.credentials.pending_pushes.take_for_replay(
            entry.uid, entry.spec_generation, self.clock()
        )
        for push in pushes:
            req = classify(push.suffix, {"X-Fast-Sandbox-Uid": entry.uid})
            reply = await self._handle_locked(push.method, req, push.body, cache=False)
            log.info("pending.replayed", subject=entry.subject, method=push.method, code=reply.status)

    async def unbound(self, uid: str) -> None:
        return None

    async def reset(self, uid: str) -> None:
        return None

    async def removed(self, uid: str) -> None:
        return None


def _audit_mode(entry: Entry) -> bool:
    """Only an active subject's policy can audit; a denying subject is fully closed."""
    return entry.state is State.ACTIVE and entry.policy is not None and entry.policy.audit
