"""The daemon's side of the MITM's name check (docs/reference/behaviour.md §18):
``GET /_names`` on the private ``_active`` socket.

The child asks, for every redirected TCP connection to port 80 or 443 (TLS: once, with the
ClientHello's SNI; plain HTTP: for every request, with its ``Host``), whether the name may
reach the connection's original destination. The profile answers with the subject's state
(:data:`Check`: the subject behind the client, its effective policy, its leases;
:meth:`egressd.engine.subjects.SubjectEngine.check_name`), and this module reports every
refusal once, here: the subject's refusal count (exported with the kernel's in
``egressd_subject_dropped_packets_total``), a ``mitm.name_refused`` log line naming the subject,
the name, the address, the port and the reason, and the deny webhook (with the recent-denials
ring) like a denied DNS name.

Query: ``clientIp``, ``port`` (a host-uid subject's MITM listener port, docs/reference/behaviour.md §17),
``wire`` (``tls``/``http``; ``tcp``: neither, no name), ``name`` (absent: no SNI / no Host),
``dst``, ``dport`` and ``report`` (``0``: a question only, a refusal is not reported).
``refused`` (``no_sni`` or ``host_not_allowed``): not a question but a report: the child already
refused the connection from its first bytes alone (TLS it cannot read, a request line only a
lenient server reads), and egressd counts, logs and posts it like any refusal.
Reply 200 ``{"admit": bool, "reason": str|null}``; 400 for a malformed query. Anything but a
200 with that body makes the child refuse (fail closed).
"""

from __future__ import annotations

import ipaddress
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import structlog
from aiohttp import web

from egressd.addr import IPAddress, unmap_ip
from egressd.mitm.protocol import NAMES_PATH
from egressd.policy.audit import new_decision_id, safe_token
from egressd.policy.namecheck import NameReason, NameVerdict, Wire
from egressd.subject.model import subject_for_uid

log = structlog.get_logger("egressd.mitm")

#: Denial lines per subject and second; the rest are counted and summed into the next line.
LOG_PER_SECOND: Final = 20


@dataclass(frozen=True, slots=True)
class NameQuery:
    client: IPAddress
    listen_port: int | None  # a host-uid subject's MITM port: it names the subject
    wire: Wire
    name: str | None
    dst: IPAddress
    port: int
    #: The name asked for is no DNS name (over 253 characters, not ASCII): refused and reported
    #: like any refusal (``name`` holds its first 253 characters, for the report).
    unreadable: bool = False


#: The profile's answer: (the subject's uid, the verdict); a None verdict: no active subject
#: behind the client (refused).
Check = Callable[[NameQuery], tuple[str | None, NameVerdict | None]]


class NameRefusals:
    """Per-subject counts of the name check's refusals, added to the kernel's refusal counts
    in ``egressd_subject_dropped_packets_total`` (one connection or request = one)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, uid: str) -> None:
        self._counts[uid] = self._counts.get(uid, 0) + 1

    def of(self, uid: str) -> int:
        return self._counts.get(uid, 0)

    def by_uid(self) -> dict[str, int]:
        return dict(self._counts)

    def forget(self, uid: str) -> None:
        self._counts.pop(uid, None)


#: Where a refusal goes besides the count and the log: (uid, name or address, rule label, port).
Denied = Callable[[str, str, str, int], None]


class NameReport:
    """Counts, logs and posts the name check's refusals (and logs its audit would-denies)."""

    def __init__(
        self,
        refusals: NameRefusals,
        denied: Denied | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.refusals = refusals
        self._denied = denied
        self._clock = clock
        self._window: dict[str, tuple[int, int, int]] = {}  # uid -> (second, logged, suppressed)

    def __call__(self, query: NameQuery, uid: str | None, verdict: NameVerdict) -> None:
        if verdict.admit and not verdict.would_deny:
            return
        subject = safe_token(subject_for_uid(uid)) if uid is not None else "-"
        if not verdict.admit and uid is not None:
            self.refusals.add(uid)
            if self._denied is not None:
                self._denied(uid, query.name or str(query.dst), verdict.rule, query.port)
        suppressed = self.may_log(uid or "-")
        if suppressed is None:
            return
        reason = verdict.reason.value if verdict.reason is not None else None
        log.info(
            "mitm.name_would_refuse" if verdict.admit else "mitm.name_refused",
            subject=subject,
            name=query.name,
            dst=str(query.dst),
            port=query.port,
            wire=query.wire.value,
            reason=reason,
            rule=verdict.rule,
            audit=verdict.would_deny,
            decision_id=new_decision_id(),
            suppressed=suppressed or None,
        )

    def may_log(self, key: str) -> int | None:
        """None: over this second's budget (counted); else how many were suppressed before."""
        second = int(self._clock())
        window, logged, suppressed = self._window.get(key, (second, 0, 0))
        if window != second:
            logged = 0
        if logged >= LOG_PER_SECOND:
            self._window[key] = (second, logged, suppressed + 1)
            return None
        self._window[key] = (second, logged + 1, 0)
        if len(self._window) > 65536:
            self._window.clear()
        return suppressed

    def forget(self, uid: str) -> None:
        self.refusals.forget(uid)
        self._window.pop(uid, None)


def _ip(text: str | None) -> IPAddress | None:
    if not text:
        return None
    try:
        return unmap_ip(ipaddress.ip_address(text.strip()))
    except ValueError:
        return None


def _port(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 5:
        return None
    port = int(text)
    return port if 1 <= port <= 65535 else None


#: What a DNS name looks like on the wire (at most 253 characters, labels of 1-63 letters,
#: digits, ``-`` and ``_``, one trailing dot at most); anything else asked for is refused.
_READABLE: Final = re.compile(
    r"(?=.{1,254}$)(?!.{254}$(?<!\.))([A-Za-z0-9_-]{1,63}\.)*[A-Za-z0-9_-]{1,63}\.?"
)


def parse_query(query: Any) -> NameQuery | None:
    """The query of a ``_names`` request (a mapping of strings), or None when malformed."""
    client, dst = _ip(query.get("clientIp")), _ip(query.get("dst"))
    dport = _port(query.get("dport"))
    try:
        wire = Wire(query.get("wire", ""))
    except ValueError:
        return None
    listen_text = query.get("port")
    listen = _port(listen_text) if listen_text is not None else None
    if client is None or dst is None or dport is None or (listen_text is not None and listen is None):
        return None
    name = query.get("name") or None
    if name is not None and wire is Wire.TCP:
        return None  # "no name on the wire" with a name: malformed
    if name is not None and not _READABLE.fullmatch(name):
        # A CDN routes on the Host string whatever its length: never "no name", never an error
        # the subject's count and log would not see; a refusal of its own.
        safe = name.encode("ascii", "replace").decode()[:253]
        return NameQuery(client, listen, wire, safe, dst, dport, unreadable=True)
    return NameQuery(client, listen, wire, name, dst, dport)


#: What the child may report as refused from a connection's first bytes alone.
FIRST_BYTES_REASONS: Final = frozenset({NameReason.NO_SNI, NameReason.HOST_NOT_ALLOWED})

#: The rule label of such a refusal (no rule decided it: the bytes could not be read).
FIRST_BYTES_RULE: Final = "first-bytes"


def parse_refused(text: str | None) -> NameReason | None:
    """The ``refused`` parameter: a reason the child may report; ValueError for any other."""
    if text is None:
        return None
    try:
        reason = NameReason(text)
    except ValueError:
        raise ValueError("unknown reason") from None
    if reason not in FIRST_BYTES_REASONS:
        raise ValueError("not a first-bytes reason")
    return reason


def record_refused(
    check: Check, report: NameReport | None, query: NameQuery, reason: NameReason
) -> NameVerdict:
    """A refusal the child made from the first bytes: attributed to the subject behind the
    client (the check is asked only for that; its verdict does not matter, the connection is
    gone) and reported like any refusal (the subject's count, the log, the deny webhook)."""
    try:
        uid, _ = check(query)
    except Exception as exc:  # the report is lost, the connection was refused anyway
        log.warning("mitm.name_check_failed", error=type(exc).__name__)
        uid = None
    verdict = NameVerdict(False, reason, FIRST_BYTES_RULE)
    if report is not None:
        report(query, uid, verdict)
    return verdict


def answer(check: Check, report: NameReport | None, query: NameQuery) -> NameVerdict:
    """The verdict for ``query``; an unknown subject (or any error in the check) refuses."""
    verdict: NameVerdict | None
    try:
        uid, verdict = check(query)
    except Exception as exc:  # fail closed, and say so
        log.warning("mitm.name_check_failed", error=type(exc).__name__)
        uid, verdict = None, None
    if verdict is None:
        verdict = _unknown(query)
    elif query.unreadable:
        verdict = NameVerdict(False, _unknown(query).reason, "unreadable-name")
    if report is not None:
        report(query, uid, verdict)
    return verdict


def _unknown(query: NameQuery) -> NameVerdict:
    reason = NameReason.SNI_NOT_ALLOWED if query.wire is Wire.TLS else NameReason.HOST_NOT_ALLOWED
    if query.name is None and query.wire is not Wire.HTTP:
        reason = NameReason.NO_SNI
    return NameVerdict(False, reason, "no-subject")


#: The longest a worker may remember an admission (egressd's narrowing map voids it sooner).
MAX_REMEMBER_S: Final = 300.0


def remember_for(verdict: NameVerdict, now: float) -> float | None:
    """Seconds the MITM may remember an admission, absent a narrowing (docs/reference/behaviour.md §10,
    "answered from memory"): a clean admission only, until its lease ends (capped); None: ask again."""
    if not verdict.admit or verdict.would_deny or verdict.until <= now:
        return None
    return min(verdict.until - now, MAX_REMEMBER_S)


@dataclass(frozen=True, slots=True)
class NameService:
    """What the private socket needs to answer the name check: the profile's :data:`Check`
    and the report of its refusals."""

    check: Check
    report: NameReport | None = None
    # Request rules (docs/reference/behaviour.md §19, :mod:`egressd.mitm.requests`): served
    # whether or not the name check is on.
    policy_of: Any = None  # egressd.mitm.requests.PolicyOf
    request_report: Any = None  # egressd.mitm.requests.RequestRefusals


def add_names_route(app: web.Application, check: Check, report: NameReport | None) -> None:
    async def handle(request: web.Request) -> web.Response:
        if request.method != "GET":
            return web.Response(status=405, headers={"Allow": "GET"})
        query = parse_query(request.query)
        if query is None:
            return web.Response(status=400, headers={"Cache-Control": "no-store"})
        try:
            refused = parse_refused(request.query.get("refused"))
        except ValueError:
            return web.Response(status=400, headers={"Cache-Control": "no-store"})
        if refused is not None:
            verdict = record_refused(check, report, query, refused)
        else:
            # report=0: the MITM asks without deciding yet (a silent client, §18): no refusal report.
            verdict = answer(check, None if request.query.get("report") == "0" else report, query)
        body: dict[str, Any] = {
            "admit": verdict.admit,
            "reason": verdict.reason.value if verdict.reason else None,
        }
        ttl = remember_for(verdict, time.monotonic())
        if ttl is not None:
            body["ttl"] = round(ttl, 3)
        return web.Response(
            status=200,
            body=json.dumps(body).encode(),
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    app.router.add_route("*", NAMES_PATH, handle)
