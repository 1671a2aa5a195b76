"""Builders for ``egressctl vault ...``: the proxy-route requests (docs/reference/actions-protocol.md §4) and the
sealed binding input (§11).

Pure functions, no I/O (the command handlers in :mod:`egressd.cli.commands.vault` read files and
talk to the daemon). As with the action envelopes, local validation is limited to what the CLI
must know to build a request; request bodies are sent verbatim and judged by the daemon.
No error raised here quotes a request body, a vault plaintext or key material.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from egressd.cli.client import CliError
from egressd.vault.keys import decode_key, valid_kid
from egressd.vault.sealed import SealError, build_wrapper, seal

__all__ = [
    "GENERATION_HEADER",
    "PATH_CHOICES",
    "UID_HEADER",
    "VAULT_METHODS",
    "VAULT_SUFFIX",
    "kid_from_key_file",
    "parse_json_file",
    "parse_key_file",
    "sealed_binding_input",
    "vault_headers",
    "vault_path",
]

VAULT_SUFFIX = "/credential-vault"
UID_HEADER = "X-Fast-Sandbox-Uid"
GENERATION_HEADER = "X-Fast-Sandbox-Generation"

#: egressctl sub-command -> HTTP method.
VAULT_METHODS = {"put": "PUT", "post": "POST", "patch": "PATCH", "get": "GET", "delete": "DELETE"}

PATH_CHOICES = "credentials, credentials/NAME, bindings, bindings/NAME"
_COLLECTIONS = ("credentials", "bindings")


def _quote(segment: str) -> str:
    # Every reserved character is escaped, '/' included: one path segment stays one segment.
    return quote(segment, safe="-._~")


def _sub_path(sub: str | None) -> str:
    """``--path`` -> the part after ``/credential-vault`` ('' for the vault itself)."""
    if sub is None:
        return ""
    # Leading and trailing slashes and a leading "credential-vault/" are tolerated.
    text = sub.strip().strip("/")
    if text == "credential-vault" or text.startswith("credential-vault/"):
        text = text.removeprefix("credential-vault").lstrip("/")
    if text == "":
        return ""
    collection, sep, name = text.partition("/")
    if collection not in _COLLECTIONS:
        raise CliError(f"--path {sub!r}: expected one of {PATH_CHOICES}")
    if not sep:
        return f"/{collection}"
    return f"/{collection}/{_quote(name)}"


def vault_path(uid: str, sub: str | None, *, suffix_only: bool) -> str:
    """``/v1/sandboxfleets/{uid}/egress/credential-vault[/...]``, or the suffix alone."""
    suffix = VAULT_SUFFIX + _sub_path(sub)
    if suffix_only:
        return suffix
    return f"/v1/sandboxfleets/{_quote(uid)}/egress{suffix}"


def _header_value(value: str, what: str) -> str:
    if any(ch in value for ch in "\r\n\0") or not value.isprintable():
        raise CliError(f"{what}: cannot be sent as an HTTP header value (control characters)")
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        raise CliError(f"{what}: cannot be sent as an HTTP header value (non-Latin-1 characters)") from None
    return value


def vault_headers(uid: str, generation: int | None, *, suffix_only: bool) -> dict[str, str]:
    """``X-Fast-Sandbox-Uid`` (suffix-only requests) and ``X-Fast-Sandbox-Generation``."""
    headers: dict[str, str] = {}
    if suffix_only:
        headers[UID_HEADER] = _header_value(uid, "--uid")
    if generation is not None:
        headers[GENERATION_HEADER] = str(generation)
    return headers


def parse_json_file(data: bytes, *, what: str) -> Any:
    """A local JSON file's value; the error names the file role and position, never content."""
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise CliError(f"{what}: not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise CliError(f"{what}: not valid JSON (line {exc.lineno}, column {exc.colno})") from None
    except (ValueError, RecursionError):
        raise CliError(f"{what}: not valid JSON") from None


def parse_key_file(data: bytes) -> bytes:
    """A key file (the formats of ``EGRESSD_VAULT_KEYS_DIR``) -> 32-byte key."""
    try:
        return decode_key(data)
    except ValueError as exc:
        raise CliError(f"--key-file: {exc}") from None


def kid_from_key_file(path: str) -> str | None:
    """``.../<kid>.key`` -> kid (None when the name does not follow the key-directory layout)."""
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    if not name.endswith(".key"):
        return None
    kid = name[: -len(".key")]
    return kid if valid_kid(kid) else None


def sealed_binding_input(
    *, uid: str, policy: Any, vault_plaintext: bytes | None, kid: str | None, key: bytes | None
) -> str:
    """The ``binding.input`` string: JSON text of ``{"osbEgressInput":1,"policy":…,"vault":…}``.

    ``vault_plaintext`` None omits ``vault`` (a wrapper that removes the vault, policy kept);
    ``kid`` and ``key`` are then unused.
    """
    vault: dict[str, Any] | None = None
    if vault_plaintext is not None:
        if kid is None or not valid_kid(kid):
            raise CliError(f"--kid {kid!r}: expected 1-64 characters of [A-Za-z0-9._-]")
        if key is None:
            raise CliError("--key-file is required to seal a vault")
        try:
            vault = seal(vault_plaintext, uid, kid, key)
        except SealError as exc:
            raise CliError(f"vault seal: {exc.reason}") from None
    return json.dumps(build_wrapper(policy, vault), separators=(",", ":"))
