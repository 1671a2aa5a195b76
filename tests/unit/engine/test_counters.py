"""The counter read both profiles' visibility parts share (egressd.engine.counters)."""

from __future__ import annotations

from structlog.testing import capture_logs

from egressd.engine.counters import read_or_keep


async def test_a_read_is_returned() -> None:
    async def read() -> dict[str, int]:
        return {"dropped": 3}

    assert await read_or_keep(read, "drops.counters_unreadable") == {"dropped": 3}


async def test_a_failed_read_is_none_and_logged_once_as_the_named_warning() -> None:
    async def read() -> dict[str, int]:
        raise RuntimeError("x" * 300)

    with capture_logs() as logs:
        assert await read_or_keep(read, "audit.counters_unreadable") is None
    assert logs == [{"event": "audit.counters_unreadable", "log_level": "warning", "error": "x" * 200}]
