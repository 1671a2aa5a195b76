"""Per-subject refusal counts (docs/reference/behaviour.md §15): parsing the kernel's counters, one dump per
scrape shared with the audit evidence, and the fields /v1/subjects gives egressctl."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiohttp.test_utils import TestClient

from egressd.actionhandler.control import ControlPlane
from egressd.actionhandler.envelope import parse_action
from egressd.config import parse_config
from egressd.engine.backend import Refusals
from egressd.engine.refusals import samples
from egressd.events.denials import RecentDenials
from egressd.fleet.drops import CounterDump, DropCounters
from egressd.fleet.server import FleetHTTP
from egressd.fleet.visibility import fleet_visibility
from egressd.fleetnft.backend import fleet_refusals
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig, dropped_counter_subject
from egressd.metrics import EgressMetrics
from tests.unit.fakekernel import FakeTx


class Kernel:
    """The table's counter objects, as the one netlink dump returns them; counts the dumps."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = counters
        self.reads = 0
        self.fail = False

    async def read(self) -> dict[str, int]:
        self.reads += 1
        await asyncio.sleep(0.01)  # the real dump runs on the kernel thread
        if self.fail:
            raise OSError("netlink dump failed")
        return dict(self.counters)


def binding(uid: str, ip: str) -> Any:
    return parse_action(
        json.dumps(
            {
                "apiVersion": "sandbox.fast.io/actions/v1",
                "operation": "SET_BINDING",
                "sandbox": {"uid": uid},
                "revision": {"runtimeInstanceId": "r1", "attachmentId": "a1", "specGeneration": 1},
                "attachment": {"network": {"ip": ip, "gateway": "10.0.0.1", "hostVeth": "v"}},
                "binding": {"input": '{"defaultAction":"deny"}'},
            }
        ).encode()
    )


def test_counter_names() -> None:
    assert dropped_counter_subject("subj_s_u_1_dropped") == "s_u_1"
    assert dropped_counter_subject("subj_x_audit_deny") is None
    assert dropped_counter_subject("subj__dropped") is None
    assert dropped_counter_subject("unattributed_dropped") is None
    counters = {
        "subj_s_a_dropped": 4,
        "subj_s_a_audit_deny": 9,
        "unattributed_dropped": 3,
        "subj_s_b_dropped": 0,
    }
    assert fleet_refusals(counters) == Refusals({"s_a": 4, "s_b": 0}, 3)
    # Only registered subjects are named; the unattributed ones are subject "-".
    assert samples(fleet_refusals(counters), {"s_a": "s-a"}) == {("s-a",): 4.0, ("-",): 3.0}


async def test_concurrent_readers_share_one_dump() -> None:
    kernel = Kernel({"subj_s_a_dropped": 1})
    dump = CounterDump(kernel.read)
    first, second = await asyncio.gather(dump(), dump())
    assert first == second == {"subj_s_a_dropped": 1}
    assert kernel.reads == 1
    await dump()
    assert kernel.reads == 2  # a later reader gets a fresh dump


async def _app(
    aiohttp_client: Callable[..., Any], kernel: Kernel, denials: RecentDenials | None = None
) -> tuple[TestClient[Any, Any], ControlPlane, Any]:
    cfg = parse_config({"OPENSANDBOX_EGRESS_PROFILE": "fleet"})
    metrics = EgressMetrics()
    control = ControlPlane(FleetPlanKernel(TableConfig(), FakeTx()))
    await control.reset_table()
    vis = fleet_visibility(cfg.common, metrics, kernel.read, lambda: list(control.registry))
    if denials is not None:
        vis.drops.denials = vis.events.denials = denials
    control.listeners += [vis.audit, vis.drops]
    http = FleetHTTP(control, metrics, before_scrape=vis.before_scrape, annotate_subjects=vis.drops.annotate)
    client = await aiohttp_client(http.app())
    return client, control, vis


async def test_a_scrape_reads_the_kernel_once_and_exports_every_subject(aiohttp_client: Any) -> None:
    kernel = Kernel(
        {
            "subj_s_u_1_dropped": 7,
            "subj_s_u_1_audit_deny": 0,
            "subj_s_u_1_audit_default": 0,
            "subj_s_u_2_dropped": 0,
            "subj_s_gone_dropped": 5,  # being removed: not in the registry
            "unattributed_dropped": 2,
        }
    )
    client, control, _ = await _app(aiohttp_client, kernel)
    for uid, ip in (("u-1", "10.0.0.5"), ("u-2", "10.0.0.6")):
        assert (await control.handle(binding(uid, ip))).status == 200
    resp = await client.get("/metrics")
    text = await resp.text()
    assert kernel.reads == 1  # audit evidence and drop counts from the same dump
    assert 'egressd_subject_dropped_packets_total{subject="s-u-1"} 7' in text
    assert 'egressd_subject_dropped_packets_total{subject="s-u-2"} 0' in text
    assert 'egressd_subject_dropped_packets_total{subject="-"} 2' in text
    assert "s-gone" not in text
    kernel.fail = True
    text = await (await client.get("/metrics")).text()
    assert 'egressd_subject_dropped_packets_total{subject="s-u-1"} 7' in text  # last known value kept


async def test_subjects_carry_drops_and_recent_denials(aiohttp_client: Any) -> None:
    kernel = Kernel({"subj_s_u_1_dropped": 3, "unattributed_dropped": 9})
    ring = RecentDenials(clock=lambda: 0.0)
    client, control, vis = await _app(aiohttp_client, kernel, ring)
    assert (await control.handle(binding("u-1", "10.0.0.5"))).status == 200
    assert (await control.handle(binding("u-2", "10.0.0.6"))).status == 200
    vis.events.denied("u-1", "Evil.test.", "policy", "default")
    vis.events.denied("u-1", "x.test", "policy", "egress[1]")
    doc = await (await client.get("/v1/subjects")).json()
    assert doc["unattributedDroppedPackets"] == 9
    by_uid = {s["uid"]: s for s in doc["subjects"]}
    assert by_uid["u-1"]["droppedPackets"] == 3
    assert by_uid["u-1"]["recentDenials"] == [
        {"name": "evil.test", "rule": "default", "at": "1970-01-01T00:00:00Z"},
        {"name": "x.test", "rule": "egress[1]", "at": "1970-01-01T00:00:00Z"},
    ]
    assert by_uid["u-2"]["droppedPackets"] == 0  # counter not (yet) listed: nothing refused
    assert by_uid["u-2"]["recentDenials"] == []
    # A removed subject's ring goes with it.
    remove = parse_action(
        json.dumps(
            {
                "apiVersion": "sandbox.fast.io/actions/v1",
                "operation": "REMOVE_BINDING",
                "sandbox": {"uid": "u-1"},
                "revision": {"runtimeInstanceId": "r1", "attachmentId": "a1", "specGeneration": 1},
            }
        ).encode()
    )
    assert (await control.handle(remove)).status == 200
    assert ring.of("u-1") == []
    kernel.fail = True
    doc = await (await client.get("/v1/subjects")).json()
    assert doc["unattributedDroppedPackets"] is None
    assert [s["droppedPackets"] for s in doc["subjects"]] == [None]


async def test_drop_counters_without_a_ring() -> None:
    metrics = EgressMetrics()
    drops = DropCounters(metrics, Kernel({}).read, list)
    subjects: list[dict[str, Any]] = [{"uid": "u-9"}]
    assert await drops.annotate(subjects) == {"unattributedDroppedPackets": 0}
    assert subjects == [{"uid": "u-9", "droppedPackets": None, "recentDenials": []}]
