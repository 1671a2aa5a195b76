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


# ---- bench_mitm: configurations, schedule and the issue-16 verdicts ---------------------------

import argparse  # noqa: E402

import bench_mitm as bm  # noqa: E402


def test_env_spec_parses_pairs_and_the_default_environment() -> None:
    assert bm.parse_env_spec("EGRESSD_MITM_WORKERS=1, EGRESSD_MITM_TLS_RESUME=off") == {
        "EGRESSD_MITM_WORKERS": "1",
        "EGRESSD_MITM_TLS_RESUME": "off",
    }
    assert bm.parse_env_spec("") == {}
    assert bm.parse_env_spec("A=") == {"A": ""}
    assert bm.parse_env_spec("A=x=y") == {"A": "x=y"}


@pytest.mark.parametrize("spec", ["WORKERS", "lower=1", "=1", "A=1,A=2", "A B=1"])
def test_env_spec_rejects_what_is_not_env_assignments(spec: str) -> None:
    with pytest.raises(ValueError):
        bm.parse_env_spec(spec)
    with pytest.raises(argparse.ArgumentTypeError):
        bm._env_arg(spec)


def test_configurations_default_one_worker_against_the_default() -> None:
    assert [c.env for c in bm.configurations([], None)] == [{bm.WORKERS_ENV: "1"}, {}]
    assert [c.env for c in bm.configurations([], 2)] == [{bm.WORKERS_ENV: "1"}, {bm.WORKERS_ENV: "2"}]
    labels = [c.label for c in bm.configurations([], None)]
    assert labels == ["A: EGRESSD_MITM_WORKERS=1", "B: defaults"]


def test_configurations_compare_one_is_an_ab_against_the_defaults() -> None:
    got = bm.configurations([{"EGRESSD_MITM_TLS_RESUME": "off"}], 2)
    assert [c.env for c in got] == [
        {bm.WORKERS_ENV: "2"},
        {bm.WORKERS_ENV: "2", "EGRESSD_MITM_TLS_RESUME": "off"},
    ]


def test_configurations_compare_several_are_taken_as_given() -> None:
    same = {bm.WORKERS_ENV: "1"}
    got = bm.configurations([same, same], 4)  # --workers does not override an explicit setting
    assert [c.env for c in got] == [same, same]
    assert [c.label[:2] for c in got] == ["A:", "B:"]
    with pytest.raises(ValueError):
        bm.configurations([{}] * (len(bm.PREFIXES) + 1), None)


@pytest.mark.parametrize(
    ("raw", "want"), [(None, 2), ("1", 1), ("3", 3), ("40", 16), ("0", 1), ("x", 2), (" 4 ", 4)]
)
def test_expected_workers_follows_the_spec(raw: str | None, want: int) -> None:
    env = {} if raw is None else {bm.WORKERS_ENV: raw}
    assert bm.expected_workers(env, 2) == want


def test_split_and_the_interleaved_batch_order() -> None:
    assert bm.split(10, 4) == [3, 3, 2, 2]
    assert sum(bm.split(801, 4)) == 801
    order = bm.batch_order(2, ["direct", "mitm"], 3)
    assert order[:4] == [(0, 0, "direct"), (0, 0, "mitm"), (0, 1, "direct"), (0, 1, "mitm")]
    assert order[4:8] == [(1, 1, "mitm"), (1, 1, "direct"), (1, 0, "mitm"), (1, 0, "direct")]
    for r in range(3):  # every (configuration, path) once per round
        assert sorted(x[1:] for x in order if x[0] == r) == sorted(x[1:] for x in order[:4])


def test_merge_adds_up_clients_that_ran_at_once() -> None:
    a = {
        "lat_ms": [1.0],
        "conn_ms": [0.5],
        "errors": {"status 503": 1},
        "attempted": 2,
        "wall_s": 1.0,
        "sample": {},
    }
    b = {"lat_ms": [2.0], "errors": {"status 503": 2}, "attempted": 3, "wall_s": 1.5, "sample": {"port": 443}}
    m = bm.merge([a, b])
    assert m["lat_ms"] == [1.0, 2.0] and m["conn_ms"] == [0.5]
    assert m["errors"] == {"status 503": 3} and m["attempted"] == 5
    assert m["wall_s"] == 1.5 and m["sample"] == {"port": 443}


def test_workers_verdict_needs_half_of_a_positive_finite_reference() -> None:
    assert bm.workers_met(100.0, 50.0) and not bm.workers_met(100.0, 50.1)
    assert not bm.workers_met(0.0, -1.0)  # nothing to halve
    assert not bm.workers_met(math.inf, 1.0) and not bm.workers_met(100.0, math.inf)
    assert not bm.workers_met(math.nan, 1.0)


def test_connection_verdict_is_twice_the_direct_connection_time() -> None:
    assert bm.conn_met(4.0, 2.0) and not bm.conn_met(4.01, 2.0)
    assert not bm.conn_met(math.inf, 2.0) and not bm.conn_met(1.0, math.nan)


def test_workers_pairs_go_by_the_children_found() -> None:
    assert bm.workers_pairs([1, 2]) == [(0, 1)]
    assert bm.workers_pairs([2, 1, 4]) == [(1, 0), (1, 2)]
    assert bm.workers_pairs([1, 1]) == []  # main ignores the variable: nothing to judge


def _args(**kw: Any) -> argparse.Namespace:
    base = {"conc": 16, "subjects": 4, "n_seq": 8, "n_conc": 16, "keepalive": True, "batches": 2}
    return argparse.Namespace(**{**base, **kw})


def test_phases_keep_the_old_ones_and_add_the_spread_ones() -> None:
    got = bm.phases(_args())
    assert [p.label for p in got] == [
        "new conn, sequential",
        "new conn, 16 in flight",
        "new conn, 16 in flight over 4 sandboxes",
        "keep-alive, sequential",
        "keep-alive, 16 in flight",
        "keep-alive, 16 in flight over 4 sandboxes",
    ]
    assert [p.multi for p in got] == [False, False, True] * 2
    assert len(bm.phases(_args(keepalive=False))) == 3
    assert bm.multi_sandboxes(4) == (1, 3, 4, 5)
    assert bm.roles(2, 4)[:3] == ["apod", "aup", "asb1"] and "bsb5" in bm.roles(2, 4)


def _stats(p50: float, conn: float = 1.0) -> dict[str, Any]:
    return {"lat": [p50] * 9, "conn": [conn] * 9, "errors": {}, "wall": 1.0, "lookup": [0.5], "decide": [],
            "cpu": {"egressd": 0.001, "mitm1": 0.01, "mitm2": 0.01, "upstream": 0.001, "clients": 0.002}}  # fmt: skip


def _out(children: list[int], inject_added: list[float]) -> dict[str, Any]:
    paths = ["direct", "mitm+inject", "mitm decrypt, no match", "mitm passthrough"]
    phases_: dict[str, Any] = {}
    for ph in bm.phases(_args()):
        names = paths[:2] if ph.multi else paths
        phases_[ph.label] = [
            {"paths": {n: _stats(2.0 + {"direct": 0.0, "mitm+inject": a}.get(n, 1.0)) for n in names},
             "rss_kb": {"egressd": 1024, "mitm1": 2048}}
            for a in inject_added
        ]  # fmt: skip
    rss = [{"egressd": 1024, "mitm1": 2048}] * len(children)
    return {"configs": [{"label": f"{'AB'[i]}: x", "env": {}, "mitm_children": n, "expected_workers": n,
                         "workers_of": {1: 0, 3: n - 1}}
                        for i, n in enumerate(children)],
            "phases": phases_, "rss_before_kb": rss, "hwm_kb": rss, "refused": [0, 0], "mitm_errors": [0, 0]}  # fmt: skip


def test_report_judges_both_issue_16_targets() -> None:
    rep = common.Report("egressd mitm benchmark", "cmd")
    bm.report(rep, _args(), _out([1, 2], [10.0, 4.0]))
    text = rep.text()
    assert (
        "[MET   ] issue 16 workers, new conn, 16 in flight over 4 sandboxes, mitm+inject: B (2 workers) vs A"
        in text
    )
    # direct connection time 1.0 ms: 10 ms added misses 2x, 4 ms added misses too, 2 ms would meet
    assert "[MISSED] issue 16 connection, A, new conn, sequential, mitm+inject" in text
    assert "added p50 (mitm new-conn) <= 2 x direct connection time" in text
    assert "0.40x" in text  # B's added p50 over A's, side by side
    assert "sb1 0, sb3 1" in text  # where egressd put the spread sandboxes


def test_report_does_not_judge_workers_without_a_multi_worker_side() -> None:
    rep = common.Report("egressd mitm benchmark", "cmd")
    bm.report(rep, _args(), _out([1, 1], [2.0, 2.0]))
    text = rep.text()
    assert "[n/a   ] issue 16 workers" in text and "[MET   ] issue 16 workers" not in text
    assert "[MET   ] issue 16 connection, B" in text


# ---- bench_mitm's response-path part (issue 23, scripts/bench/mitm_stream.py) -----------------

import mitm_stream as ms  # noqa: E402


def _stream_out(decrypted_ttfb: float, decrypted_mib_s: float, growth: float, off: bool = True) -> dict[str, Any]:
    ttfb = {"direct": [1.0] * 5, "relayed": [1.5] * 5, "decrypted": [decrypted_ttfb] * 5}
    tput = {"direct": [200.0, 220.0, 210.0], "relayed": [190.0] * 3, "decrypted": [decrypted_mib_s] * 3}
    if off:
        ttfb["decrypted, redaction off"] = [decrypted_ttfb] * 5
        tput["decrypted, redaction off"] = [decrypted_mib_s + 5] * 3
    return {
        "sizes": {"bulk": 1024, "upload": 256, "throughput": 256, "rounds": 3, "sse": 5},
        "ttfb": {k: {"ttfb": v, "delay": [0.5] * 5} for k, v in ttfb.items()},
        "throughput": tput,
        "memory": [{"what": "1024 MiB response, chunked", "growth_mib": growth, "before_mib": 90.0, "mib_s": 80.0}],
    }


def test_stream_targets_are_judged_side_by_side() -> None:
    rep = common.Report("egressd mitm benchmark", "cmd")
    bm.report(rep, _args(), {"configs": [], "phases": {}, "stream": _stream_out(3.0, 120.0, 1.5)})
    text = rep.text()
    assert "[MET   ] issue 23 SSE time to first byte: decrypted within 2 ms of relayed" in text  # +1.5 ms
    assert "[MET   ] issue 23 throughput: decrypted at least half of direct: 120 vs 210 MiB/s" in text
    assert "[MET   ] issue 23 memory: 1024 MiB response, chunked: MITM +1.5 MiB" in text
    assert "latency, ms" not in text  # --stream-only: no latency tables
    rep = common.Report("egressd mitm benchmark", "cmd")
    bm.report(rep, _args(), {"configs": [], "phases": {}, "stream": _stream_out(4.0, 90.0, 80.0, off=False)})
    text = rep.text()
    assert "[MISSED] issue 23 SSE time to first byte" in text and "[MISSED] issue 23 throughput: decrypted at" in text
    assert "[MISSED] issue 23 memory" in text and "[n/a   ] issue 23 throughput: decrypted, redaction off" in text


def test_stream_helpers() -> None:
    assert ms.interleaved(["a", "b", "c"], 3) == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert ms.ttfb_met(3.4, 1.5) and not ms.ttfb_met(3.6, 1.5) and not ms.ttfb_met(math.inf, 1.5)
    assert ms.throughput_met(100.0, 200.0) and not ms.throughput_met(99.0, 200.0) and not ms.throughput_met(1.0, 0.0)
    quick = argparse.Namespace(quick=True, bulk_mib=1024, upload_mib=256, throughput_mib=256, throughput_rounds=3, sse_rounds=40)
    assert ms.sizes(quick) == {"bulk": 48, "upload": 16, "throughput": 24, "rounds": 2, "sse": 8}
    quick.quick = False
    assert ms.sizes(quick)["bulk"] == 1024


def test_in_netns_without_a_namespace_is_a_no_op() -> None:
    with common.in_netns(None):
        pass


def test_cmdline_reads_a_process_and_tolerates_a_gone_one() -> None:
    import os

    assert "python" in bm.cmdline(os.getpid()).lower()
    assert bm.cmdline(2**22 + 1) == ""  # above the kernel's pid_max: never a process


# ---- bench_fleet: (e)'s instrumented daemon and the CI guards ------------------------------------

import fleet_instrument  # noqa: E402


def test_every_fleet_split_target_exists() -> None:
    keys = {k for k, _ in fleet_instrument.STEPS + fleet_instrument.BACKGROUND}
    for owner, attr, key in fleet_instrument.targets():
        assert callable(getattr(owner, attr, None)), (
            f"{owner!r}.{attr} is gone: update fleet_instrument.targets"
        )
        assert key in keys


def test_fleet_splits_are_exclusive_and_background_is_per_window() -> None:
    rec = {"t": 1.0, "op": "SetBinding", "handler": 0.010, "~handler": 0.006, "kernel": 0.004,
           "~kernel": 0.003, "kernel_thread": 0.003, "input": 0.002}  # fmt: skip
    data = {
        "records": [rec, {**rec, "t": 9.0}],
        "background": [("conntrack", 1.5, 0.004), ("ct_read", 1.5, 0.003)],
    }
    got = fleet_instrument.analyse(data, (0.0, 2.0), "SetBinding")
    assert got["n"] == 1
    assert got["handler"] == pytest.approx(4.0) and got["kernel"] == pytest.approx(1.0)
    assert got["ct_read"] == pytest.approx(3.0) and got["conntrack"] == pytest.approx(1.0)


def test_slowdown_spec() -> None:
    assert fleet_instrument.parse_slowdown("update=2, create=1.5") == {"update": 2.0, "create": 1.5}
    for bad in ("update", "upd=2", "update=0.5", "update=2,update=3"):
        with pytest.raises(ValueError):
            fleet_instrument.parse_slowdown(bad)


def test_profile_summary_counts_a_stack_for_its_deepest_step() -> None:
    folded = "\n".join([
        "main (egressd/main.py:1);after_write (egressd/web/writes.py:9);parse_action (egressd/actionhandler/envelope.py:3) 5",
        "main (egressd/main.py:1);_apply_policy (x);NfTablesSocket.run (egressd/kernel/netlink.py:7) 3",
        "main (egressd/main.py:1);metrics_handler (egressd/fleet/server.py:2);render (egressd/metrics.py:4) 2",
        "main (egressd/main.py:1);select (selectors.py:1) 1",
    ])  # fmt: skip
    total, per = fleet_instrument.profile_summary(folded)
    assert total == 11
    assert per["envelope parse"] == 5
    assert per["kernel transaction (encoding, send, acks)"] == 3
    assert per["GET /metrics (the bench's scrapes between blocks, untimed)"] == 2
    assert per[fleet_instrument.OTHER] == 1
