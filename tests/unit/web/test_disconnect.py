"""docs/behaviour.md §14.10, a client that goes away: every action is carried to its end.

Two harnesses. Over real loopback sockets against the daemon's own listener
(:func:`egressd.web.serving.start_http`): half-close, close and reset at each point of a request.
Over aiohttp's test client, whose server cancels a handler when its client disconnects
(``handler_cancellation=True``): the cancellation lands in the middle of the kernel step.
The shared fake kernel, held (``FakeKernel.hold``), keeps the step open so the disconnect falls inside it deterministically.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from egressd.actionhandler.control import ControlPlane
from egressd.fleet.proxyroute import ProxyRouteAPI
from egressd.fleet.server import ACTIONS_PATH, FleetHTTP
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.metrics import EgressMetrics
from egressd.policy import DENY_ALL
from egressd.sidecar.engine import SidecarEngine
from egressd.sidecar.http import SidecarHTTP
from egressd.sidecarnft.ruleset import SidecarTable
from egressd.web.serving import InFlight, start_http
from tests.unit.fakekernel import FakeTx
from tests.unit.fleet.test_http import hook, set_binding
from tests.unit.sidecar.test_sidecar_http import AUTH, ready_prereqs

ALLOW = '{"defaultAction":"deny","egress":[{"action":"allow","target":"8.8.8.8"}]}'
OTHER = '{"defaultAction":"deny","egress":[{"action":"allow","target":"9.9.9.9"}]}'


@dataclass
class Fleet:
    control: ControlPlane
    tx: FakeTx
    http: FleetHTTP


async def make_fleet() -> Fleet:
    tx = FakeTx(yield_each_call=False)
    metrics = EgressMetrics()
    control = ControlPlane(FleetPlanKernel(TableConfig(table="T"), tx), metrics=metrics)
    await control.reset_table()
    http = FleetHTTP(control, metrics, proxy=ProxyRouteAPI(control))
    return Fleet(control, tx, http)


@dataclass
class Served:
    fleet: Fleet
    runner: web.AppRunner
    host: str
    port: int


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    fleet = await make_fleet()
    runner = await start_http(fleet.http.app(), "127.0.0.1", 0)
    host, port = runner.addresses[0][:2]
    try:
        yield Served(fleet, runner, host, port)
    finally:
        fleet.tx.release()
        await runner.cleanup()


def request_bytes(doc: object, *, keep_alive: bool = False) -> bytes:
    """A POST of ``doc`` to the actions endpoint; without keep_alive the server closes after
    the reply (so a reader reads up to EOF). The half-close tests keep it alive: closing after
    a FIN is the server's own doing there."""
    body = json.dumps(doc).encode()
    connection = "" if keep_alive else "Connection: close\r\n"
    head = (
        f"POST {ACTIONS_PATH} HTTP/1.1\r\nHost: egressd\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{connection}\r\n"
    )
    return head.encode() + body


async def connect(s: Served) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(s.host, s.port)


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0: the peer gets a RST, not a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def read_reply(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """Status and body of the reply (0 if the server closed without one)."""
    raw = await asyncio.wait_for(reader.read(), 5)
    if not raw:
        return 0, b""
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def settled(inflight: InFlight) -> None:
    """Until no mutation is running (the ones of clients that are gone included)."""
    for _ in range(500):
        await asyncio.sleep(0.01)
        if not len(inflight):
            return
    raise AssertionError("mutations still running")


async def plan_of(*docs: object) -> list[tuple[str, str]]:
    """The kernel plan the same actions produce on a fresh daemon with a client that stays."""
    fleet = await make_fleet()
    start = len(fleet.tx.applied)
    runner = await start_http(fleet.http.app(), "127.0.0.1", 0)
    host, port = runner.addresses[0][:2]
    try:
        for doc in docs:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(request_bytes(doc))
            assert (await read_reply(reader))[0] == 200
            writer.close()
    finally:
        await runner.cleanup()
    return fleet.tx.applied[start:]


# ----------------------------------------------------------------------- half-close


async def test_half_close_after_the_full_body_still_gets_the_200(served: Served) -> None:
    reader, writer = await connect(served)
    writer.write(request_bytes(set_binding(policy=ALLOW), keep_alive=True))
    writer.write_eof()
    status, body = await read_reply(reader)
    assert (status, body) == (200, b"{}")
    entry = served.fleet.control.registry.get("u-1")
    assert entry is not None and entry.state.value == "denying" and entry.pending is not None


async def test_half_close_during_the_kernel_step_still_gets_the_200(served: Served) -> None:
    tx = served.fleet.tx
    tx.hold()
    reader, writer = await connect(served)
    writer.write(request_bytes(set_binding(policy=ALLOW), keep_alive=True))
    await asyncio.wait_for(tx.entered.wait(), 5)
    writer.write_eof()
    await asyncio.sleep(0.05)  # the FIN is processed while the step is held
    tx.release()
    assert await read_reply(reader) == (200, b"{}")
    assert served.fleet.control.registry.get("u-1") is not None


async def test_half_close_before_the_body_is_complete_applies_nothing(served: Served) -> None:
    before = list(served.fleet.tx.applied)
    data = request_bytes(set_binding(policy=ALLOW), keep_alive=True)
    reader, writer = await connect(served)
    writer.write(data[:-10])
    writer.write_eof()
    status, body = await read_reply(reader)
    assert status == 400 and b"incomplete" in body
    assert served.fleet.control.registry.get("u-1") is None
    assert served.fleet.tx.applied == before


# ----------------------------------------------------------------------- close / reset


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_gone_before_the_body_is_complete_applies_nothing(served: Served, how: str) -> None:
    before = list(served.fleet.tx.applied)
    data = request_bytes(set_binding(policy=ALLOW))
    _reader, writer = await connect(served)
    writer.write(data[:-10])
    await writer.drain()
    await asyncio.sleep(0.05)  # the partial body is in the server's reader
    if how == "reset":
        reset(writer)
    else:
        writer.close()
    await asyncio.sleep(0.1)
    await settled(served.fleet.http.inflight)
    assert served.fleet.control.registry.get("u-1") is None
    assert served.fleet.tx.applied == before


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_gone_during_the_kernel_step_the_action_completes_and_the_retry_is_idempotent(
    served: Served, how: str
) -> None:
    expected = await plan_of(set_binding(policy=ALLOW), hook())
    fleet = served.fleet
    start = len(fleet.tx.applied)
    for doc in (set_binding(policy=ALLOW), hook()):
        fleet.tx.hold()
        reader, writer = await connect(served)
        writer.write(request_bytes(doc))
        await asyncio.wait_for(fleet.tx.entered.wait(), 5)
        if how == "reset":
            reset(writer)
        else:
            writer.close()
        await asyncio.sleep(0.05)
        fleet.tx.release()
        await settled(fleet.http.inflight)
    assert fleet.tx.applied[start:] == expected  # the whole plan, as if the client had stayed
    entry = fleet.control.registry.get("u-1")
    assert entry is not None and entry.state.value == "active" and entry.pending is None
    committed = (entry.state, entry.policy, entry.fence)
    # The dispatcher saw no reply and retries both: 200 each, same registry, the retried
    # data-plane-ready changes nothing in the kernel.
    for doc in (set_binding(policy=ALLOW), hook()):
        reader, writer = await connect(served)
        writer.write(request_bytes(doc))
        assert await read_reply(reader) == (200, b"{}")
        writer.close()
    entry = fleet.control.registry.get("u-1")
    assert entry is not None and (entry.state, entry.policy, entry.fence) == committed


async def test_shutdown_waits_for_the_action_of_a_client_that_left(served: Served) -> None:
    fleet = served.fleet
    fleet.tx.hold()
    _reader, writer = await connect(served)
    writer.write(request_bytes(set_binding(policy=ALLOW)))
    await asyncio.wait_for(fleet.tx.entered.wait(), 5)
    reset(writer)
    await asyncio.sleep(0.05)
    asyncio.get_running_loop().call_later(0.2, fleet.tx.release)
    await asyncio.wait_for(served.runner.cleanup(), 5)
    # cleanup returned only once the action had committed.
    assert not len(fleet.http.inflight)
    assert fleet.control.registry.get("u-1") is not None


async def test_drain_is_bounded() -> None:
    inflight = InFlight(drain_timeout=0.05)
    never = asyncio.Event()
    task = asyncio.ensure_future(inflight.run(never.wait()))
    await asyncio.sleep(0)
    assert await inflight.drain() == 1
    never.set()
    await task
    assert await inflight.drain() == 0


# ----------------------------------------------------------------------- handler cancelled


async def _cancelled_mid_step(tx: FakeTx, send: Callable[[], Awaitable[Any]], inflight: InFlight) -> None:
    """``send`` is abandoned (its connection closed, its handler cancelled) during the step."""
    tx.hold()
    task = asyncio.ensure_future(send())
    await asyncio.wait_for(tx.entered.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)  # the server sees the disconnect and cancels the handler
    tx.release()
    await settled(inflight)


async def test_handler_cancelled_mid_kernel_step_action_still_completes(aiohttp_client: Any) -> None:
    expected = await plan_of(set_binding(policy=ALLOW), hook(), set_binding(policy=OTHER))
    fleet = await make_fleet()
    start = len(fleet.tx.applied)
    # aiohttp's test server runs with handler_cancellation=True: a disconnect cancels the handler.
    client = await aiohttp_client(fleet.http.app())
    for doc in (set_binding(policy=ALLOW), hook(), set_binding(policy=OTHER)):
        await _cancelled_mid_step(
            fleet.tx, functools.partial(client.post, ACTIONS_PATH, data=json.dumps(doc)), fleet.http.inflight
        )
    assert fleet.tx.applied[start:] == expected
    entry = fleet.control.registry.get("u-1")
    assert entry is not None and entry.state.value == "active"
    assert entry.policy is not None and [r.target for r in entry.policy.egress] == ["9.9.9.9"]


async def test_shutdown_waits_for_the_action_of_a_cancelled_handler(aiohttp_client: Any) -> None:
    """The handler is gone (cancelled by the disconnect), so aiohttp's own graceful shutdown
    does not wait for it: the application's shutdown drains the action itself."""
    fleet = await make_fleet()
    client = await aiohttp_client(fleet.http.app())
    fleet.tx.hold()
    task = asyncio.ensure_future(client.post(ACTIONS_PATH, data=json.dumps(set_binding(policy=ALLOW))))
    await asyncio.wait_for(fleet.tx.entered.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    asyncio.get_running_loop().call_later(0.2, fleet.tx.release)
    await asyncio.wait_for(client.close(), 5)  # the test server's runner cleanup
    entry = fleet.control.registry.get("u-1")
    assert entry is not None and entry.state.value == "denying" and entry.pending is not None


async def test_proxy_route_policy_write_cancelled_mid_kernel_step_still_applies(aiohttp_client: Any) -> None:
    fleet = await make_fleet()
    client = await aiohttp_client(fleet.http.app())
    for doc in (set_binding(policy=ALLOW), hook()):
        assert (await client.post(ACTIONS_PATH, data=json.dumps(doc))).status == 200
    path = "/v1/sandboxfleets/u-1/egress/policy"
    await _cancelled_mid_step(fleet.tx, lambda: client.put(path, data=OTHER), fleet.http.inflight)
    entry = fleet.control.registry.get("u-1")
    assert entry is not None and entry.policy is not None
    assert [r.target for r in entry.policy.egress] == ["9.9.9.9"]


async def test_sidecar_policy_write_cancelled_mid_kernel_step_still_applies(
    aiohttp_client: Any, tmp_path: Path
) -> None:
    kernel = FakeTx(yield_each_call=False)
    engine = SidecarEngine(
        SidecarTable(table="T", mode="dns+nft"), kernel, DENY_ALL, persist_path=tmp_path / "p"
    )
    await engine.install()
    http = SidecarHTTP(engine, EgressMetrics(), token=None, max_rules=4096, prerequisites=ready_prereqs())
    client = await aiohttp_client(http.app())
    kernel.hold()
    task = asyncio.ensure_future(client.put("/policy", data=ALLOW, headers=AUTH))
    await asyncio.wait_for(kernel.entered.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    kernel.release()
    await settled(http.inflight)
    assert [r.target for r in engine.user.egress] == ["8.8.8.8"]
    assert "8.8.8.8" in kernel.scripts[-1][1]


async def test_sidecar_half_close_during_the_kernel_step_still_gets_the_reply(tmp_path: Path) -> None:
    kernel = FakeTx(yield_each_call=False)
    engine = SidecarEngine(
        SidecarTable(table="T", mode="dns+nft"), kernel, DENY_ALL, persist_path=tmp_path / "p"
    )
    await engine.install()
    http = SidecarHTTP(engine, EgressMetrics(), token=None, max_rules=4096, prerequisites=ready_prereqs())
    runner = await start_http(http.app(), "127.0.0.1", 0)
    host, port = runner.addresses[0][:2]
    try:
        kernel.hold()
        reader, writer = await asyncio.open_connection(host, port)
        body = ALLOW.encode()
        writer.write(b"PUT /policy HTTP/1.1\r\nHost: s\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await asyncio.wait_for(kernel.entered.wait(), 5)
        writer.write_eof()
        await asyncio.sleep(0.05)
        kernel.release()
        status, reply = await read_reply(reader)
        assert status == 200 and json.loads(reply)["status"] == "ok"
        assert [r.target for r in engine.user.egress] == ["8.8.8.8"]
    finally:
        kernel.release()
        await runner.cleanup()
