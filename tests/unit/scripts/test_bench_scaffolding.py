"""The benchmarks' shared scaffolding (scripts/bench/common.py) and bench_dns's instrumentation.

Pure functions only: no namespaces, no timing assertions. The instrumentation test is the
contract that broke when ``ControlPlane.learn`` changed its signature: every method the
"where the time goes" run wraps must still exist, and a wrapper passes any arguments through
and returns what the original returns.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[3] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

import bench_dns  # noqa: E402
import common  # noqa: E402


def test_pct_is_nearest_rank_and_counts_failures_as_slowest() -> None:
    values = [float(x) for x in range(1, 101)]
    assert common.pct(values, 50) == 50.0
    assert common.pct(values, 99) == 99.0
    assert common.pct([1.0] * 98 + [math.inf] * 2, 99) == math.inf
    assert math.isnan(common.pct([], 50))


def test_summary_and_ratio() -> None:
    s = common.summary([1.0, 2.0, math.inf])
    assert (s["n"], s["p50"], s["max"], s["mean"]) == (3, 2.0, math.inf, 1.5)
    assert common.ratio(3.0, 1.5) == "2.00x"
    assert common.ratio(math.inf, 1.0) == "-"
    assert common.ratio(1.0, 0.0) == "-"


def test_envelope_shapes() -> None:
    import json

    set_b = json.loads(common.envelope("SET_BINDING", "u1", ip="10.203.0.11", policy="{}"))
    assert set_b["attachment"]["network"] == {
        "ip": "10.203.0.11",
        "gateway": common.GATEWAY,
        "hostVeth": "vh-u1",
    }
    assert set_b["binding"] == {"input": "{}"}
    hook = json.loads(common.envelope("LIFECYCLE_HOOK", "u1", hook=True))
    assert hook["hook"]["name"] == "sandbox.data-plane-ready" and "attachment" not in hook


def test_report_prints_reproduce_command_targets_and_table() -> None:
    rep = common.Report("egressd x benchmark", ".venv/bin/python scripts/bench/bench_x.py --quick")
    rep.table(["side", "p50"], [["direct", 0.25], ["proxy", 1.5]])
    rep.target("added p50", False, "+1.250 ms", "<= +0.5 ms")
    text = rep.text()
    assert text.count("reproduce: .venv/bin/python scripts/bench/bench_x.py --quick") == 2
    assert "[MISSED] added p50: +1.250 ms" in text
    assert "direct  0.250" in text


def test_every_instrumented_target_exists_with_its_kind() -> None:
    per_query, events = bench_dns.wrap_targets()
    for owner, attr, _key in per_query + events:
        assert callable(getattr(owner, attr, None)), (
            f"{owner!r}.{attr} is gone: update bench_dns.wrap_targets"
        )
    learn = next(getattr(o, a) for o, a, k in per_query if k == "learn")
    assert inspect.iscoroutinefunction(learn)


@pytest.mark.parametrize("is_async", [True, False])
def test_wrap_passes_arguments_and_result_through(is_async: bool) -> None:
    calls: list[float] = []

    class Owner:
        if is_async:

            async def method(self, *a: Any, **kw: Any) -> Any:
                return [a, kw]
        else:

            def method(self, *a: Any, **kw: Any) -> Any:  # type: ignore[misc]  # the sync variant
                return [a, kw]

    bench_dns.wrap(Owner, "method", calls.append)
    got: Any = Owner().method(1, 2, name="x")
    if is_async:
        got = asyncio.run(got)
    assert got == [(1, 2), {"name": "x"}]
    assert len(calls) == 1
