#!/usr/bin/env python3
"""Two egressd source trees side by side in one run: bench_fleet's (a)/(b) and (c) against a
baseline revision (A) and the working tree (B), their samples and blocks alternating, so a
change of the machine's load hits both alike (issue 28's before/after figures).

Run as root from the repository root::

    .venv/bin/python scripts/bench/fleet_ab.py --baseline 9e56bb7 [--quick] [--sizes 10,100,1000]

A's ``egressd/`` is ``git archive <baseline>`` unpacked in the run's temporary directory; A runs
egressd's ``main()`` from there (this script's ``_egressd_tree`` entry, which sets the venv's
editable-install finder aside so that the unpacked tree is imported); both use this venv. Two daemons in one namespace
``egba<pid>-ns``, each with its own table, ports and subjects. Per size: both grow to it, then
one sample of A, one of B, alternating (one sample = SET_BINDING of a new subject,
data-plane-ready, REMOVE_BINDING, then a no-op action). At the update size: rounds of
[A no-op, A sequential updates, B no-op, B sequential updates], then the same with 8 in flight.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def tree_main(tree: str) -> int:
    """egressd's ``main()`` imported from ``tree`` (not the venv's editable install of this
    tree): before anything here imports egressd."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
    sys.path.insert(0, tree)
    from egressd import main as emain

    if not str(Path(emain.__file__ or "").resolve()).startswith(str(Path(tree).resolve())):
        raise SystemExit(f"egressd imported from {emain.__file__}, not from {tree}")
    return int(emain.main([]))


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "_egressd_tree":
    sys.exit(tree_main(sys.argv[2]))

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_fleet as bf  # noqa: E402
import common as c  # noqa: E402

SIDES = ("A", "B")
PORTS = {"A": bf.PORT + 10, "B": bf.PORT + 11}


def baseline_tree(rev: str, workdir: Path) -> Path:
    """``egressd/`` of ``rev``, unpacked under ``workdir`` (read from the repository, not checked out)."""
    out = workdir / "baseline"
    out.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(c.ROOT), "archive", rev, "egressd"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise c.BenchError(f"git archive {rev}: {archive.stderr.decode(errors='replace')[:200]}")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def start(workdir: Path, side: str, tree: Path | None) -> tuple[c.Egressd, bf.FleetRun]:
    k = SIDES.index(side)
    env = {"EGRESSD_DNS_ADDR": f"127.0.0.1:{25310 + k}", "EGRESSD_UID_DNS_PORT_BASE": str(27000 + 100 * k),
           "EGRESSD_UID_MAX_SUBJECTS": "16"}  # fmt: skip
    d = c.Egressd(workdir, PORTS[side], f"egbench_ab_{side.lower()}", env)
    d.start([sys.executable, str(Path(__file__).resolve()), "_egressd_tree", str(tree)] if tree else None)
    return d, bf.FleetRun(c.Http(PORTS[side]), d.pid, PORTS[side])


def lifecycles(runs: dict[str, bf.FleetRun], size: int, samples: int, warmup: int) -> dict[str, Any]:
    for run in runs.values():
        run.lifecycle(size, 0, warmup, scoped_too=False)
    t: dict[str, dict[str, list[float]]] = {s: {} for s in SIDES}
    for j in range(samples):
        for side in SIDES if j % 2 == 0 else SIDES[::-1]:
            for k, v in runs[side].lifecycle(size, 1, 0, scoped_too=False).items():
                if k in ("set", "activate", "remove", "noop"):
                    t[side].setdefault(k, []).append(v["p50"])
    return {s: {k: c.summary(v) for k, v in by.items()} for s, by in t.items()}


def updates(runs: dict[str, bf.FleetRun], n_seq: int, n_conc: int, rounds: int) -> dict[str, Any]:
    out = {s: {k: bf.Side() for k in ("noop", "seq", "conc")} for s in SIDES}
    ratios: dict[str, dict[str, list[float]]] = {s: {"seq": [], "conc": []} for s in SIDES}
    owned = {
        s: [[i for i in range(r.registered) if i % bf.CONC == t] for t in range(bf.CONC)]
        for s, r in runs.items()
    }
    for r, (k, kc) in enumerate(zip(bf.split(n_seq, rounds), bf.split(n_conc, rounds), strict=True)):
        for mode in ("seq", "conc"):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                run, o = runs[side], out[side]
                noop = [c.envelope("REMOVE_BINDING", f"absent-ab{r}{mode}-{j}") for j in range(k)]
                base = o["noop"].sequential(run.pid, run.h, noop)
                if mode == "seq":
                    rate = o["seq"].sequential(
                        run.pid, run.h, [run.update_body((o["seq"].n + j) % run.registered) for j in range(k)]
                    )
                else:
                    per = [[run.update_body(mine[(r * kc + j) % len(mine)]) for j in range(max(1, kc // bf.CONC))]
                           for mine in owned[side]]  # fmt: skip
                    rate = o["conc"].concurrent(run.pid, per, run.port)
                ratios[side][mode].append(rate / base)
    return {s: {"noop_per_s": out[s]["noop"].per_s, "noop_cpu_ms": out[s]["noop"].cpu_ms,
                **{m: {**out[s][m].summary(), "ratio_median": statistics.median(ratios[s][m])} for m in ("seq", "conc")}}
            for s in SIDES}  # fmt: skip


def inner(args: argparse.Namespace, _topo: c.Topology, workdir: Path, rep: c.Report) -> dict[str, Any]:
    sizes = [10, 100] if args.quick else sorted({int(x) for x in args.sizes.split(",") if x.strip()})
    samples, n_seq, n_conc, rounds = (20, 240, 256, 8) if args.quick else (30, 500, 800, 10)
    tree = baseline_tree(args.baseline, workdir)
    daemons: list[c.Egressd] = []
    runs: dict[str, bf.FleetRun] = {}
    res: dict[str, Any] = {"life": {}, "updates": None}
    try:
        for side in SIDES:
            d, runs[side] = start(workdir, side, tree if side == "A" else None)
            daemons.append(d)
        upd_at = max([s for s in sizes if s <= bf.T_UPDATES_AT] or [min(sizes)])
        for size in sizes:
            for run in runs.values():
                run.grow(size)
            c.log(f"A and B: {size} subjects")
            res["life"][size] = lifecycles(runs, size, samples, 3)
            if size == upd_at:
                res["updates"] = updates(runs, n_seq, n_conc, rounds)
            for d in daemons:
                d.check_alive()
    except (OSError, http.client.HTTPException, c.BenchError) as exc:
        raise c.BenchError(f"{exc}\n--- A log ---\n{daemons[0].log_tail() if daemons else ''}") from None
    finally:
        for run in runs.values():
            run.h.close()
        for d in daemons:
            d.stop()
    report(rep, args.baseline, sizes, res)
    return res


def report(rep: c.Report, baseline: str, sizes: list[int], res: dict[str, Any]) -> None:
    rep.add(
        f"A = egressd/ of {baseline}, B = the working tree; the same venv, one namespace, samples alternating"
    )
    rep.add("")
    rep.add("(a)/(b) one NEW subject per sample, ms (p50 / p99); B / A of the p50")
    rows = []
    for size in sizes:
        life = res["life"][size]
        for op, label in (
            ("set", "SET_BINDING"),
            ("activate", "data-plane-ready"),
            ("remove", "REMOVE_BINDING"),
            ("noop", "no-op"),
        ):
            a, b = life["A"][op], life["B"][op]
            rows.append(
                [f"{size} {label}", a["p50"], a["p99"], b["p50"], b["p99"], c.ratio(b["p50"], a["p50"])]
            )
    rep.table(["subjects / action", "A p50", "A p99", "B p50", "B p99", "B/A p50"], rows)
    for side in SIDES:
        small, big = min(sizes), max(sizes)
        life = res["life"]
        rep.add(f"  {side}: SET_BINDING p99 at {big} {life[big][side]['set']['p99']:.2f} ms; REMOVE_BINDING p50 {big}/{small}"
                f" {life[big][side]['remove']['p50'] / life[small][side]['remove']['p50']:.2f}x")  # fmt: skip
    u = res["updates"]
    if u:
        rep.add("")
        rep.add(
            "(c) policy updates; rate vs each side's own no-op rate (all rounds; median of the rounds' ratios)"
        )
        rep.table(["side / mode", "per s", "vs no-op", "median of rounds", "p50 ms", "p99 ms", "egressd CPU ms", "CPU vs no-op"],
                  [[f"{s} {m}", u[s][m]["per_s"], c.ratio(u[s][m]["per_s"], u[s]["noop_per_s"]), u[s][m]["ratio_median"],
                    u[s][m]["lat"]["p50"], u[s][m]["lat"]["p99"], u[s][m]["cpu_ms"], c.ratio(u[s][m]["cpu_ms"], u[s]["noop_cpu_ms"])]
                   for s in SIDES for m in ("seq", "conc")])  # fmt: skip
        rep.add("  no-op actions/s: " + ", ".join(f"{s} {u[s]['noop_per_s']:.0f}" for s in SIDES))


def main() -> int:
    p = c.parser(__doc__, "sizes 10,100, 20 samples, 8 update rounds")
    p.add_argument("--baseline", required=True, help="the revision A runs (e.g. 9e56bb7)")
    p.add_argument("--sizes", default="10,100,1000", help="background subject counts (default 10,100,1000)")
    return c.main("fleet-ab", "egba", ["ns"], "ns", p.parse_args(), inner, tools=("ip", "nft", "git", "tar"))


if __name__ == "__main__":
    sys.exit(main())
