#!/usr/bin/env python3
"""Request rules' per-request decision cost in the MITM child (docs/reference/behaviour.md §19).

What a request on a judged connection costs the child beyond today's path: the view of the
subject's policy for the name is held under the narrowing stamp (a dict lookup), then
:meth:`egressd.mitmchild.reqview.RuleView.judge` decides it. Measured in-process, same run,
with 1, 100 and 4096 request rules on one host against no rules (a name no request rule
matches: the view says "not judged"), each request a distinct path (the per-view memo never
hits), the request matching no rule (every rule is tried: the worst case). Printed as JSON:
microseconds per request and the ratio to no rules, and the goal (4096 rules add < 0.2 ms).

    .venv/bin/python scripts/bench/request_rules.py [--quick]
    .venv/bin/python scripts/bench/bench_mitm.py --request-rules [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from egressd.mitm.requests import view_of
from egressd.mitmchild.reqview import RuleView, parse_view, request_target
from egressd.policy.model import parse_policy_obj

HOST = "api.x.io"
SIZES = (1, 100, 4096)
GOAL_ADDED_MS = 0.2


def policy_with(n: int) -> dict[str, Any]:
    rules: list[dict[str, Any]] = [
        {"action": "allow", "target": HOST, "methods": ["GET", "POST"], "paths": [f"/r{i}/*", f"/x{i}"]}
        for i in range(n)
    ]
    rules.append({"action": "allow", "target": "other.io"})
    return {"defaultAction": "deny", "egress": rules}


def the_view(n: int) -> RuleView:
    """As the child holds it: egressd's reply for the name, parsed once (then kept under the stamp)."""
    policy = parse_policy_obj(policy_with(n))
    name = HOST if n else "other.io"
    view = parse_view(json.dumps(view_of("bench", policy, name)).encode())
    assert view is not None
    return view


def per_request_us(view: RuleView, n_requests: int) -> float:
    views = {("10.0.0.2", HOST): (view, (1, 1))}
    stamp = (1, 1)
    started = time.perf_counter()
    for i in range(n_requests):
        held = views.get(("10.0.0.2", HOST))  # the cached view under its stamp (RequestGate.view)
        assert held is not None and held[1] == stamp
        v = held[0]
        if v.judged:
            v.judge(443, "DELETE", request_target(f"/nowhere/{i}?q=1"))
    return (time.perf_counter() - started) / n_requests * 1e6


def refresh_ms(n: int) -> dict[str, float]:
    """Once per policy change (the stamp moved) per client and name, not per request: egressd
    builds the view, the child parses it and indexes it at its first request (socket excluded)."""
    policy = parse_policy_obj(policy_with(n))
    t0 = time.perf_counter()
    body = json.dumps(view_of("bench", policy, HOST)).encode()
    t1 = time.perf_counter()
    view = parse_view(body)
    t2 = time.perf_counter()
    assert view is not None
    view.judge(443, "DELETE", "/nowhere")
    t3 = time.perf_counter()
    return {
        "egressd_view_ms": round((t1 - t0) * 1000, 2),
        "child_parse_ms": round((t2 - t1) * 1000, 2),
        "child_index_ms": round((t3 - t2) * 1000, 2),
    }


def measure(quick: bool) -> dict[str, Any]:
    n_requests = 300 if quick else 3000
    views = {n: the_view(n) for n in (0, *SIZES)}
    rounds = 3 if quick else 7
    best: dict[int, float] = {}
    for _ in range(rounds):  # interleaved rounds, best of each: the same noise for every size
        for n, view in views.items():
            view._memo.clear()
            us = per_request_us(view, n_requests)
            best[n] = min(best.get(n, us), us)
    base = best[0]
    out: dict[str, Any] = {"requests_per_size": n_requests, "rounds": rounds, "no_rules_us": round(base, 3)}
    for n in SIZES:
        out[f"rules_{n}"] = {
            "us_per_request": round(best[n], 2),
            "added_ms": round((best[n] - base) / 1000, 4),
            "ratio_to_no_rules": round(best[n] / base, 1),
        }
    out["after_a_policy_change_ms"] = refresh_ms(SIZES[-1])
    out["goal_4096_added_ms"] = GOAL_ADDED_MS
    out["goal_met"] = out[f"rules_{SIZES[-1]}"]["added_ms"] < GOAL_ADDED_MS
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    print(json.dumps(measure(args.quick), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
