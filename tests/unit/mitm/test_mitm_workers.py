"""EGRESSD_MITM_WORKERS: parsing, limits and port collisions; the worker pool (per-worker
options, readiness, /healthz text, forgets to every worker, independent restarts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path

import pytest

import egressd.mitm.config as mitm_config
from egressd.config import ConfigError, parse_config
from egressd.metrics import EgressMetrics
from egressd.mitm.config import default_mitm_workers, parse_mitm_workers
from egressd.mitm.pool import MitmPool, not_ready_message, worker_options
from egressd.mitm.supervisor import MitmOptions, MitmSupervisor, mitmdump_argv

FLEET = {"OPENSANDBOX_EGRESS_PROFILE": "fleet"}


def refused(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(env)
    assert "\n" not in str(info.value)
    return str(info.value)


# --------------------------------------------------------------------------- configuration


def test_default_is_the_usable_cpus_clamped(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [default_mitm_workers(n) for n in (0, 1, 2, 16, 17, 64)] == [1, 1, 2, 16, 16, 16]
    monkeypatch.setattr(mitm_config, "_usable_cpus", lambda: 3)
    assert parse_config(FLEET).mitm.workers == 3
    assert parse_config(FLEET | {"EGRESSD_MITM_WORKERS": " "}).mitm.workers == 3
    monkeypatch.setattr(mitm_config, "_usable_cpus", lambda: 40)
    assert parse_config(FLEET).mitm.workers == 16


@pytest.mark.parametrize("value", ["1", "2", "16", " 7 "])
def test_valid_values(value: str) -> None:
    cfg = parse_config(FLEET | {"EGRESSD_MITM_WORKERS": value})
    assert cfg.mitm.workers == int(value)
    assert cfg.mitm.worker_ports == tuple(18081 + i for i in range(int(value)))
    assert parse_config(FLEET, ["--mitm-workers", value]).mitm.workers == int(value)


@pytest.mark.parametrize("value", ["0", "17", "x", "-1", "2.5", "1e1"])
def test_invalid_values_refuse_start_up(value: str) -> None:
    assert refused(FLEET | {"EGRESSD_MITM_WORKERS": value}).startswith("EGRESSD_MITM_WORKERS: ")
    # The sidecar runs one worker, but a typo still refuses start-up there too.
    assert refused({"EGRESSD_MITM_WORKERS": value}).startswith("EGRESSD_MITM_WORKERS: ")
    with pytest.raises(ConfigError):
        parse_mitm_workers(value, 2)


def test_the_sidecar_always_runs_one_worker() -> None:
    # An option of both profiles: a valid value is accepted, and one worker runs.
    cfg = parse_config({"EGRESSD_MITM_WORKERS": "8"})
    assert cfg.profile == "sidecar" and cfg.mitm.workers == 1 and cfg.mitm.worker_ports == (18081,)


def test_the_range_must_end_inside_the_port_space() -> None:
    assert parse_config(FLEET | {"EGRESSD_MITM_WORKERS": "2", "OPENSANDBOX_EGRESS_MITMPROXY_PORT": "65534"})
    msg = refused(FLEET | {"EGRESSD_MITM_WORKERS": "3", "OPENSANDBOX_EGRESS_MITMPROXY_PORT": "65534"})
    assert "pass port 65535" in msg


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"OPENSANDBOX_EGRESS_HTTP_ADDR": "127.0.0.1:18083"}, "HTTP or DNS port 18083"),
        ({"EGRESSD_DNS_ADDR": "0.0.0.0:18082"}, "HTTP or DNS port 18082"),
    ],
)
def test_the_range_misses_the_http_and_dns_ports(extra: dict[str, str], needle: str) -> None:
    msg = refused(FLEET | {"EGRESSD_MITM_WORKERS": "4"} | extra)
    assert msg.startswith("EGRESSD_MITM_WORKERS: the worker ports 18081-18084") and needle in msg
    assert parse_config(FLEET | {"EGRESSD_MITM_WORKERS": "1"} | extra)


def test_the_range_misses_the_host_uid_block() -> None:
    env = FLEET | {"EGRESSD_UID_DNS_PORT_BASE": "18085", "EGRESSD_MITM_WORKERS": "4"}
    assert parse_config(env)
    msg = refused(env | {"EGRESSD_MITM_WORKERS": "5"})
    assert msg.startswith("EGRESSD_UID_DNS_PORT_BASE: ") and "18081-18085" in msg


def test_the_range_misses_the_extra_intercepted_ports() -> None:
    env = FLEET | {"OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS": "18083"}
    assert parse_config(env | {"EGRESSD_MITM_WORKERS": "2"})
    assert "MITM's own port" in refused(env | {"EGRESSD_MITM_WORKERS": "3"})


# --------------------------------------------------------------------------- the pool


def _opts(subject_ports: tuple[int, ...] = ()) -> MitmOptions:
    return MitmOptions(
        port=18081, confdir=Path("/c"), active_socket=Path("/s"), upstream_trust_dir=None,
        subject_ports=subject_ports,
    )  # fmt: skip


def test_worker_options_give_each_worker_its_port_and_a_share_of_the_uid_block() -> None:
    block = tuple(range(16257, 16267))  # slots 0..9
    each = worker_options(_opts(block), 3)
    assert [o.port for o in each] == [18081, 18082, 18083]
    assert [o.subject_ports for o in each] == [
        (16257, 16260, 16263, 16266),
        (16258, 16261, 16264),
        (16259, 16262, 16265),
    ]
    # Every port has exactly one listener.
    assert sorted(p for o in each for p in o.subject_ports) == list(block)
    argv = [mitmdump_argv(o) for o in each]
    assert "listen_port=18082" in argv[1] and "mode=transparent@16258" in argv[1]
    assert "mode=transparent@16258" not in argv[0]
    assert worker_options(_opts(block), 1)[0].subject_ports == block


def test_health_names_the_workers_not_ready() -> None:
    assert not_ready_message([]) is None
    assert not_ready_message([1]) == "mitm worker 1 not ready"
    assert not_ready_message([0, 2]) == "mitm workers 0, 2 not ready"
    pool = MitmPool([MitmSupervisor(["true"], worker=i) for i in range(3)], [1, 2, 3])
    assert not pool.ready and pool.health() == "mitm workers 0, 1, 2 not ready"
    pool.workers[0].ready = pool.workers[2].ready = True
    assert pool.health() == "mitm worker 1 not ready" and not pool.ready
    pool.workers[1].ready = True
    assert pool.ready and pool.health() is None
    assert [w["port"] for w in pool.status_doc()] == [1, 2, 3]
    with pytest.raises(ValueError):
        MitmPool([], [])


def _child(tag: Path) -> list[str]:
    """A fake child: ready at once, appends its stdin lines to ``tag``, exits on 'die'."""
    script = (
        "import json,sys\n"
        "print(json.dumps({'event':'mitm.ready'}),flush=True)\n"
        f"f=open({str(tag)!r},'ab',buffering=0)\n"
        "for line in sys.stdin.buffer:\n"
        "    f.write(line)\n"
    )
    return [sys.executable, "-c", script]


async def _wait(cond: object, timeout: float = 10.0) -> None:
    assert callable(cond)
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met")


async def test_forgets_reach_every_worker_and_gauges_are_per_worker(tmp_path: Path) -> None:
    metrics = EgressMetrics()
    tags = [tmp_path / f"w{i}.txt" for i in range(2)]
    sups = [MitmSupervisor(_child(t), metrics=metrics, worker=i) for i, t in enumerate(tags)]
    pool = MitmPool(sups, [18081, 18082])
    pool.watch(metrics)
    task = asyncio.create_task(pool.run())
    try:
        assert await pool.wait_ready(10)
        pool.forget(iter(["10.0.0.5"]))  # an iterator: each worker must still get the address
        await _wait(lambda: all(t.exists() and t.read_bytes() for t in tags))
        for t in tags:
            assert json.loads(t.read_bytes()) == {"op": "forget", "ips": ["10.0.0.5"]}
        text = metrics.render()
        assert 'egressd_mitm_ready{worker="0"} 1' in text and 'egressd_mitm_ready{worker="1"} 1' in text
        assert 'egressd_mitm_starts_total{worker="1"} 1' in text
    finally:
        await pool.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_dead_worker_is_restarted_alone_after_the_ca_check(tmp_path: Path) -> None:
    checks: list[int] = []
    sups = [
        MitmSupervisor(_child(tmp_path / f"w{i}"), backoff=(0.05, 0.1), worker=i, before_restart=lambda: checks.append(1))
        for i in range(2)
    ]
    pool = MitmPool(sups, [18081, 18082])
    task = asyncio.create_task(pool.run())
    try:
        assert await pool.wait_ready(10)
        first = [s.pid for s in sups]
        assert sups[1].pid is not None
        import os
        import signal

        os.kill(sups[1].pid, signal.SIGKILL)
        await _wait(lambda: sups[1].starts == 2 and sups[1].ready)
        assert sups[0].starts == 1 and sups[0].pid == first[0], "the other worker was not touched"
        assert sups[1].pid != first[1]
        assert checks == [1], "the CA was re-checked before the restart, once"
    finally:
        await pool.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_egressctl_status_lines_per_worker() -> None:
    from egressd.cli.commands.status import _worker_lines

    doc = [
        {"worker": 0, "port": 18081, "pid": 41, "ready": True, "starts": 1},
        {"worker": 1, "port": 18082, "pid": None, "ready": False, "starts": 2},
        "junk",
    ]
    assert _worker_lines(doc) == [
        ("mitm-worker 0", "pid 41 port 18081 ready starts 1"),
        ("mitm-worker 1", "pid - port 18082 NOT READY starts 2"),
    ]
    assert _worker_lines(None) == []
