"""The proxy-route surface (BEHAVIOUR §4): per-subject credential vault and /policy pushes.

:meth:`ProxyRouteAPI.handle` is transport-free (method, path, headers, body in; :class:`Reply`
out) so the same code serves HTTP and the replay of cached pushes. Bodies and vault values
are never logged; error replies are one line and never quote a credential value.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import structlog

from egressd.fleet.control import ControlPlane, SubjectListener
from egressd.fleet.pending import PendingFull
from egressd.fleet.route import Resource, RouteError, RouteRequest, classify
from egressd.policy import (
    NetworkPolicy,
    PolicyError,
    delete_targets,
    merge_patch,
    parse_policy,
    policy_mode,
    rule_cap_problem,
)
from egressd.subject.registry import Entry, State
from egressd.vault.model import DEFAULT_LIMITS, VaultError, VaultLimits
from egressd.vault.offload import off_loop
from egressd.vault.store import Response, VaultStore

log = structlog.get_logger("egressd.proxyroute")

_VAULT_METHODS = ("GET", "PUT", "POST", "PATCH", "DELETE")
_POLICY_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_PENDING_REASON = "subject not registered yet; push cached"
_DENYING_REASON = "subject denying; SET_BINDING input is authoritative"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    json: dict[str, Any] | None = None
    text: str | None = None
    allow: str | None = None
    #: ``json`` already encoded (UTF-8), when it was encoded off the loop (14.7): the state
    #: of a vault at the caps is a few hundred KiB of JSON.
    encoded: bytes | None = None


def _from_store(resp: Response) -> Reply:
    status, body = resp
    if status >= 400:
        message = str(body.get("error", "error")) if body else "error"
        return Reply(status, text=message)
    if body is None:
        return Reply(status)
    return Reply(status, json=body)


class ProxyRouteAPI(SubjectListener):
    def __init__(
        self, control: ControlPlane, *, max_rules: int = 4096, clock: Callable[[], float] = time.monotonic
    ):
        self.control = control
        self.max_rules = max_rules
        self.clock = clock
        control.listeners.append(self)

    # ---- entry point -----------------------------------------------------------------------

    async def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply:
        try:
            req = classify(path, headers)
        except RouteError as exc:
            return Reply(exc.status, text=exc.reason)
        allowed = self._allowed(req)
        if method not in allowed:
            return Reply(405, text="method not allowed", allow=", ".join(allowed))
        async with self.control.subject_lock(req.uid):
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
                self.control.pending_pushes.add(
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
            lambda: self.control.vaults.get(uid),
            lambda: self.control.coverage_policy(uid),
            self.control.vault_limits,
        )
        if store is None:
            self.control.vaults.pop(uid, None)
        else:
            self.control.vaults[uid] = store
        if method != "GET":
            self.control.vault_view_changed(uid)  # the MITM child drops its snapshot (14.9)
        if method in ("PUT", "POST", "PATCH"):
            revision = store.revision if store is not None else None
            log.info("vault.write", subject=f"s-{uid}", method=method, code=reply.status, revision=revision)
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
            new, reason = _edited(method, entry.policy, body)
        except PolicyError as exc:
            return Reply(400, text=f"invalid policy: {exc.without_input()}")
        if reason == _NO_MATCH:
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
            # 400 like every other fleet input refusal (BEHAVIOUR 14.5); the sidecar says 413.
            return Reply(400, text=problem)
        store = self.control.vaults.get(entry.uid)
        if store is not None:
            try:
                store.check_policy(self.control.effective(new))
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
        pushes = self.control.pending_pushes.take_for_replay(entry.uid, entry.spec_generation, self.clock())
        for push in pushes:
            req = classify(push.suffix, {"X-Fast-Sandbox-Uid": entry.uid})
            reply = await self._handle_locked(push.method, req, push.body, cache=False)
            log.info("pending.replayed", subject=f"s-{entry.uid}", method=push.method, code=reply.status)

    async def unbound(self, uid: str) -> None:
        return None

    async def reset(self, uid: str) -> None:
        return None

    async def removed(self, uid: str) -> None:
        return None


_WRITES = ("PUT", "POST", "PATCH")
_RACED = "credential vault changed while this request was validated; retry"


async def vault_write(
    method: str,
    resource: Resource,
    name: str | None,
    body: bytes,
    current: Callable[[], VaultStore | None],
    coverage: Callable[[], NetworkPolicy | None],
    limits: VaultLimits = DEFAULT_LIMITS,
) -> tuple[Reply, VaultStore | None]:
    """:func:`vault_request` with the parse and validation of a write in the vault worker
    thread (14.7); reads and DELETE are cheap and stay on the loop.

    The caller holds the lock that serialises this vault's changes. ``coverage`` is read on
    the loop first (registry state is the loop's), the thread works on a private fork, and
    the result is committed here, on the loop. As a second line of defence the vault must
    still be the one the thread started from: if anything replaced it meanwhile, nothing is
    committed and the answer is 409 (fail closed rather than overwrite a newer vault).
    """
    store = current()
    if method not in _WRITES:
        return vault_request(method, resource, name, body, store, coverage, limits)
    policy = coverage()
    base = store.vault if store is not None else None
    work = store.fork() if store is not None else None
    reply, result = await off_loop(_write_encoded, method, resource, name, body, work, policy, limits)
    now = current()
    if now is not store or (now is not None and now.vault is not base):
        return Reply(409, text=_RACED), now
    if store is not None and result is work:
        assert work is not None
        store.adopt(work)
        return reply, store
    return reply, result


def _write_encoded(
    method: str,
    resource: Resource,
    name: str | None,
    body: bytes,
    store: VaultStore | None,
    policy: NetworkPolicy | None,
    limits: VaultLimits,
) -> tuple[Reply, VaultStore | None]:
    """The worker's part of :func:`vault_write`: the request, and the JSON of its answer."""
    reply, result = vault_request(method, resource, name, body, store, lambda: policy, limits)
    if reply.json is not None:
        reply = replace(reply, encoded=json.dumps(reply.json).encode())
    return reply, result


def vault_request(
    method: str,
    resource: Resource,
    name: str | None,
    body: bytes,
    store: VaultStore | None,
    coverage: Callable[[], NetworkPolicy | None],
    limits: VaultLimits = DEFAULT_LIMITS,
) -> tuple[Reply, VaultStore | None]:
    """One §6 vault request against ``store`` (None: no vault); shared by fleet and sidecar.

    Returns the reply and the store to hold afterwards (None: no vault). ``coverage`` gives
    the policy bindings must be covered by; it is only asked for writes. A new store gets
    ``limits``; an existing one keeps its own.
    """
    if method == "GET":
        if store is None:
            return Reply(404, text="no credential vault"), None
        if resource is Resource.VAULT:
            return _from_store(store.get()), store
        if resource is Resource.CREDENTIALS:
            return _from_store(store.credentials()), store
        if resource is Resource.BINDINGS:
            return _from_store(store.bindings()), store
        assert name is not None
        if resource is Resource.CREDENTIAL:
            return _from_store(store.credential(name)), store
        return _from_store(store.binding(name)), store
    if method == "DELETE":
        if store is None:
            return Reply(404, text="no credential vault"), None
        reply = _from_store(store.delete())
        return reply, (None if reply.status < 300 else store)
    try:
        obj = json.loads(body) if body.strip() else None
    except (ValueError, RecursionError):
        return Reply(400, text="body is not valid JSON"), store
    policy = coverage()
    fresh = store is None
    target = store if store is not None else VaultStore(limits=limits)
    if method == "PUT":
        reply = _from_store(target.put(obj, policy))
    elif method == "POST":
        reply = _from_store(target.post(obj, policy))
    else:
        reply = _from_store(target.patch(obj, policy))
    if fresh and reply.status >= 300:
        return reply, None
    return reply, target


_NO_MATCH = "no matching targets found"
_RESET = "policy reset to default deny-all"


def _edited(method: str, current: NetworkPolicy, body: bytes) -> tuple[NetworkPolicy, str]:
    """The edited policy and the reason the /policy API reports with it (§5)."""
    try:
        text = body.decode("utf-8") if body else ""
    except UnicodeDecodeError:
        raise PolicyError("body is not valid UTF-8") from None
    if method in ("POST", "PUT"):
        return parse_policy(text), (_RESET if not text.strip() else "")
    try:
        obj = json.loads(text) if text.strip() else None
    except (ValueError, RecursionError):
        raise PolicyError("body is not valid JSON") from None
    if method == "PATCH":
        return merge_patch(current, obj), ""
    new, removed = delete_targets(current, obj)
    return new, ("" if removed else _NO_MATCH)


def _audit_mode(entry: Entry) -> bool:
    """Only an active subject's policy can audit; a denying subject is fully closed."""
    return entry.state is State.ACTIVE and entry.policy is not None and entry.policy.audit
