"""Network subjects spread over the MITM workers (EGRESSD_MITM_WORKERS) through the control
plane: each subject's addresses point at one worker port, kept across updates and re-keys, and
released at removal; the report names each subject's worker."""

from __future__ import annotations

from egressd.actionhandler.api import Result
from egressd.actionhandler.control import ControlPlane
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.subject.hostuid import UidPorts, UidRange
from tests.unit.actionhandler.test_control import POLICY_B, hook, remove, set_binding
from tests.unit.actionhandler.test_control_uid import uid_binding
from tests.unit.fakekernel import TextKernel, text_kernel

TABLE = "T"


async def make(workers: int = 2) -> tuple[ControlPlane, TextKernel]:
    kernel = text_kernel(TABLE)
    cfg = TableConfig(
        table=TABLE, mitm=True, mitm_workers=workers, uids=UidPorts(UidRange(100000, 165535), 16000, 4)
    )
    control = ControlPlane(FleetPlanKernel(cfg, kernel))
    await control.reset_table()
    return control, kernel


def ok(result: Result) -> None:
    assert result == Result(200), result


def workers_of(control: ControlPlane) -> dict[str, object]:
    return {row["uid"]: row["mitmWorker"] for row in control.report.describe()}


async def test_subjects_are_spread_and_keep_their_worker() -> None:
    control, kernel = await make()
    for n, uid in enumerate(("u-1", "u-2", "u-3"), 5):
        ok(await control.handle(set_binding(uid, ip=f"10.0.0.{n}")))
        ok(await control.handle(hook(uid)))
    assert kernel.elements("mitm_port_v4") == {"10.0.0.5": "18081", "10.0.0.6": "18082", "10.0.0.7": "18081"}
    assert workers_of(control) == {"u-1": 0, "u-2": 1, "u-3": 0}
    # An in-place update and a re-key keep the worker (the element never changes value).
    ok(await control.handle(set_binding("u-2", POLICY_B, ip="10.0.0.6", gen=2)))
    ok(await control.handle(set_binding("u-2", POLICY_B, ip="10.0.0.9", gen=3)))
    ok(await control.handle(hook("u-2")))
    assert kernel.elements("mitm_port_v4") == {"10.0.0.5": "18081", "10.0.0.9": "18082", "10.0.0.7": "18081"}
    assert workers_of(control)["u-2"] == 1
    # Removal deletes the element with the interception and frees the worker.
    ok(await control.handle(remove("u-2")))
    assert "10.0.0.9" not in kernel.elements("mitm_port_v4")
    assert "10.0.0.9" not in kernel.elements("mitm_src_v4")
    ok(await control.handle(set_binding("u-4", ip="10.0.0.8")))
    assert kernel.elements("mitm_port_v4")["10.0.0.8"] == "18082", "the least loaded worker"
    assert workers_of(control)["u-4"] == 1


async def test_every_intercepted_source_has_a_worker_port() -> None:
    control, kernel = await make(3)
    for n in range(5, 12):
        ok(await control.handle(set_binding(f"u-{n}", ip=f"10.0.0.{n}")))
    assert set(kernel.elements("mitm_src_v4")) == set(kernel.elements("mitm_port_v4"))
    assert sorted(kernel.elements("mitm_port_v4").values()) == ["18081"] * 3 + ["18082"] * 2 + ["18083"] * 2


async def test_a_host_uid_subject_reports_the_worker_of_its_port() -> None:
    control, _ = await make(2)
    ok(await control.handle(uid_binding()))
    [row] = control.report.describe()
    assert row["mitmPort"] == 16005 and row["mitmWorker"] == 0
