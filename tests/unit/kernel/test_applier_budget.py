"""Which batches the kernel shell applies on the event loop's thread (issue 28): light ones,
while the kernel's recent time says they stay within the budget; the loop must keep answering
DNS while a big table makes every set lookup a long walk."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from egressd.kernel import applier
from egressd.kernel.applier import INLINE_BUDGET_S, INLINE_MAX_WEIGHT, InlineBudget, KernelTransactions
from egressd.kernel.ops import FlushSet, NetlinkBatch


def test_a_light_batch_goes_inline_until_the_kernel_turns_slow() -> None:
    budget = InlineBudget()
    assert budget.allows(8) and not budget.allows(INLINE_MAX_WEIGHT + 1)
    for _ in range(10):  # a big table: 0.5 ms per unit of weight
        budget.observe(4, 0.002)
    assert not budget.allows(8), "8 x 0.5 ms is over the budget"
    assert budget.allows(1)
    for _ in range(30):  # the table shrank again
        budget.observe(4, 0.0002)
    assert budget.allows(8)
    assert budget.per_unit * 8 <= INLINE_BUDGET_S


@pytest.mark.parametrize(("slow", "inline"), [(False, True), (True, False)])
def test_run_batch_routes_by_the_budget(monkeypatch: pytest.MonkeyPatch, slow: bool, inline: bool) -> None:
    tx = KernelTransactions()
    ran: list[str] = []

    class Socket:
        def run(self, batch: NetlinkBatch) -> None:
            ran.append("inline")

        def close(self) -> None:
            pass

    def on_thread(batch: NetlinkBatch) -> None:
        ran.append("thread")

    tx._inline = Socket()  # type: ignore[assignment]
    monkeypatch.setattr(tx, "run_batch_sync", on_thread)
    if slow:
        tx.budget.observe(1, 0.01)
    batch = NetlinkBatch("T", (FlushSet("a"), FlushSet("b")))

    async def go() -> Any:
        await tx.run_batch(batch, op="static_apply")
        await tx.close()

    asyncio.run(go())
    assert ran == ["inline" if inline else "thread"]
    assert batch.weight() <= applier.INLINE_MAX_WEIGHT
