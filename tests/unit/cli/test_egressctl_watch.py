"""egressctl's view of refusals (docs/behaviour.md §15): the DROPPED / RECENT-DENIALS columns of
``subjects``, the ``dropped`` line of ``status`` and ``watch``, against the real fleet HTTP app
(served in-process from a background loop) with a fake kernel whose drop counters grow."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from aiohttp import web

from egressd.actionhandler.control import ControlPlane
from egressd.cli.egressctl import main
from egressd.cli.watch import CLEAR, History, Snapshot, frame, run_watch
from egressd.config import parse_config
from egressd.fleet.server import FleetHTTP
from egressd.fleet.visibility import fleet_visibility
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.metrics import EgressMetrics
from tests.unit.fakekernel import FakeTx

POLICY = json.dumps({"defaultAction": "deny", "egress": [{"action": "allow", "target": "a.test"}]})


class Daemon:
    """FleetHTTP with the visibility parts, on 127.0.0.1:<free port> in its own loop. Every
    counter dump finds s-u-1's drop counter 5 packets higher (a sandbox hammering a denied host)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.counters = {"subj_s_u_1_dropped": 0, "subj_s_u_2_dropped": 2, "unattributed_dropped": 4}
        self.vis: Any = None

    async def read(self) -> dict[str, int]:
        self.counters["subj_s_u_1_dropped"] += 5
        return dict(self.counters)

    async def _start(self) -> None:
        cfg = parse_config({"OPENSANDBOX_EGRESS_PROFILE": "fleet"})
        metrics = EgressMetrics()
        control = ControlPlane(FleetPlanKernel(TableConfig(), FakeTx()))
        await control.reset_table()
        self.vis = fleet_visibility(cfg.common, metrics, self.read, lambda: list(control.registry))
        control.listeners += [self.vis.audit, self.vis.drops]
        http = FleetHTTP(
            control, metrics, before_scrape=self.vis.before_scrape, annotate_subjects=self.vis.drops.annotate
        )
        self.runner = web.AppRunner(http.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    def deny(self, uid: str, name: str, rule: str = "default") -> None:
        async def go() -> None:
            self.vis.events.denied(uid, name, "policy", rule)

        asyncio.run_coroutine_threadsafe(go(), self.loop).result(timeout=5)

    def start(self) -> Daemon:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)
        return self

    def stop(self) -> None:
        assert self.runner is not None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    saved = structlog.get_config()
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    yield
    structlog.configure(**saved)


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon().start()
    try:
        yield d
    finally:
        d.stop()


def ctl(capsys: pytest.CaptureFixture[str], d: Daemon, *argv: str) -> tuple[int, str, str]:
    code = main(["--addr", d.addr, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def bind(capsys: pytest.CaptureFixture[str], d: Daemon, uid: str, ip: str) -> None:
    code, _, err = ctl(capsys, d, "send", "set-binding", "--uid", uid, "--ip", ip, "--policy", POLICY)
    assert code == 0, err


def test_subjects_show_drops_and_recent_denials(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    bind(capsys, daemon, "u-1", "10.0.0.5")
    bind(capsys, daemon, "u-2", "10.0.0.6")
    for name in ("one.test", "two.test", "three.test", "four.test"):
        daemon.deny("u-1", name)
    code, out, _ = ctl(capsys, daemon, "subjects")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split()[-2:] == ["DROPPED", "RECENT-DENIALS"]
    assert [r.split()[-2:] for r in rows] == [["5", "four.test,three.test,two.test,+1"], ["2", "-"]]
    assert [r[header.index("DROPPED") :].split()[0] for r in rows] == ["5", "2"]  # aligned
    (first, _) = json.loads(ctl(capsys, daemon, "--json", "subjects")[1])
    assert first["droppedPackets"] == 10
    assert [d["name"] for d in first["recentDenials"]] == ["one.test", "two.test", "three.test", "four.test"]


def test_status_sums_the_drops(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    bind(capsys, daemon, "u-1", "10.0.0.5")
    code, out, _ = ctl(capsys, daemon, "status")
    assert code == 0
    lines = dict(line.split(None, 1) for line in out.splitlines())
    assert lines["dropped"] == "5 packets by subjects, 4 unattributed"  # u-2 is not registered
    doc = json.loads(ctl(capsys, daemon, "--json", "status")[1])
    assert doc["subjects"]["droppedPackets"] == 10
    assert doc["subjects"]["unattributedDroppedPackets"] == 4


def test_watch_refreshes_a_bounded_number_of_times(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    bind(capsys, daemon, "u-1", "10.0.0.5")
    daemon.deny("u-1", "evil.test", "egress[0]")
    code, out, err = ctl(capsys, daemon, "watch", "--interval", "0.05", "--count", "3")
    assert (code, err) == (0, "")
    assert CLEAR not in out  # not a terminal: frames follow each other
    frames = out.split("\n\n")
    assert len(frames) == 3
    for i, text in enumerate(frames, 1):
        lines = text.strip("\n").splitlines()
        assert lines[0].startswith(f"egressd {daemon.addr}  ") and lines[0].endswith(f"frame {i}/3")
        assert lines[2].split() == ["SUBJECT", "STATE", "SOURCE-IP", "DROPPED", "NEW", "RECENT-DENIALS"]
        row = lines[3].split()
        assert row[:3] == ["s-u-1", "denying", "10.0.0.5"]
        assert row[3] == str(5 * i)
        assert row[4] == ("-" if i == 1 else "+5")  # refused since the previous frame
        assert row[5] == "evil.test"
    assert frames[0].splitlines()[1] == "subjects 1  dropped 5  unattributed 4 (-)"
    assert frames[1].splitlines()[1] == "subjects 1  dropped 10  unattributed 4 (+0)"


def test_watch_json_prints_one_document_per_refresh(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    bind(capsys, daemon, "u-1", "10.0.0.5")
    code, out, _ = ctl(capsys, daemon, "--json", "watch", "--interval", "0.01", "--count", "2")
    assert code == 0
    docs = [json.loads(line) for line in out.splitlines()]
    assert [d["subjects"][0]["droppedPackets"] for d in docs] == [5, 10]
    assert docs[0]["unattributedDroppedPackets"] == 4


def test_watch_of_an_unreachable_daemon_fails_like_any_command(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["--addr", f"127.0.0.1:{port}", "watch", "--count", "2", "--interval", "0.01"])
    out = capsys.readouterr()
    assert code == 3
    assert out.out == "" and out.err.startswith("egressctl: ") and out.err.count("\n") == 1


def test_watch_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["watch", "--interval", "0"]) == 2
    assert main(["watch", "--count", "-1"]) == 2
    capsys.readouterr()


def test_frames_on_a_terminal_replace_each_other_and_show_failures() -> None:
    snaps = iter(
        [
            Snapshot(
                [{"uid": "u", "subject": "s-u", "state": "active", "revoking": True, "droppedPackets": 3}], 0
            ),
            Snapshot(error="GET /v1/subjects: connection refused"),
            Snapshot([{"uid": "u", "subject": "s-u", "state": "active", "droppedPackets": 1}], 0),
        ]
    )
    out: list[str] = []
    sleeps: list[float] = []
    run_watch(
        lambda: next(snaps),
        out.append,
        addr="x",
        interval=1.5,
        count=3,
        tty=True,
        sleep=sleeps.append,
        clock=lambda: 0,
    )
    assert sleeps == [1.5, 1.5]
    assert all(o.startswith(CLEAR) for o in out)
    assert "revoking" in out[0]
    assert out[1].splitlines()[1] == "unavailable: GET /v1/subjects: connection refused"
    assert out[2].splitlines()[-1].split()[3:5] == ["1", "reset"]  # a counter that went back


def test_frame_cells_are_single_fields() -> None:
    snap = Snapshot(
        [{"uid": "u", "subject": "s-a b", "state": None, "recentDenials": [{"name": "x y"}]}], None
    )
    lines = frame(snap, History(), addr="a", now=0, interval=1, index=1, count=None)
    assert lines[0].endswith("frame 1")
    assert lines[1] == "subjects 1  dropped 0"
    assert lines[3].split() == ["s-a_b", "-", "-", "-", "-", "x_y"]
