"""No request can crash the daemon or leave a subject half-registered (bounded random mutations)."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

from aiohttp.test_utils import TestClient

from egressd.actionhandler.control import ControlPlane
from egressd.fleet.server import FleetHTTP
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.metrics import EgressMetrics
from tests.unit.fakekernel import FakeTx

BASE: dict[str, Any] = {
    "apiVersion": "sandbox.fast.io/actions/v1",
    "operation": "SET_BINDING",
    "sandbox": {"uid": "u-1"},
    "revision": {"specGeneration": 1, "runtimeInstanceId": "r1", "attachmentId": "a1"},
    "attachment": {"network": {"ip": "10.0.0.5", "gateway": "10.0.0.1", "hostVeth": "v"}},
    "binding": {"input": '{"defaultAction":"deny","egress":[{"action":"allow","target":"8.8.8.8"}]}'},
    "hook": {"name": "sandbox.data-plane-ready"},
}
VALUES: list[Any] = [
    None,
    "",
    "x",
    0,
    -1,
    2**64,
    1.5,
    True,
    [],
    {},
    "10.0.0.6",
    "::1",
    "SET_BINDING",
    "LIFECYCLE_HOOK",
    "REMOVE_BINDING",
    "sandbox.data-plane-ready",
    "\u0000",
    "a/b",
    "{}",
    "null",
]


def _mutate(rng: random.Random, env: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(env)
    for _ in range(rng.randint(1, 3)):
        node: Any = out
        path: list[str] = []
        while isinstance(node, dict) and node and rng.random() < 0.7:
            key = rng.choice(sorted(node))
            path.append(key)
            if not isinstance(node[key], dict):
                break
            node = node[key]
        if not path:
            continue
        parent: Any = out
        for k in path[:-1]:
            parent = parent[k]
        if rng.random() < 0.3:
            parent.pop(path[-1], None)
        else:
            parent[path[-1]] = rng.choice(VALUES)
    return out


async def test_random_envelopes_never_crash(aiohttp_client: Any) -> None:
    rng = random.Random(20261130)
    tx = FakeTx(yield_each_call=False)
    tx.fail_randomly(rng, 0.2)  # roughly every fifth script or batch
    control = ControlPlane(FleetPlanKernel(TableConfig(), tx))
    await control.reset_table()
    client: TestClient[Any, Any] = await aiohttp_client(FleetHTTP(control, EgressMetrics()).app())
    seen: set[int] = set()
    for _ in range(600):
        env = _mutate(rng, BASE)
        env["operation"] = rng.choice(
            ["SET_BINDING", "LIFECYCLE_HOOK", "REMOVE_BINDING", env.get("operation")]
        )
        resp = await client.post("/_fastlet/v1/actions", data=json.dumps(env))
        text = await resp.text()
        assert resp.status in (200, 400, 409, 500), (resp.status, text)
        assert "Traceback" not in text and text.count("\n") <= 1
        if resp.status == 500:
            assert "internal error" not in text  # only planned kernel failures, never a crash
        seen.add(resp.status)
        # Registry invariant: an active subject always has a committed policy and no pending one.
        for entry in control.registry:
            if entry.state.value == "active":
                assert entry.policy is not None and entry.pending is None
                view = control.registry.kernel(entry.uid)
                assert view.objects, "active without kernel objects"
                assert view.rules, "active without the subject's rules"
    assert {200, 400}.issubset(seen)
    assert (await client.get("/healthz")).status == 200
