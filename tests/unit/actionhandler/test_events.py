"""§12 log events of policy application, and the exact /healthz body."""

from __future__ import annotations

import json
from typing import Any

from structlog.testing import capture_logs

from egressd.actionhandler.control import ControlPlane
from egressd.actionhandler.envelope import parse_action
from egressd.fleet.server import FleetHTTP
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.metrics import EgressMetrics
from tests.unit.fakekernel import FakeTx

PLANTED = "planted-rule-7c1e.example.com"


def _action(op: str, **extra: Any) -> Any:
    doc: dict[str, Any] = {
        "apiVersion": "sandbox.fast.io/actions/v1",
        "operation": op,
        "sandbox": {"uid": "u"},
        "revision": {"runtimeInstanceId": "r", "attachmentId": "a"},
        **extra,
    }
    return parse_action(json.dumps(doc).encode())


POLICY = json.dumps({"defaultAction": "deny", "egress": [{"action": "allow", "target": PLANTED}]})
# Changes a static set: the same policy again would send no swap (nothing to refuse).
CHANGED = json.dumps(
    {
        "defaultAction": "deny",
        "egress": [{"action": "allow", "target": PLANTED}, {"action": "allow", "target": "203.0.113.7"}],
    }
)
NET = {"network": {"ip": "10.0.0.5", "gateway": "10.0.0.1", "hostVeth": "v"}}


async def test_egress_updated_and_update_failed_events() -> None:
    tx = FakeTx(yield_each_call=False)
    control = ControlPlane(FleetPlanKernel(TableConfig(), tx))
    await control.reset_table()
    with capture_logs() as logs:
        assert (
            await control.handle(_action("SET_BINDING", attachment=NET, binding={"input": POLICY}))
        ).status == 200
        hook = {"name": "sandbox.data-plane-ready"}
        assert (await control.handle(_action("LIFECYCLE_HOOK", hook=hook))).status == 200
        tx.fail(op="static_apply", kinds=("batch",), times=None)
        assert (
            await control.handle(_action("SET_BINDING", attachment=NET, binding={"input": CHANGED}))
        ).status == 500
    updated = [e for e in logs if e.get("opensandbox.event") == "egress.updated"]
    failed = [e for e in logs if e.get("opensandbox.event") == "egress.update_failed"]
    assert len(updated) == 1 and updated[0]["egress.default"] == "deny" and updated[0]["rules"] == 1
    assert len(failed) == 1 and failed[0]["error"]
    assert PLANTED not in repr(logs)


async def test_healthz_body_is_exactly_ok(aiohttp_client: Any) -> None:
    control = ControlPlane(FleetPlanKernel(TableConfig(), FakeTx(yield_each_call=False)))
    client = await aiohttp_client(FleetHTTP(control, EgressMetrics()).app())
    resp = await client.get("/healthz")
    assert resp.status == 503
    await control.reset_table()
    resp = await client.get("/healthz")
    assert (resp.status, await resp.text()) == (200, "ok")
