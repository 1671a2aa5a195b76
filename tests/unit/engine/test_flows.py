"""The flow-cut loop both profiles share (egressd.engine.flows)."""

from __future__ import annotations

from structlog.testing import capture_logs

from egressd.engine.flows import cut_refused


async def test_refused_flows_are_cut_in_order_and_a_failure_does_not_stop_the_rest() -> None:
    deleted: list[str] = []

    async def delete(flow: str) -> None:
        if flow == "b":
            raise OSError("conntrack -D exited 2")
        deleted.append(flow)

    with capture_logs() as logs:
        cut = await cut_refused(
            ["a", "allowed", "b", "c"],
            lambda flow: flow == "allowed",
            delete,
            lambda flow: {"destination": flow},
        )
    assert deleted == ["a", "c"]
    assert cut == 2  # the failed one is not counted
    assert logs == [
        {
            "event": "conntrack.cut_failed",
            "log_level": "warning",
            "destination": "b",
            "error": "conntrack -D exited 2",
        }
    ]


async def test_nothing_refused_nothing_deleted() -> None:
    async def delete(flow: int) -> None:
        raise AssertionError("nothing may be deleted")

    assert await cut_refused(range(3), lambda flow: True, delete, lambda flow: {}) == 0
