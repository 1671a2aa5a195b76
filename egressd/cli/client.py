"""A minimal, synchronous HTTP client for the egressd API (stdlib ``http.client`` only).

``http.client`` is used instead of ``urllib.request`` on purpose: urllib honours the
``http_proxy``/``HTTP_PROXY`` environment, which must never redirect an operator talking
to a loopback daemon, and it turns every non-2xx answer into an exception.

Every failure to talk to the daemon (refused, timeout, unresolvable name, broken HTTP) is
raised as :class:`CliError` with exit code 3 (:data:`EXIT_UNREACHABLE`) and a one-line
reason; a malformed ``--addr`` is a usage error (exit 2). Any HTTP answer, whatever its
status, is returned as a :class:`Response`.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from egressd.terminal import visible

__all__ = [
    "DEFAULT_ADDR",
    "EXIT_FAILURE",
    "EXIT_LOCAL",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "CliError",
    "DaemonClient",
    "Response",
    "parse_addr",
]

DEFAULT_ADDR = "127.0.0.1:18080"
DEFAULT_PORT = 18080

EXIT_OK = 0
#: The daemon answered, but not with success (non-200 action, not ready, unexpected reply).
EXIT_FAILURE = 1
#: Usage errors and bad local input (arguments, unreadable files): nothing was sent.
EXIT_USAGE = 2
EXIT_LOCAL = EXIT_USAGE  # historical name, kept for callers
#: The daemon could not be talked to (refused, timeout, name resolution, broken HTTP).
EXIT_UNREACHABLE = 3

_USER_AGENT = "egressctl/1"
_MAX_REASON = 500


class CliError(Exception):
    """A failure reported as a single ``egressctl: <reason>`` line on stderr."""

    def __init__(self, reason: str, code: int = EXIT_LOCAL) -> None:
        super().__init__(reason)
        self.reason = one_line(reason)
        self.code = code


def one_line(text: str, limit: int = _MAX_REASON) -> str:
    """Collapse whitespace (newlines included), make control characters visible
    (docs/reference/behaviour.md §20.3: daemon answers quote names a tenant chose) and bound the length."""
    flat = visible(" ".join(text.split()))
    if len(flat) > limit:
        return flat[: limit - 3] + "..."
    return flat


def parse_addr(value: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port``, bare ``host`` (port 18080); an ``http://`` prefix is tolerated."""
    text = value.strip()
    lowered = text.lower()
    if lowered.startswith("https://"):
        raise CliError(f"--addr {value!r}: https is not supported (the daemon API is plain HTTP on loopback)")
    if lowered.startswith("http://"):
        text = text[len("http://") :]
    text = text.rstrip("/")
    if not text:
        raise CliError(f"--addr {value!r}: expected host:port")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not host or (rest and not rest.startswith(":")):
            raise CliError(f"--addr {value!r}: expected [v6-address]:port")
        port_text = rest[1:] if rest else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    elif ":" in text:
        # A bare IPv6 address without brackets: no port can be given.
        host, port_text = text, ""
    else:
        host, port_text = text, ""
    if not host:
        raise CliError(f"--addr {value!r}: host is empty")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isascii() or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise CliError(f"--addr {value!r}: port must be an integer in 1..65535")
    return host, int(port_text)


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    reason: str
    content_type: str
    body: bytes
    #: Response headers, names lower-cased (the last value wins for repeated names).
    headers: Mapping[str, str] = field(default_factory=dict)

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def success(self) -> bool:
        """Any 2xx (vault answers use 201, 202 and 204 as well as 200)."""
        return 200 <= self.status < 300

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def is_json(self) -> bool:
        return self.content_type.split(";", 1)[0].strip().lower() == "application/json"

    def json(self) -> Any:
        """The decoded JSON body; :class:`CliError` (exit 1) when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            raise CliError(
                f"daemon answered {self.status} with a body that is not JSON: {self.text()!r}",
                EXIT_FAILURE,
            ) from None

    def payload(self) -> Any:
        """Parsed JSON when the daemon says it is JSON (and it parses), else the text (stripped)."""
        if self.is_json():
            try:
                return json.loads(self.body)
            except ValueError:
                pass
        return self.text().strip()

    def summary(self) -> str:
        """One line: ``200 OK`` on success, else ``<code> <daemon's reason or HTTP reason>``."""
        if self.ok:
            return "200 OK"
        detail = ""
        if self.body.strip():
            payload = self.payload()
            detail = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
        return one_line(f"{self.status} {detail or self.reason or 'error'}")


class DaemonClient:
    """One short-lived connection per request (the daemon is local; no pooling needed)."""

    def __init__(self, addr: str, timeout: float) -> None:
        self.addr = addr
        self.host, self.port = parse_addr(addr)
        self.timeout = timeout

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        headers: dict[str, str] | None = None,
    ) -> Response:
        hdrs = {"User-Agent": _USER_AGENT, "Accept": "application/json, text/plain", "Connection": "close"}
        if body is not None:
            hdrs["Content-Type"] = "application/json"
        if headers:
            hdrs.update(headers)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            data = resp.read()
            return Response(
                status=resp.status,
                reason=resp.reason or "",
                content_type=resp.getheader("Content-Type") or "",
                body=data,
                headers={k.lower(): v for k, v in resp.getheaders()},
            )
        except TimeoutError:
            raise CliError(
                f"{method} {path} to egressd at {self.addr}: timed out after {self.timeout:g}s",
                EXIT_UNREACHABLE,
            ) from None
        except socket.gaierror as exc:
            raise CliError(
                f"cannot resolve egressd address {self.addr}: {exc.strerror or exc}", EXIT_UNREACHABLE
            ) from None
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise CliError(f"cannot reach egressd at {self.addr}: {reason}", EXIT_UNREACHABLE) from None
        except http.client.HTTPException as exc:
            reason = str(exc) or type(exc).__name__
            raise CliError(
                f"{method} {path} to egressd at {self.addr}: bad HTTP response: {reason}",
                EXIT_UNREACHABLE,
            ) from None
        finally:
            conn.close()

    def get(self, path: str) -> Response:
        return self.request("GET", path)

    def post_json(self, path: str, body: bytes) -> Response:
        return self.request("POST", path, body)
