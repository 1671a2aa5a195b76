"""The credential-vault and /policy request handling both profiles share (docs/reference/behaviour.md §5, §6).

Transport-free: method, resource, body in; a :class:`Reply` and the store to hold out.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from egressd.policy import NetworkPolicy, PolicyError, delete_targets, merge_patch, parse_policy
from egressd.vault.offload import off_loop
from egressd.vault.store import Response, VaultStore
from egressd.vault.types import DEFAULT_LIMITS, VaultLimits
from egressd.web.route import Resource


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
        return _vault_read(resource, name, store), store
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


def _vault_read(resource: Resource, name: str | None, store: VaultStore | None) -> Reply:
    if store is None:
        return Reply(404, text="no credential vault")
    if resource is Resource.VAULT:
        return _from_store(store.get())
    if resource is Resource.CREDENTIALS:
        return _from_store(store.credentials())
    if resource is Resource.BINDINGS:
        return _from_store(store.bindings())
    assert name is not None
    if resource is Resource.CREDENTIAL:
        return _from_store(store.credential(name))
    return _from_store(store.binding(name))


NO_MATCH = "no matching targets found"
RESET = "policy reset to default deny-all"


def edited_policy(method: str, current: NetworkPolicy, body: bytes) -> tuple[NetworkPolicy, str]:
    """The edited policy and the reason the /policy API reports with it (§5)."""
    try:
        text = body.decode("utf-8") if body else ""
    except UnicodeDecodeError:
        raise PolicyError("body is not valid UTF-8") from None
    if method in ("POST", "PUT"):
        return parse_policy(text), (RESET if not text.strip() else "")
    try:
        obj = json.loads(text) if text.strip() else None
    except (ValueError, RecursionError):
        raise PolicyError("body is not valid JSON") from None
    if method == "PATCH":
        return merge_patch(current, obj), ""
    new, removed = delete_targets(current, obj)
    return new, ("" if removed else NO_MATCH)
