"""The kernel counter read both profiles' visibility parts make (docs/reference/behaviour.md §15).

Refusal counts (the fleet's per-subject ``subj_<id>_dropped``, the sidecar's one ``dropped``)
and the fleet's audit evidence are samples of kernel counters, read before each scrape. A read
that fails is logged and leaves the caller's last samples in place: counters only ever grow, so
the last samples are the best answer there is, and a scrape never fails on the kernel.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("egressd.engine.counters")


async def read_or_keep[T](read: Callable[[], Awaitable[T]], event: str) -> T | None:
    """``await read()``; None when it raises, logged as the warning ``event`` (the caller keeps
    its last samples)."""
    try:
        return await read()
    except Exception as exc:
        log.warning(event, error=str(exc)[:200])
        return None
