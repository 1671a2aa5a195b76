"""Classifying proxy-route requests (docs/reference/actions-protocol.md §4): which sandbox, which resource, which generation.

Pure: method, path and headers in; a :class:`RouteRequest` or a :class:`RouteError` with the
HTTP status out.
"""

from __future__ import annotations

import enum
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from egressd.subject.model import uid_problem

UID_HEADER = "X-Fast-Sandbox-Uid"
GENERATION_HEADER = "X-Fast-Sandbox-Generation"

_PREFIX = re.compile(r"^/v1/sandboxfleets/(?P<id>[^/]*)/egress(?P<suffix>/.*)$")
_NAME = r"(?P<name>[^/]+)"


class Resource(enum.StrEnum):
    VAULT = "vault"
    CREDENTIALS = "credentials"
    CREDENTIAL = "credential"
    BINDINGS = "bindings"
    BINDING = "binding"
    POLICY = "policy"


_SUFFIXES: list[tuple[re.Pattern[str], Resource]] = [
    (re.compile(r"^/credential-vault/?$"), Resource.VAULT),
    (re.compile(r"^/credential-vault/credentials/?$"), Resource.CREDENTIALS),
    (re.compile(rf"^/credential-vault/credentials/{_NAME}/?$"), Resource.CREDENTIAL),
    (re.compile(r"^/credential-vault/bindings/?$"), Resource.BINDINGS),
    (re.compile(rf"^/credential-vault/bindings/{_NAME}/?$"), Resource.BINDING),
    (re.compile(r"^/policy/?$"), Resource.POLICY),
]


class RouteError(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class RouteRequest:
    uid: str
    suffix: str
    resource: Resource
    name: str | None
    generation: int | None


def is_route_path(path: str) -> bool:
    return bool(_PREFIX.match(path)) or path.startswith(("/credential-vault", "/policy"))


def classify(path: str, headers: Mapping[str, str]) -> RouteRequest:
    m = _PREFIX.match(path)
    # ``path`` is the raw (still percent-encoded) path, so an encoded '/' stays inside a segment.
    path_id = urllib.parse.unquote(m.group("id")).strip() if m else None
    suffix = m.group("suffix") if m else path
    header_id = headers.get(UID_HEADER)
    header_id = header_id.strip() if header_id is not None else None
    if path_id is not None and header_id is not None and path_id != header_id:
        raise RouteError(403, "sandbox id in the path and X-Fast-Sandbox-Uid disagree")
    uid = path_id if path_id is not None else header_id
    if uid is None:
        raise RouteError(
            400, "no sandbox named: use /v1/sandboxfleets/{sandboxId}/egress/... or X-Fast-Sandbox-Uid"
        )
    problem = uid_problem(uid)
    if problem is not None:
        raise RouteError(400, f"invalid sandbox id: {problem}")
    if suffix.rstrip("/") == "/credential-vault/_active":
        raise RouteError(404, "not found")
    for pattern, resource in _SUFFIXES:
        sm = pattern.match(suffix)
        if sm is not None:
            raw_name = sm.groupdict().get("name")
            name = urllib.parse.unquote(raw_name) if raw_name is not None else None
            return RouteRequest(uid, suffix, resource, name, _generation(headers))
    raise RouteError(404, "not found")


def _generation(headers: Mapping[str, str]) -> int | None:
    raw = headers.get(GENERATION_HEADER)
    if raw is None:
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or int(text) >= 2**64:
        raise RouteError(400, f"{GENERATION_HEADER} must be an unsigned decimal integer")
    return int(text)
