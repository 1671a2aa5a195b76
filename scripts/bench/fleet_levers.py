#!/usr/bin/env python3
"""The fleet kernel levers of issue 16, side by side in one run: what a fresh subject's
transactions cost the kernel at N subjects, with and without each lever.

Re-executes itself under ``unshare --net`` (a private network namespace that dies with the
process, so nothing is left behind on any exit path), builds table ``egbench_levers`` with N
background subjects the way the daemon builds them, then times through egressd's netlink
socket, for a fresh subject each round: ``create`` (deny-first: sets, chains, fixed rules,
keys), ``fill`` (its first policy), ``update`` (an in-place change) and ``remove``. Variants:

* ``before``: 10 sets per subject (audit sets made with the subject), first policy flushed;
* ``six``: the audit sets and rules only with a first audit policy (6 sets per subject);
* ``noflush``: the first policy only adds to the empty deny-first sets;
* ``after``: both (egressd's path);
* ``handles``: ``after``, its removal deleting the sets by kernel handle (``NFTA_SET_HANDLE``,
  learned by a ``GETSET`` dump after creation, outside the timed transactions) instead of by
  name (nft_handles.py; probe only, the lever was rejected). Only with ``--variants``; a run
  that measures it makes every variant dump and remove the same way.

One table per variant (every background subject shaped like the variant), the variants'
rounds interleaved per size. Loopback-free: no packet is sent.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nft_handles import HandleSocket  # noqa: E402

from egressd.fleetnft import builder as nb  # noqa: E402
from egressd.kernel.netlink import NfTablesSocket  # noqa: E402
from egressd.kernel.ops import NetlinkBatch  # noqa: E402
from egressd.policy import NetworkPolicy, parse_policy  # noqa: E402

VARIANTS = ("before", "six", "noflush", "after", "handles")
PHASES = ("create", "fill", "update", "remove")
GATEWAY = ipaddress.ip_address("10.100.0.1")


def policy(k: int) -> NetworkPolicy:
    """4 IP/CIDR rules and a domain rule, as in bench_fleet.py."""
    return parse_policy(
        json.dumps(
            {
                "defaultAction": "deny",
                "egress": [
                    {"action": "allow", "target": f"203.0.113.{k % 250 + 1}"},
                    {"action": "allow", "target": f"198.51.{k % 250}.0/24"},
                    {"action": "deny", "target": f"192.0.2.{k % 250 + 1}"},
                    {"action": "allow", "target": f"2001:db8:{k % 9999:x}::/48"},
                    {"action": "allow", "target": "example.com"},
                ],
            }
        )
    )


class Variant:
    """The transactions of one variant for a subject."""

    def __init__(self, name: str, table: str) -> None:
        self.six = name in ("six", "after", "handles")
        self.noflush = name in ("noflush", "after", "handles")
        self.by_handle = name == "handles"
        self.removed: set[str] = set()  # the last removed subject's sets: gone by the next dump
        self.dump = False  # learn the set handles after creation (set when "handles" is measured)
        self.cfg = nb.TableConfig(table=table)

    def create(self, s: nb.SubjectNft) -> NetlinkBatch:
        audit = not self.six
        return (
            nb.subject_objects(self.cfg, s.nft_id, audit=audit)
            + nb.subject_rules(self.cfg, s.nft_id, audit=audit)
            + nb.subject_keys(self.cfg, s)
        )

    def swap(self, nid: str, p: NetworkPolicy, *, first: bool) -> NetlinkBatch:
        empty = first and self.noflush
        return nb.policy_swap(self.cfg.table, nid, p, audit_objects=not self.six, known_empty=empty)

    def remove(self, s: nb.SubjectNft) -> NetlinkBatch:
        return nb.removal_batch(self.cfg, s.nft_id, s.ip, release_gateway=None, audit=not self.six)


def subject(i: int, base: str) -> nb.SubjectNft:
    ip = ipaddress.ip_address(base) + i
    return nb.SubjectNft(f"s_{base.split('.')[1]}_{i}", ip, GATEWAY)


def build(sock: NfTablesSocket, v: Variant, size: int) -> None:
    header = nb.header_script(v.cfg, delete_existing=False)
    subprocess.run(["nft", "-f", "-"], input=header, text=True, check=True)
    for lo in range(0, size, 50):
        batch = NetlinkBatch(v.cfg.table)
        for i in range(lo, min(size, lo + 50)):
            s = subject(i, "10.64.0.0")
            batch = batch + v.create(s) + v.swap(s.nft_id, policy(i), first=True)
        sock.run(batch)


def timed(sock: NfTablesSocket, batch: NetlinkBatch) -> float:
    t0 = time.perf_counter()
    sock.run(batch)
    return (time.perf_counter() - t0) * 1000


def fill_update_remove(sock: NfTablesSocket, v: Variant, s: nb.SubjectNft, k: int) -> dict[str, float]:
    out = {"fill": timed(sock, v.swap(s.nft_id, policy(k), first=True))}
    out["update"] = timed(sock, v.swap(s.nft_id, policy(k + 1), first=False))
    out["remove"] = timed(sock, v.remove(s))
    time.sleep(0.005)  # the kernel's deferred release of the removed objects
    return out


def one_round(sock: NfTablesSocket, hsock: HandleSocket, v: Variant, k: int) -> dict[str, float]:
    s = subject(k, "10.128.0.0")
    out = {"create": timed(sock, v.create(s))}
    if not v.dump:
        out.update(fill_update_remove(sock, v, s, k))
        return out
    # Learned right after creation (where the daemon would take them from NEWSET's echo). With
    # ``handles`` in the run every variant dumps, so that only the DELSET encoding differs: the
    # dump's reply of 6N sets evicts the caches the next transactions would find warm.
    handles = hsock.set_handles(v.cfg.table)
    if v.removed & handles.keys():
        raise RuntimeError(
            f"{v.cfg.table}: sets survived their removal: {sorted(v.removed & handles.keys())}"
        )
    v.removed = {nb.Names(s.nft_id).set(kind) for kind in nb.subject_sets(audit=not v.six)}
    if not v.removed <= handles.keys():
        raise RuntimeError(f"{v.cfg.table}: the dump misses sets of {s.nft_id}")
    out["fill"] = timed(sock, v.swap(s.nft_id, policy(k), first=True))
    out["update"] = timed(sock, v.swap(s.nft_id, policy(k + 1), first=False))
    # Every variant's removal goes through the same re-encoding socket (an empty map changes
    # nothing), so the Python side is the same and the difference is the kernel's.
    t0 = time.perf_counter()
    hsock.run(v.remove(s), handles if v.by_handle else {})
    out["remove"] = (time.perf_counter() - t0) * 1000
    time.sleep(0.005)  # the kernel's deferred release of the removed objects
    return out


def measure(size: int, rounds: int, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    sock = NfTablesSocket(timeout=30)
    hsock = HandleSocket()
    variants = {name: Variant(name, f"egbench_levers_{name}") for name in names}
    for v in variants.values():
        v.dump = "handles" in names
    try:
        for v in variants.values():
            build(sock, v, size)
        samples: dict[str, dict[str, list[float]]] = {n: {p: [] for p in PHASES} for n in names}
        for k in range(rounds):
            r = k % len(names)
            for n in names[r:] + names[:r]:  # rotate the order: no variant always first
                for p, ms in one_round(sock, hsock, variants[n], k).items():
                    samples[n][p].append(ms)
        return {n: {p: statistics.median(x) for p, x in by.items()} for n, by in samples.items()}
    finally:
        sock.close()
        hsock.close()
        for v in variants.values():
            subprocess.run(["nft", "delete", "table", "inet", v.cfg.table], capture_output=True, check=False)


def report(results: dict[int, dict[str, dict[str, float]]], names: tuple[str, ...]) -> None:
    print(f"kernel time per transaction, p50 ms (ratio to {names[0]!r} of the same size)")
    print(f"{'N':>5} {'variant':8} " + " ".join(f"{p:>16}" for p in PHASES))
    for size, by in results.items():
        for n in names:
            cells = [f"{by[n][p]:7.3f} ({by[n][p] / by[names[0]][p]:4.2f}x)" for p in PHASES]
            print(f"{size:>5} {n:8} " + " ".join(f"{c:>16}" for c in cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--sizes", default="10,1000")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument(
        "--variants",
        default="before,six,noflush,after",
        help=f"comma-separated, of {','.join(VARIANTS)}; ratios are to the first",
    )
    ap.add_argument("--quick", action="store_true", help="sizes 10,100, 10 rounds")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.rounds = "10,100", 10
    if not args.inside:
        unshare = shutil.which("unshare")
        if unshare is None or os.geteuid() != 0:
            print("needs root and unshare(1)", file=sys.stderr)
            return 2
        argv = [unshare, "--net", "--", sys.executable, __file__, "--inside", *sys.argv[1:]]
        return subprocess.run(argv, check=False, timeout=1800).returncode
    sizes = [int(x) for x in args.sizes.split(",")]
    names = tuple(args.variants.split(","))
    if not names or any(n not in VARIANTS for n in names):
        print(f"--variants: choose from {','.join(VARIANTS)}", file=sys.stderr)
        return 2
    results = {size: measure(size, args.rounds, names) for size in sizes}
    report(results, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
