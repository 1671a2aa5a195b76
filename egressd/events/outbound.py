"""The reference's ``egress.outbound`` event for allowed DNS answers (docs/reference/behaviour.md §12, §15).

``opensandbox.event=egress.outbound`` with ``target.host`` (the asked name, lower case, no
trailing dot), ``target.ips`` (the A/AAAA addresses the answer carried to the sandbox) and,
when the upstreams failed, ``error``; plus ``subject``. The reference logs every answer; here
each subject gets at most :data:`LINES_PER_SUBJECT_PER_S` lines a second, the budget the DNS
proxy gives denial lines per client, so one chatty sandbox cannot flood the log.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

import structlog

from egressd.addr import IPAddress
from egressd.events.webhook import normalise_hostname

log = structlog.get_logger("egressd.dns")

LINES_PER_SUBJECT_PER_S = 20
EVENT = "egress.outbound"


class LineBudget:
    """At most ``per_second`` lines per key and second; one warning when a key hits it."""

    def __init__(
        self,
        per_second: int,
        what: str,
        *,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._per_second = per_second
        self._what = what
        self._max_keys = max_keys
        self._clock = clock
        self._windows: dict[Hashable, tuple[int, int]] = {}  # key -> (second, lines)

    def allow(self, key: Hashable) -> bool:
        second = int(self._clock())
        window, count = self._windows.get(key, (second, 0))
        if window != second:
            window, count = second, 0
        if len(self._windows) > self._max_keys:
            self._windows.clear()
        self._windows[key] = (window, count + 1)
        if count == self._per_second:
            log.warning(
                f"{self._what} log rate limit reached; further lines this second are dropped", key=str(key)
            )
        return count < self._per_second


class OutboundLog:
    def __init__(
        self, per_second: int = LINES_PER_SUBJECT_PER_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._budget = LineBudget(per_second, EVENT, clock=clock)

    def due(self, subject: str) -> bool:
        """Whether the next answer of ``subject`` gets a line (charges the budget)."""
        return self._budget.allow(subject)

    def emit(self, subject: str, name: str, ips: Sequence[IPAddress], error: str | None = None) -> None:
        fields: dict[str, object] = {
            "opensandbox.event": EVENT,
            "target.host": normalise_hostname(name),
            "target.ips": [str(ip) for ip in ips],
        }
        if error:
            fields["error"] = error
        log.info(EVENT, subject=subject, **fields)
