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
* ``shared`` (issue 28's design note, docs/concepts/ruleset.md, "Design note: shared sets"): no set per subject; six
  table-wide sets keyed by ``source address . destination`` that the subject's rules look up
  (nft_shared.py; probe only). Its policy and leases are elements under its address: an update
  deletes the elements that leave and adds those that come, a removal deletes them all.
* ``sharded``: ``shared`` over 64 groups of six shared sets (a subject's sets are its group's).

``after`` and ``shared`` update in place as egressd does since issue 28: only what changes.

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

import nft_shared as sh  # noqa: E402
from nft_handles import HandleSocket  # noqa: E402

from egressd.fleetnft.contents import policy_contents, policy_swap, static_contents  # noqa: E402
from egressd.fleetnft.header import header_script  # noqa: E402
from egressd.fleetnft.subject import (  # noqa: E402
    dispatch_deletes,
    removal_batch,
    subject_keys,
    subject_objects,
    subject_rules,
    subject_sets,
)
from egressd.fleetnft.table import AUDIT_COUNTERS, DENIED_CHAIN, Names, SubjectNft, TableConfig  # noqa: E402
from egressd.kernel.netlink import NfTablesSocket  # noqa: E402
from egressd.kernel.ops import AddChain, AddCounter, DeleteChain, DeleteCounter, NetlinkBatch, Op  # noqa: E402
from egressd.nftsyntax import family  # noqa: E402
from egressd.policy import NetworkPolicy, parse_policy  # noqa: E402

VARIANTS = ("before", "six", "noflush", "after", "handles", "shared", "sharded")
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
        self.cfg = TableConfig(table=table)

    def create(self, s: SubjectNft) -> NetlinkBatch:
        audit = not self.six
        return (
            subject_objects(self.cfg, s.nft_id, audit=audit)
            + subject_rules(self.cfg, s.nft_id, audit=audit)
            + subject_keys(self.cfg, s)
        )

    def swap(
        self, s: SubjectNft, p: NetworkPolicy, *, first: bool, held: NetworkPolicy | None = None
    ) -> NetlinkBatch:
        empty = first and self.noflush
        was = static_contents(held) if held is not None and self.six and self.noflush else None
        return policy_swap(
            self.cfg.table, s.nft_id, p, audit_objects=not self.six, known_empty=empty, held=was
        )

    def remove(self, s: SubjectNft) -> NetlinkBatch:
        return removal_batch(self.cfg, s.nft_id, s.ip, release_gateway=None, audit=not self.six, ranges=False)


class SharedVariant:
    """``shared``: the subject's chains, rules, counters and keys, its sets shared (nft_shared.py);
    ``sharded``: the same over ``shards`` groups of six shared sets, a subject's in one group."""

    def __init__(self, table: str, shards: int = 1) -> None:
        self.cfg = TableConfig(table=table)
        self.shards = shards
        self.held: dict[str, dict[str, tuple[sh.Net, ...]]] = {}
        self.dump = False

    def create(self, s: SubjectNft) -> sh.Raw:
        n = Names(s.nft_id)
        fam = family(s.ip)
        ops: list[Op] = [AddChain(n.chain), AddChain(n.mark_chain)]
        ops += [AddCounter(n.counter(kind)) for kind in AUDIT_COUNTERS] + [AddCounter(n.dropped_counter)]
        g = self.shard(s)
        rules = [sh.rule(self.cfg.table, n.chain, [*sh.concat_lookup(fam, sh.set_name("deny", fam, g)),
                                                  _goto_denied()])]  # fmt: skip
        rules += [sh.rule(self.cfg.table, n.mark_chain, [*sh.concat_lookup(fam, sh.set_name(kind, fam, g)), *_set_mark()])
                  for kind in ("allow", "dyn")]  # fmt: skip
        batch = NetlinkBatch(self.cfg.table, tuple(ops)) + subject_keys(self.cfg, s)
        return sh.Raw(self.cfg.table, batch, after=rules)

    def swap(
        self, s: SubjectNft, p: NetworkPolicy, *, first: bool, held: NetworkPolicy | None = None
    ) -> sh.Raw:
        del first, held  # the elements it holds are known: it adds and deletes exactly those
        fam = family(s.ip)
        new = {kind: policy_contents(p)[f"{kind}_{fam}"] for kind in ("allow", "deny")}
        old = self.held.get(s.nft_id, {"allow": (), "deny": ()})
        msgs: list[sh.Msg] = []
        for kind in ("allow", "deny"):
            gone = tuple(x for x in old[kind] if x not in new[kind])
            came = tuple(x for x in new[kind] if x not in old[kind])
            msgs += (
                sh.ranges(self.cfg.table, s.ip, kind, gone, delete=True, shard=self.shard(s)) if gone else []
            )
            msgs += sh.ranges(self.cfg.table, s.ip, kind, came, shard=self.shard(s)) if came else []
        self.held[s.nft_id] = new
        return sh.Raw(self.cfg.table, msgs=msgs)

    def shard(self, s: SubjectNft) -> int:
        return sh.shard_of(s.nft_id, self.shards)

    def remove(self, s: SubjectNft) -> sh.Raw:
        old = self.held.pop(s.nft_id, {"allow": (), "deny": ()})
        msgs = [
            m
            for kind in ("allow", "deny")
            if old[kind]
            for m in sh.ranges(self.cfg.table, s.ip, kind, old[kind], delete=True, shard=self.shard(s))
        ]
        n = Names(s.nft_id)
        ops = dispatch_deletes(self.cfg, s.ip, release_gateway=None)
        ops += [DeleteChain(n.chain), DeleteChain(n.mark_chain)]
        ops += [DeleteCounter(n.counter(kind)) for kind in AUDIT_COUNTERS] + [
            DeleteCounter(n.dropped_counter)
        ]
        return sh.Raw(self.cfg.table, NetlinkBatch(self.cfg.table, tuple(ops)), msgs=msgs)


def _goto_denied() -> bytes:
    from egressd.kernel.netlink_rules import rule_expressions
    from egressd.kernel.ops import RuleAction, VerdictRule

    return rule_expressions(VerdictRule(RuleAction.DROP, drop_chain=DENIED_CHAIN))


def _set_mark() -> list[bytes]:
    from egressd.kernel import netlink_rules

    return netlink_rules._set_mark()


def subject(i: int, base: str) -> SubjectNft:
    ip = ipaddress.ip_address(base) + i
    return SubjectNft(f"s_{base.split('.')[1]}_{i}", ip, GATEWAY)


AnyVariant = Variant | SharedVariant


class Sockets:
    """egressd's netlink socket, the probes' (set handles, shared sets)."""

    def __init__(self) -> None:
        self.nl, self.handles, self.raw = NfTablesSocket(timeout=120), HandleSocket(), sh.RawSocket()

    def run(self, batch: NetlinkBatch | sh.Raw) -> None:
        if isinstance(batch, sh.Raw):
            self.raw.run(batch)
        else:
            self.nl.run(batch)

    def close(self) -> None:
        self.nl.close()
        self.handles.close()
        self.raw.close()


def build(socks: Sockets, v: AnyVariant, size: int) -> None:
    header = header_script(v.cfg, delete_existing=False)
    if isinstance(v, SharedVariant):
        header += sh.sets_script(v.cfg.table, dyn_size=max(65536, size * 64), shards=v.shards)
    subprocess.run(["nft", "-f", "-"], input=header, text=True, check=True)
    for lo in range(0, size, 50):
        subjects = [subject(i, "10.64.0.0") for i in range(lo, min(size, lo + 50))]
        if isinstance(v, SharedVariant):
            raw = sh.Raw(v.cfg.table, NetlinkBatch(v.cfg.table))
            for i, s in zip(range(lo, lo + 50), subjects, strict=False):
                made, filled = v.create(s), v.swap(s, policy(i), first=True)
                assert raw.ops is not None and made.ops is not None
                raw.ops, raw.after = raw.ops + made.ops, raw.after + made.after + filled.msgs
            socks.run(raw)
            continue
        batch = NetlinkBatch(v.cfg.table)
        for i, s in zip(range(lo, lo + 50), subjects, strict=False):
            batch = batch + v.create(s) + v.swap(s, policy(i), first=True)
        socks.run(batch)


def timed(socks: Sockets, batch: NetlinkBatch | sh.Raw) -> float:
    t0 = time.perf_counter()
    socks.run(batch)
    return (time.perf_counter() - t0) * 1000


def fill_update_remove(socks: Sockets, v: AnyVariant, s: SubjectNft, k: int) -> dict[str, float]:
    out = {"fill": timed(socks, v.swap(s, policy(k), first=True))}
    out["update"] = timed(socks, v.swap(s, policy(k + 1), first=False, held=policy(k)))
    out["remove"] = timed(socks, v.remove(s))
    time.sleep(0.005)  # the kernel's deferred release of the removed objects
    return out


def one_round(socks: Sockets, v: AnyVariant, k: int) -> dict[str, float]:
    s = subject(k, "10.128.0.0")
    out = {"create": timed(socks, v.create(s))}
    if not v.dump or isinstance(v, SharedVariant):
        out.update(fill_update_remove(socks, v, s, k))
        return out
    # Learned right after creation (where the daemon would take them from NEWSET's echo). With
    # ``handles`` in the run every variant dumps, so that only the DELSET encoding differs: the
    # dump's reply of 6N sets evicts the caches the next transactions would find warm.
    handles = socks.handles.set_handles(v.cfg.table)
    if v.removed & handles.keys():
        raise RuntimeError(
            f"{v.cfg.table}: sets survived their removal: {sorted(v.removed & handles.keys())}"
        )
    v.removed = {Names(s.nft_id).set(kind) for kind in subject_sets(audit=not v.six, ranges=False)}
    if not v.removed <= handles.keys():
        raise RuntimeError(f"{v.cfg.table}: the dump misses sets of {s.nft_id}")
    out["fill"] = timed(socks, v.swap(s, policy(k), first=True))
    out["update"] = timed(socks, v.swap(s, policy(k + 1), first=False, held=policy(k)))
    # Every variant's removal goes through the same re-encoding socket (an empty map changes
    # nothing), so the Python side is the same and the difference is the kernel's.
    t0 = time.perf_counter()
    socks.handles.run(v.remove(s), handles if v.by_handle else {})
    out["remove"] = (time.perf_counter() - t0) * 1000
    time.sleep(0.005)  # the kernel's deferred release of the removed objects
    return out


SHARDS = 64  # ``sharded``: groups of six shared sets


def make_variant(name: str) -> AnyVariant:
    table = f"egbench_levers_{name}"
    if name in ("shared", "sharded"):
        return SharedVariant(table, SHARDS if name == "sharded" else 1)
    return Variant(name, table)


def measure(size: int, rounds: int, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    socks = Sockets()
    variants = {name: make_variant(name) for name in names}
    for v in variants.values():
        v.dump = "handles" in names
    try:
        for name, v in variants.items():
            t0 = time.monotonic()
            build(socks, v, size)
            print(
                f"  {size} subjects built for {name} in {time.monotonic() - t0:.1f}s",
                file=sys.stderr,
                flush=True,
            )
        samples: dict[str, dict[str, list[float]]] = {n: {p: [] for p in PHASES} for n in names}
        for k in range(rounds):
            r = k % len(names)
            for n in names[r:] + names[:r]:  # rotate the order: no variant always first
                for p, ms in one_round(socks, variants[n], k).items():
                    samples[n][p].append(ms)
        return {n: {p: statistics.median(x) for p, x in by.items()} for n, by in samples.items()}
    finally:
        socks.close()
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
        return subprocess.run(argv, check=False, timeout=3600).returncode
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
