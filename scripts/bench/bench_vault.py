#!/usr/bin/env python3
"""Vault validation cost (docs/reference/behaviour.md §14.7): the old quadratic ambiguity check vs the new one.

Run from the repository root (no root needed, nothing leaves the process but one child
process per oracle timing)::

    .venv/bin/python scripts/bench/bench_vault.py --quick      # < 60 s
    .venv/bin/python scripts/bench/bench_vault.py              # oracle gets more time

Each shape is a JSON body of at most 1 MiB, validated the way a PUT is (``json.loads`` +
``parse_create`` + ``validate_candidate`` against a policy covering every host), once with
the new ambiguity check and once with the old quadratic one (kept in
``tests/unit/vault/test_vault_model.py`` as the tests' oracle) swapped in. The oracle runs in a
child process with a timeout (killed by PID when it runs over): a timed-out oracle is
reported as "> timeout", the ratio as a lower bound.

Shapes:

* ``caps/one-host``   256 bindings on one host, 64 distinct literal paths each: every pair
  shares the host, no path overlaps (the old check compares 32 640 pairs x 4096 paths);
* ``caps/many-hosts`` 256 bindings, 64 of 65 shared hosts each (a different one left out per
  binding, so no two host groups have the same members), 64 distinct paths each;
* ``caps/one-path``   256 bindings on one host and one path, each its own method;
* ``uncapped/one-host`` caps disabled in-process: as many bindings as fit in 1 MiB, one host,
  one distinct path each (the shape of the 14.7 report: 2000 bindings took 5.2 s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from egressd.policy import parse_policy_obj  # noqa: E402
from egressd.vault import ambiguity, validate  # noqa: E402
from egressd.vault.parse import parse_create  # noqa: E402
from egressd.vault.store import VaultStore  # noqa: E402
from egressd.vault.types import DEFAULT_LIMITS, VaultLimits  # noqa: E402

MIB = 1 << 20
UNLIMITED = VaultLimits(credentials=10**9, bindings=10**9, hosts_per_binding=10**9, paths_per_binding=10**9)


def _binding(
    name: str, hosts: list[str], paths: list[str], methods: list[str] | None = None
) -> dict[str, Any]:
    match: dict[str, Any] = {"hosts": hosts, "paths": paths}
    if methods is not None:
        match["methods"] = methods
    return {"name": name, "match": match, "auth": {"type": "bearer", "credential": "tok"}}


def _body(bindings: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "credentials": [{"name": "tok", "source": {"type": "inline", "value": "x" * 16}}],
        "bindings": bindings,
    }


def caps_one_host() -> dict[str, Any]:
    return _body(
        [_binding(f"b{i:03}", ["api.example.com"], [f"/b{i}/p{k}" for k in range(64)]) for i in range(256)]
    )


def caps_many_hosts() -> dict[str, Any]:
    hosts = [f"h{k}.example.com" for k in range(65)]
    return _body(
        [
            _binding(
                f"b{i:03}",
                [h for k, h in enumerate(hosts) if k != i % 65],
                [f"/b{i}/p{k}" for k in range(64)],
            )
            for i in range(256)
        ]
    )


def caps_one_path() -> dict[str, Any]:
    return _body([_binding(f"b{i:03}", ["api.example.com"], ["/v1/*"], [f"M{i}"]) for i in range(256)])


def uncapped_one_host() -> dict[str, Any]:
    bindings: list[dict[str, Any]] = []
    size = len(json.dumps(_body([])))
    while True:
        b = _binding(f"b{len(bindings):05}", ["api.example.com"], [f"/r{len(bindings)}/*"])
        size += len(json.dumps(b)) + 2
        if size > MIB:
            break
        bindings.append(b)
    return _body(bindings)


SHAPES: dict[str, tuple[Callable[[], dict[str, Any]], VaultLimits]] = {
    "caps/one-host": (caps_one_host, DEFAULT_LIMITS),
    "caps/many-hosts": (caps_many_hosts, DEFAULT_LIMITS),
    "caps/one-path": (caps_one_path, DEFAULT_LIMITS),
    "uncapped/one-host": (uncapped_one_host, UNLIMITED),
}


def _policy(doc: dict[str, Any]) -> Any:
    hosts = sorted({h for b in doc["bindings"] for h in b["match"]["hosts"]})
    return parse_policy_obj(
        {"defaultAction": "deny", "egress": [{"action": "allow", "target": h} for h in hosts]}
    )


def validate_once(raw: bytes, limits: VaultLimits, policy: Any) -> float:
    """One PUT's worth of work; the body must be accepted (a refusal would stop early)."""
    started = time.perf_counter()
    status, out = VaultStore(limits=limits).put(json.loads(raw), policy)
    elapsed = time.perf_counter() - started
    if status != 201:
        raise SystemExit(f"body refused ({status}): {out}")
    return elapsed


def use_oracle() -> None:
    from tests.unit.vault.test_vault_model import old_check_ambiguity

    validate.check_ambiguity = old_check_ambiguity  # type: ignore[assignment]


def time_new(shape: str, repeats: int) -> tuple[float, float, int]:
    """(median whole validation, median ambiguity check alone, body bytes)."""
    make, limits = SHAPES[shape]
    doc = make()
    raw = json.dumps(doc).encode()
    policy = _policy(doc)
    whole = statistics.median(validate_once(raw, limits, policy) for _ in range(repeats))
    bindings = parse_create(json.loads(raw), limits).bindings
    alone: list[float] = []
    for _ in range(repeats):
        started = time.perf_counter()
        ambiguity.check_ambiguity(bindings)
        alone.append(time.perf_counter() - started)
    return whole, statistics.median(alone), len(raw)


def time_oracle(shape: str, timeout: float) -> float | None:
    """In a child (killed by PID by subprocess.run on timeout): None when it ran over."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--oracle-child", shape]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=True)
    except subprocess.TimeoutExpired:
        return None
    return float(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="oracle timeout 8 s per shape (< 60 s in all)")
    parser.add_argument(
        "--oracle-timeout", type=float, default=None, help="seconds per oracle run (default 120)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="new-check repetitions per shape (median)")
    parser.add_argument("--oracle-child", metavar="SHAPE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.oracle_child:
        use_oracle()
        make, limits = SHAPES[args.oracle_child]
        doc = make()
        print(validate_once(json.dumps(doc).encode(), limits, _policy(doc)))
        return 0
    timeout = args.oracle_timeout or (8.0 if args.quick else 120.0)
    repeats = args.repeats or (3 if args.quick else 7)
    command = " ".join([".venv/bin/python", "scripts/bench/bench_vault.py", *sys.argv[1:]])
    print(f"reproduce (from the repository root): {command}")
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    print(
        f"python {sys.version.split()[0]}, load average {load}; whole PUT validation (json + parse + checks); "
        f"new: median of {repeats}; old: one run in a child, timeout {timeout:g} s"
    )
    print(
        f"{'shape':<20} {'body':>8} {'old (quadratic)':>16} {'new':>10} {'old / new':>10} {'new ambiguity alone':>20}"
    )
    for shape in SHAPES:
        new, alone, size = time_new(shape, repeats)
        old = time_oracle(shape, timeout)
        old_text = f"> {timeout:g} s" if old is None else f"{old:.3f} s"
        ratio = f"> {timeout / new:.0f}x" if old is None else f"{old / new:.1f}x"
        print(
            f"{shape:<20} {size / 1024:>6.0f}Ki {old_text:>16} {new * 1000:>7.1f} ms {ratio:>10} "
            f"{alone * 1000:>17.1f} ms",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
