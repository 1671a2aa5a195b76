"""Connection refresh (docs/reference/behaviour.md §9): DNS leases of still-established TCP flows are renewed.

The planner is pure; :class:`LeaseRefresher` reads ``/proc/net/nf_conntrack`` and applies.
Host-uid subjects (docs/reference/behaviour.md §17) share the host's source address, so their flows are found in
the socket tables instead (``/proc/net/tcp{,6}``, by uid): their packets are all judged on
output, and a lease that expires under a live connection would stop it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog

from egressd.addr import IPAddress
from egressd.kernel.conntrack import original_tuple
from egressd.kernel.sockets import PROC_TCP, read_uid_flows
from egressd.subject.leases import LeaseBook
from egressd.subject.model import subject_for_uid

log = structlog.get_logger("egressd.refresh")

ACTIVE_TCP_STATES = frozenset(
    {"ESTABLISHED", "SYN_SENT", "SYN_RECV", "FIN_WAIT", "CLOSE_WAIT", "CLOSING", "LAST_ACK"}
)
RENEW_S = 360
INTERVAL_S = 30.0


def parse_conntrack(lines: Iterable[str]) -> dict[IPAddress, set[IPAddress]]:
    """Active TCP flows by original source: src -> {original destinations}."""
    out: dict[IPAddress, set[IPAddress]] = {}
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[2] != "tcp":
            continue
        if not any(p in ACTIVE_TCP_STATES for p in parts[3:7]):
            continue
        flow = original_tuple(line)
        if flow is None:
            continue
        s, d = flow
        out.setdefault(s, set()).add(d)
    return out


@dataclass(frozen=True, slots=True)
class RefreshPlan:
    renew: tuple[IPAddress, ...]


def plan_refresh(
    mirror: dict[IPAddress, float], active_now: set[IPAddress], active_last: set[IPAddress]
) -> RefreshPlan:
    """Renew tracked addresses active now, and once more those active last tick only (a flow
    that closed between two ticks keeps its lease one extra round). Expired leases need no
    plan: the lease book forgets them itself (:meth:`LeaseBook.expire`)."""
    active = active_now | active_last
    renew = tuple(sorted((ip for ip in mirror if ip in active), key=str))
    return RefreshPlan(renew)


class LeaseRefresher:
    """Every ``interval`` seconds: one renewal transaction per subject with live flows."""

    def __init__(
        self,
        subjects_by_ip: Callable[[IPAddress], str | None],
        leases: dict[str, LeaseBook],
        renew: Callable[[str, list[IPAddress], int], Awaitable[None]],
        *,
        interval: float = INTERVAL_S,
        renew_s: int = RENEW_S,
        path: Path = Path("/proc/net/nf_conntrack"),
        host_uids: Callable[[], dict[int, str]] | None = None,
        socket_tables: tuple[Path, ...] = PROC_TCP,
    ) -> None:
        self.subjects_by_ip = subjects_by_ip
        self.host_uids = host_uids  # host uid -> sandbox uid of the host-uid subjects
        self.socket_tables = socket_tables
        self.leases = leases
        self.renew = renew
        self.interval = interval
        self.renew_s = renew_s
        self.path = path
        self._last: dict[str, set[IPAddress]] = {}

    async def tick(self) -> None:
        try:
            # Read and parse off the event loop: a big conntrack table takes tens of ms.
            flows = await asyncio.to_thread(lambda: parse_conntrack(self.path.read_text().splitlines()))
        except OSError as exc:
            log.warning("refresh.read_failed", error=str(exc)[:200])
            self._last.clear()
            return
        now_by_uid: dict[str, set[IPAddress]] = {}
        for src, dsts in flows.items():
            uid = self.subjects_by_ip(src)
            if uid is not None:
                now_by_uid.setdefault(uid, set()).update(dsts)
        await self._host_flows(now_by_uid)
        now = time.monotonic()
        for uid in list(self.leases):
            book = self.leases.get(uid)
            if book is None:
                continue
            book.expire(now)  # per-lease bookkeeping ends with the lease (14.4)
            plan = plan_refresh(book.live(now), now_by_uid.get(uid, set()), self._last.get(uid, set()))
            # The renewal re-decides every address by the names that taught it (14.1).
            if plan.renew:
                try:
                    await self.renew(uid, list(plan.renew), self.renew_s)
                except Exception as exc:
                    log.warning("refresh.renew_failed", subject=subject_for_uid(uid), error=str(exc)[:200])
        self._last = now_by_uid

    async def _host_flows(self, now_by_uid: dict[str, set[IPAddress]]) -> None:
        """Add the live connections of the host-uid subjects, by the uid that owns the socket."""
        subjects = self.host_uids() if self.host_uids is not None else {}
        if not subjects:
            return
        try:
            by_host_uid = await read_uid_flows(subjects.keys(), self.socket_tables)
        except OSError as exc:
            log.warning("refresh.read_failed", error=str(exc)[:200], table="sockets")
            return
        for host_uid, remotes in by_host_uid.items():
            now_by_uid.setdefault(subjects[host_uid], set()).update(remotes)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.tick()
            except Exception:
                log.exception("refresh.tick_crashed")
