"""egressd.lifecycle: the one shutdown order of both profiles, and the profiles' exit codes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import pytest

from egressd.lifecycle import Running, StartupError, run_profile
from egressd.sidecar.run import SidecarStartupError


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.on: dict[str, Callable[[], None]] = {}

    def sync(self, name: str, fail: bool = False) -> Any:
        def call() -> None:
            self.calls.append(name)
            if name in self.on:
                self.on[name]()
            if fail:
                raise RuntimeError(name)

        return call

    def coro(self, name: str, fail: bool = False) -> Any:
        async def call() -> None:
            self.sync(name, fail)()

        return call


class Fake:
    """An object whose named methods record their calls."""

    def __init__(self, rec: Recorder, label: str, *names: str, sync: tuple[str, ...] = ()) -> None:
        for n in names:
            setattr(self, n, rec.coro(f"{label}.{n}"))
        for n in sync:
            setattr(self, n, rec.sync(f"{label}.{n}"))


async def _forever() -> None:
    await asyncio.Event().wait()


async def _started(rec: Recorder, *, http_fails: bool = False) -> tuple[Running, list[asyncio.Task[None]]]:
    running = Running(cast(Any, Fake(rec, "tx", "close")))
    http = Fake(rec, "http", "cleanup")
    if http_fails:
        http.cleanup = rec.coro("http.cleanup", fail=True)  # type: ignore[attr-defined]
    running.http = cast(Any, http)
    running.spawn(_forever())
    running.stoppers.append(rec.coro("control.close"))
    mitm = Fake(rec, "mitm", "close")
    mitm.supervisor = Fake(rec, "supervisor")  # type: ignore[attr-defined]
    mitm.supervisor.run = _forever  # type: ignore[attr-defined]
    running.supervise(cast(Any, mitm))
    running.dns = cast(Any, Fake(rec, "dns", "close"))
    running.forwarder = cast(Any, Fake(rec, "forwarder", sync=("close",)))
    tasks = [*running.background, cast(asyncio.Task[None], running.mitm_task)]
    await asyncio.sleep(0)  # the tasks are waiting
    return running, tasks


async def test_close_stops_in_one_order_for_both_profiles() -> None:
    rec = Recorder()
    running, (background, supervisor) = await _started(rec)
    # Which tasks had been told to stop when each step ran.
    cancelled: dict[str, tuple[bool, bool]] = {}

    def probe(step: str) -> Callable[[], None]:
        def note() -> None:
            cancelled[step] = (background.cancelling() > 0, supervisor.cancelling() > 0)

        return note

    for step in ("http.cleanup", "control.close", "mitm.close", "dns.close"):
        rec.on[step] = probe(step)
    await running.close(rec.coro("table.delete"))
    await asyncio.gather(background, supervisor, return_exceptions=True)
    assert rec.calls == [
        "http.cleanup",  # no new action; in-flight ones finish while the rest is up
        "control.close",
        "mitm.close",
        "dns.close",
        "forwarder.close",
        "table.delete",
        "tx.close",
    ]
    assert cancelled == {
        "http.cleanup": (False, False),
        "control.close": (True, False),  # the background tasks go with the revocation retries
        "mitm.close": (True, False),  # the child stops while its supervisor still reads it
        "dns.close": (True, True),
    }
    assert background.cancelled() and supervisor.cancelled()


async def test_a_failing_step_still_runs_the_kernel_step_and_closes_the_kernel() -> None:
    rec = Recorder()
    running, tasks = await _started(rec, http_fails=True)
    with pytest.raises(RuntimeError, match=r"http\.cleanup"):
        await running.close(rec.coro("table.delete"))
    assert rec.calls[-2:] == ["table.delete", "tx.close"]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_nothing_started_closes_only_the_kernel() -> None:
    rec = Recorder()
    await Running(cast(Any, Fake(rec, "tx", "close"))).close()
    assert rec.calls == ["tx.close"]


def test_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    async def ok() -> None:
        return None

    async def refused() -> None:
        raise SidecarStartupError("cannot listen on 0.0.0.0:18080: Address in use")

    async def interrupted() -> None:
        raise KeyboardInterrupt

    assert run_profile(ok()) == 0
    assert run_profile(refused()) == 1
    assert capsys.readouterr().err == "egressd: cannot listen on 0.0.0.0:18080: Address in use\n"
    assert issubclass(SidecarStartupError, StartupError)
    assert run_profile(interrupted()) == 130
