#!/usr/bin/env python3
"""kill -9 storm (issue 13 item 3): random Fastlet/proxy-route traffic, SIGKILLs, replays, and
a kernel-versus-model comparison after every step.

Run as root from the repository root::

    .venv/bin/python scripts/storm.py [--actions 1000] [--kills 20] [--seed N] [--json-out FILE]

What it does, in throwaway network namespaces (tests/kernel/topology.py: a pod namespace
running the real egressd, sandbox namespaces, an upstream with a DNS server; nothing in the
root namespace, everything removed again, also on failure or SIGINT/SIGTERM):

* drives ``--actions`` random actions: register (SET_BINDING for a new uid), activate
  (runtime-ready / data-plane-ready), in-place update, revert (input null), rebind (new
  fence), re-key (same fence, other ip), remove, stale hooks/removals, invalid inputs, vault
  PUT/DELETE/GET via the proxy route (path id or ``X-Fast-Sandbox-Uid``), pushes cached for a
  uid that registers right after, and real DNS queries from the sandboxes;
* kills the daemon with SIGKILL (by the PID it started) at ``--kills`` random points, about
  half of them while an action is in flight (request sent, answer not read);
* restarts it, checks BEFORE any replay that the table is the deny-all header only (same
  header rules as the first start, every set and map empty), that ``instanceId`` changed, then
  replays as a Fastlet would: per live sandbox the latest accepted SET_BINDING, then the
  hooks that were reached for that fence; and, as the proxy route must (vaults live in memory
  only and die with the process, docs/reference/behaviour.md §6), the sandbox's vault, either pushed before the
  SET_BINDING (cached, replayed by it) or PUT after the hooks;
* after every action and every replay compares the kernel (``nft -j list table``) with an
  independent MODEL of what the daemon must hold (the spec's transitions, hand-computed set
  contents per policy): stale allows, missing denies, leaked objects, other mismatches.

Exit status 0 only when every comparison and every answer matched the model.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import ipaddress
import json
import os
import random
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.kernel.topology import GATEWAY, GATEWAY6, ZONE, Daemon, Topology, cleanup_stale  # noqa: E402

API = "sandbox.fast.io/actions/v1"
ACTIONS = "/_fastlet/v1/actions"
RR = "sandbox.runtime-ready"
DPR = "sandbox.data-plane-ready"
GATEWAY2 = "10.203.0.254"  # the extra (namespace-less) addresses' gateway: exercises gateway release
TABLE = "storm"

# ---- policies: inputs and what they must become, computed by hand from docs/reference/behaviour.md §5/§8 -------


@dataclass(frozen=True)
class PolicySpec:
    key: str
    input: str
    default: str  # "allow" | "deny"
    domains: tuple[tuple[str, str], ...]  # (action, target) of the domain rules, in order
    sets: dict[str, frozenset[str]]  # non-empty static sets of an active subject
    covers_api: bool  # an explicit allow covering api.example.test (vault coverage, §6)
    audit: bool = False


def _pol(doc: dict[str, Any] | str) -> str:
    return doc if isinstance(doc, str) else json.dumps(doc)


def _r(action: str, target: str) -> dict[str, str]:
    return {"action": action, "target": target}


def _s(**kinds: list[str]) -> dict[str, frozenset[str]]:
    return {k: frozenset(v) for k, v in kinds.items()}


POLICIES: dict[str, PolicySpec] = {
    p.key: p
    for p in (
        PolicySpec(
            "api",
            _pol(
                {
                    "defaultAction": "deny",
                    "egress": [
                        _r("allow", "api.example.test"),
                        _r("allow", "10.204.0.6"),
                        _r("deny", "10.204.0.8"),
                    ],
                }
            ),
            "deny",
            (("allow", "api.example.test"),),
            _s(allow_v4=["10.204.0.6"], deny_v4=["10.204.0.8"]),
            covers_api=True,
        ),
        PolicySpec(
            "wild",
            _pol(
                {
                    "defaultAction": "deny",
                    "egress": [
                        _r("deny", "x.y.example.test"),
                        _r("allow", "*.example.test"),
                        _r("allow", "10.204.0.0/24"),
                        _r("deny", "10.204.0.7"),
                        _r("allow", "fd00:204::/64"),
                        _r("deny", "fd00:204::3"),
                    ],
                }
            ),
            "deny",
            (("deny", "x.y.example.test"), ("allow", "*.example.test")),
            _s(
                allow_v4=["10.204.0.0/24"],
                deny_v4=["10.204.0.7"],
                allow_v6=["fd00:204::/64"],
                deny_v6=["fd00:204::3"],
            ),
            covers_api=True,
        ),
        PolicySpec(
            "open",
            _pol(
                {
                    "defaultAction": "allow",
                    "egress": [_r("deny", "b.test"), _r("deny", "10.204.0.8"), _r("deny", "fd00:204::2")],
                }
            ),
            "allow",
            (("deny", "b.test"),),
            _s(allow_v4=["0.0.0.0/0"], allow_v6=["::/0"], deny_v4=["10.204.0.8"], deny_v6=["fd00:204::2"]),
            covers_api=False,  # defaultAction allow alone never covers a binding host
        ),
        PolicySpec("none", "", "deny", (), {}, covers_api=False),
        PolicySpec(
            "cidr",
            _pol(
                {
                    "defaultAction": "deny",
                    "egress": [
                        _r("allow", "a.test"),
                        _r("allow", "www.a.test"),
                        _r("allow", "api.example.test"),
                        _r("allow", "10.204.0.2/31"),
                        _r("allow", "10.204.0.2"),  # a strict subnet of the /31: dropped
                        _r("allow", "10.204.0.9"),
                        _r("deny", "10.204.0.3"),
                    ],
                }
            ),
            "deny",
            (("allow", "a.test"), ("allow", "www.a.test"), ("allow", "api.example.test")),
            _s(allow_v4=["10.204.0.2/31", "10.204.0.9"], deny_v4=["10.204.0.3"]),
            covers_api=True,
        ),
        PolicySpec(
            "audit",
            _pol(
                {
                    "mode": "audit",
                    "defaultAction": "deny",
                    "egress": [_r("allow", "a.test"), _r("deny", "10.204.0.3"), _r("allow", "10.204.0.0/24")],
                }
            ),
            "deny",
            (("allow", "a.test"),),
            _s(
                allow_v4=["10.204.0.0/24"], wdeny_v4=["10.204.0.3"], audit_v4=["0.0.0.0/0"], audit_v6=["::/0"]
            ),
            covers_api=False,
            audit=True,
        ),
        PolicySpec(
            "v6",
            _pol(
                {
                    "defaultAction": "deny",
                    "egress": [_r("allow", "v6.test"), _r("allow", "fd00:204::2"), _r("allow", "short.test")],
                }
            ),
            "deny",
            (("allow", "v6.test"), ("allow", "short.test")),
            _s(allow_v6=["fd00:204::2"]),
            covers_api=False,
        ),
    )
}
BAD_INPUT = _pol({"defaultAction": "maybe"})  # 400 (docs/reference/behaviour.md §5, PROPOSED)
STATIC_KINDS = ("allow", "deny", "wdeny", "audit")
ALLOW_KINDS = ("allow", "audit", "dyn")  # what an extra element of would open (audit marks too)


def dns_judge(p: PolicySpec, name: str) -> tuple[bool, bool]:
    """(answered, learned) for ``name`` under ``p`` (§5: first match wins, ``*.`` never the apex;
    audit answers what it would deny but never learns it, §14.4 / audit mode)."""
    verdict = p.default
    for action, target in p.domains:
        wildcard = target.startswith("*.")
        hit = name.endswith(target[1:]) if wildcard else name == target
        if hit:
            verdict = action
            break
    if verdict == "allow":
        return True, True
    return p.audit, False


def in_prefixes(addr: str, prefixes: frozenset[str]) -> bool:
    ip = ipaddress.ip_address(addr)
    nets = (ipaddress.ip_network(p) for p in prefixes)
    return any(n.version == ip.version and ip in n for n in nets)


ZONE_ADDRS: dict[tuple[str, str], frozenset[str]] = {}
for _rec in ZONE:
    if _rec["name"] == "big.test":
        continue
    _qt = str(_rec["type"])
    if _qt in ("A", "AAAA"):
        _k = (str(_rec["name"]), _qt)
        ZONE_ADDRS[_k] = ZONE_ADDRS.get(_k, frozenset()) | {str(_rec["value"])}
ZONE_ADDRS[("www.a.test", "A")] = frozenset({"10.204.0.4"})  # CNAME chain -> deep.test
DNS_NAMES = [
    ("a.test", "A"),
    ("b.test", "A"),
    ("www.a.test", "A"),
    ("example.test", "A"),
    ("api.example.test", "A"),
    ("x.y.example.test", "A"),
    ("blocked-ip.test", "A"),
    ("short.test", "A"),
    ("v6.test", "AAAA"),
]


def vault_doc(key: str) -> dict[str, Any]:
    return {
        "credentials": [{"name": "tok", "source": {"type": "inline", "value": f"storm-{key}-value"}}],
        "bindings": [
            {
                "name": "api",
                "match": {"hosts": ["api.example.test"]},
                "auth": {"type": "bearer", "credential": "tok"},
            }
        ],
    }


VAULT_KEYS = ("v1", "v2")


def nft_id(uid: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", f"s-{uid}".lower())


# ---- addresses --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Addr:
    ip: str
    gw: str
    cidr: str  # what privateCidr says when the attachment carries one
    sandbox: int | None  # the sandbox namespace that owns the address (DNS queries), if any


ADDRS: list[Addr] = (
    [Addr(Topology.sb_ip(i), GATEWAY, "10.203.0.0/24", i) for i in range(1, 5)]
    + [Addr(Topology.sb_ip6(i), GATEWAY6, "fd00:203::/64", i) for i in (1, 2)]
    + [Addr(f"10.203.0.{40 + i}", GATEWAY2, "10.203.0.40/29", None) for i in range(1, 5)]
)
UIDS = [f"sb-{i}" for i in range(8)] + ["sb_7"]  # sb_7 collides with sb-7's nft id (§2: 409)


# ---- the model: what egressd must hold (registry) and therefore the kernel -------------------


@dataclass
class Sub:
    uid: str
    rid: str
    aid: str
    addr: Addr
    cidr: str | None
    state: str = "denying"  # or "active"
    pending: str | None = None  # policy key waiting for data-plane-ready
    policy: str | None = None  # active policy key
    vault: str | None = None
    vault_rev: int = 0
    leases: dict[str, set[str]] = field(default_factory=dict)  # dyn address -> names that taught it

    @property
    def nid(self) -> str:
        return nft_id(self.uid)


@dataclass
class Live:
    """What the Fastlet (and the proxy route) remember of one live sandbox."""

    env: dict[str, Any]  # latest SET_BINDING egressd accepted
    hooks: list[str] = field(default_factory=list)  # hooks reached (200) for this fence
    vault: str | None = None


class Model:
    def __init__(self) -> None:
        self.subs: dict[str, Sub] = {}
        self.cached: dict[str, list[str]] = {}  # uid -> vault keys cached while unregistered

    def reset(self) -> None:
        """A new process: empty registry, empty pending-push cache (both memory only)."""
        self.subs.clear()
        self.cached.clear()

    def owner_of_ip(self, ip: str) -> Sub | None:
        return next((s for s in self.subs.values() if s.addr.ip == ip), None)

    def conflict(self, uid: str, addr: Addr) -> bool:
        for s in self.subs.values():
            if s.uid != uid and (s.addr.ip == addr.ip or s.nid == nft_id(uid)):
                return True
        return False

    def coverage(self, s: Sub) -> PolicySpec | None:
        if s.state == "active" and s.policy is not None:
            return POLICIES[s.policy]
        if s.pending is not None:
            return POLICIES[s.pending]
        return None

    # SET_BINDING (§2, §3)
    def set_binding(self, uid: str, rid: str, aid: str, addr: Addr, cidr: str | None, inp: str | None) -> int:
        if inp == "bad":
            return 400
        s = self.subs.get(uid)
        if self.conflict(uid, addr):
            return 409
        if s is None or (s.rid, s.aid) != (rid, aid):
            # register or rebind: deny-first; old policy, pending, leases and vault dropped
            self.subs[uid] = Sub(uid, rid, aid, addr, cidr, pending=inp)
            if inp is None:
                self.cached.pop(uid, None)
            else:
                self._replay_cached(uid)
            return 200
        if inp is not None and s.vault is not None and not POLICIES[inp].covers_api:
            return 400  # the change would uncover a credential binding (14.1)
        s.addr, s.cidr = addr, cidr
        if inp is None:
            s.vault, s.pending = None, None
            if s.state == "active":
                s.state, s.policy, s.leases = "denying", None, {}
        elif s.state == "active":
            self._apply(s, inp)
        else:
            s.pending = inp
        return 200

    def _apply(self, s: Sub, key: str) -> None:
        """In-place change: a lease stays only if a name that taught it is still learnable and
        its address is not in the new deny sets (14.1)."""
        p = POLICIES[key]
        deny = p.sets.get("deny_v4", frozenset()) | p.sets.get("deny_v6", frozenset())
        kept: dict[str, set[str]] = {}
        for a, names in s.leases.items():
            still = {n for n in names if dns_judge(p, n)[1]}
            if still and not in_prefixes(a, deny):
                kept[a] = still
        s.policy, s.leases = key, kept

    def _replay_cached(self, uid: str) -> None:
        for key in self.cached.pop(uid, []):
            self.vault_put(uid, key)

    def hook(self, uid: str, rid: str, aid: str, name: str) -> int:
        s = self.subs.get(uid)
        if s is None or (s.rid, s.aid) != (rid, aid):
            return 409
        if name == RR:
            return 200
        if s.pending is not None:
            s.state, s.leases = "active", {}
            s.policy, s.pending = s.pending, None
            return 200
        return 200 if s.state == "active" else 409

    def remove(self, uid: str, rid: str, aid: str) -> int:
        s = self.subs.get(uid)
        if s is None:
            self.cached.pop(uid, None)
            return 200
        if (s.rid, s.aid) == (rid, aid):
            del self.subs[uid]
        return 200

    def vault_put(self, uid: str, key: str) -> int:
        s = self.subs.get(uid)
        if s is None:
            self.cached.setdefault(uid, []).append(key)
            return 202
        cov = self.coverage(s)
        if cov is None or not cov.covers_api:
            return 400
        if s.vault is None:
            s.vault, s.vault_rev = key, 1
            return 201
        if s.vault != key:
            s.vault, s.vault_rev = key, s.vault_rev + 1
        return 200

    def vault_delete(self, uid: str) -> int:
        s = self.subs[uid]
        if s.vault is None:
            return 404
        s.vault, s.vault_rev = None, 0
        return 204

    def dns(self, src: str, name: str, qtype: str) -> tuple[str, frozenset[str]]:
        """Expected (status, addresses) of a query from ``src``; records what it teaches."""
        s = self.owner_of_ip(src)
        if s is None or s.state != "active" or s.policy is None:
            return "NXDOMAIN", frozenset()
        answered, learned = dns_judge(POLICIES[s.policy], name)
        if not answered:
            return "NXDOMAIN", frozenset()
        addrs = ZONE_ADDRS.get((name, qtype), frozenset())
        if learned:
            for a in addrs:
                s.leases.setdefault(a, set()).add(name)
        return "NOERROR", addrs if learned else frozenset()


# ---- the kernel: parsing ``nft -j list table`` ------------------------------------------------

HEADER_SETS = {
    f"{kind}_{fam}"
    for fam in ("v4", "v6")
    for kind in ("marking", "dispatch", "sandboxes", "sandbox_nets", "dns_gw", "drop_counter")
} | {"sandbox_ifaces"}  # docs/reference/behaviour.md §20.2: the attachments' hostVeths
# The header's host-uid half (docs/reference/behaviour.md §17): its maps stay empty, the storm binds no uid subject.
UID_HEADER_SETS = {"uid_marking", "uid_dispatch", "uid_dns", "uid_dns_own", "uid_audit", "uid_drop_counter"}
MITM_HEADER_SETS = {f"{kind}_{fam}" for fam in ("v4", "v6") for kind in ("mitm_in", "mitm_src")} | {
    "uid_mitm",
    "uid_mitm_in",
}
# docs/reference/behaviour.md §15: every refusal goes through "denied" (counted) to "deny_verdict".
HEADER_CHAINS = {
    "marking",
    "dispatch",
    "input",
    "owned_in",  # docs/reference/behaviour.md §20.1
    "sandbox_in",
    "nat",
    "denied",
    "deny_verdict",
    "output",
    "uid_out",
    "uid_local",
    "uid_nat",
    "nat_out",
    "uid_denied",
    "fwd_zone",  # the DNS forwarder's conntrack zone (docs/reference/behaviour.md §17)
}
MITM_HEADER_CHAINS = {"uid_input"}
HEADER_COUNTERS = {"unattributed_dropped"}


def _refuses(rule_json: str) -> bool:
    """A rule whose verdict refuses: a drop, or the goto to the counting refusal chain."""
    return '"drop"' in rule_json or '"goto": {"target": "denied"}' in rule_json


# The port-scoped sets (docs/reference/behaviour.md §18) stay empty: no storm policy names ports.
PORT_KINDS = ("allowp", "denyp", "wdenyp", "dynp", "dynpx")
SUBJECT_SET_KINDS = [f"{k}_{fam}" for k in (*STATIC_KINDS, "dyn", *PORT_KINDS) for fam in ("v4", "v6")]
# Made by a subject's first audit policy and kept until its removal (fleetnft/audit.py):
# optional objects, required while the active policy audits.
AUDIT_SET_KINDS = {f"{k}_{fam}" for k in ("wdeny", "audit", "wdenyp") for fam in ("v4", "v6")}


def _elem_text(e: Any) -> str:
    if isinstance(e, str):
        return e
    if isinstance(e, dict):
        if "prefix" in e:
            return f"{e['prefix']['addr']}/{e['prefix']['len']}"
        if "elem" in e:
            return _elem_text(e["elem"]["val"])
        if "range" in e:
            return f"{e['range'][0]}-{e['range'][1]}"
    return json.dumps(e, sort_keys=True)


@dataclass
class Kernel:
    sets: dict[str, set[str]] = field(default_factory=dict)
    maps: dict[str, dict[str, str]] = field(default_factory=dict)
    chains: set[str] = field(default_factory=set)
    rules: dict[str, list[str]] = field(default_factory=dict)
    counters: set[str] = field(default_factory=set)

    @classmethod
    def parse(cls, items: list[dict[str, Any]]) -> Kernel:
        k = cls()
        for item in items:
            if "set" in item:
                s = item["set"]
                k.sets[s["name"]] = {_elem_text(e) for e in s.get("elem", [])}
            elif "map" in item:
                m = item["map"]
                # Verdict maps carry {"jump": {"target": chain}}; counter maps a counter's name.
                k.maps[m["name"]] = {
                    _elem_text(e[0]): e[1]
                    if isinstance(e[1], str)
                    else str(e[1].get("jump", {}).get("target", json.dumps(e[1])))
                    for e in m.get("elem", [])
                }
            elif "chain" in item:
                k.chains.add(item["chain"]["name"])
            elif "rule" in item:
                r = item["rule"]
                k.rules.setdefault(r["chain"], []).append(json.dumps(r["expr"], sort_keys=True))
            elif "counter" in item:
                k.counters.add(item["counter"]["name"])
        return k

    def names(self) -> set[str]:
        return set(self.sets) | set(self.maps) | self.chains | self.counters


@dataclass
class Tally:
    actions: int = 0
    kills: int = 0
    inflight_kills: int = 0
    inflight_answered: int = 0
    startup_kills: int = 0
    replays: int = 0
    replayed_requests: int = 0
    comparisons: int = 0
    restart_checks: int = 0
    dns_queries: int = 0
    stale_allows: int = 0
    missing_denies: int = 0
    leaked_objects: int = 0
    restart_not_header: int = 0
    instance_id_reused: int = 0
    mismatches: int = 0  # answers, DNS results, missing allows, extra denies
    injected: int = 0
    details: list[str] = field(default_factory=list)

    def note(self, kind: str, text: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.details) < 60:
            self.details.append(f"{kind}: {text}")

    @property
    def violations(self) -> int:
        return (
            self.stale_allows
            + self.missing_denies
            + self.leaked_objects
            + self.restart_not_header
            + self.instance_id_reused
            + self.mismatches
        )


# ---- HTTP inside the pod namespace ------------------------------------------------------------


class PodHTTP:
    """HTTP to the daemon's loopback port from this process: sockets are created by a worker
    thread that entered the pod's network namespace (setns affects that thread only), so a
    request costs no ``ip netns exec curl`` and an in-flight kill can be timed after the
    request was sent."""

    def __init__(self, netns: str, port: int) -> None:
        self.port = port
        self._netns = netns
        self._pool = ThreadPoolExecutor(max_workers=1, initializer=self._enter)

    def _enter(self) -> None:
        fd = os.open(f"/run/netns/{self._netns}", os.O_RDONLY)
        try:
            os.setns(fd, os.CLONE_NEWNET)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def connect(self, timeout: float = 10.0) -> http.client.HTTPConnection:
        sock = self._pool.submit(socket.create_connection, ("127.0.0.1", self.port), timeout).result()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        conn.sock = sock
        return conn

    def send(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> http.client.HTTPConnection:
        conn = self.connect()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=body, headers=hdrs)
        return conn

    @staticmethod
    def answer(conn: http.client.HTTPConnection) -> tuple[int, str]:
        try:
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()

    def call(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, str]:
        return self.answer(self.send(method, path, body, headers))


# ---- requests ---------------------------------------------------------------------------------


@dataclass
class Request:
    """One HTTP request with the model's prediction of its answer."""

    label: str
    method: str
    path: str
    body: bytes | None
    headers: dict[str, str]
    expect: int
    uid: str
    kind: str  # set | hook | remove | vault
    env: dict[str, Any] | None = None
    check_rev: int | None = None  # GET: the vault revision the model expects


def envelope(
    op: str,
    uid: str,
    rid: str,
    aid: str,
    *,
    addr: Addr | None = None,
    cidr: str | None = None,
    inp: str | bool | None = False,
    hook: str | None = None,
    generation: int = 1,
) -> dict[str, Any]:
    env: dict[str, Any] = {
        "apiVersion": API,
        "operation": op,
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": rid, "attachmentId": aid, "specGeneration": generation},
    }
    if addr is not None:
        net: dict[str, Any] = {"ip": addr.ip, "gateway": addr.gw, "hostVeth": f"vh-{uid}"}
        if cidr is not None:
            net["privateCidr"] = cidr
        env["attachment"] = {"network": net}
    if inp is not False:
        env["binding"] = {"input": inp}
    if hook is not None:
        env["hook"] = {"name": hook}
    return env


class Storm:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.model = Model()
        self.live: dict[str, Live] = {}
        self.tally = Tally()
        self.serial = 0
        self.gen = 0
        self.topo: Topology | None = None
        self.daemon: Daemon | None = None
        self.http: PodHTTP | None = None
        self.instance_id = ""
        self.header_rules: dict[str, list[str]] | None = None
        self.templates: dict[str, list[str]] = {}
        self.deadline = time.monotonic() + args.max_seconds
        self.mitm: bool = args.mitm
        self.header_sets = HEADER_SETS | UID_HEADER_SETS | (MITM_HEADER_SETS if self.mitm else set())
        self.header_chains = HEADER_CHAINS | (MITM_HEADER_CHAINS if self.mitm else set())
        self.codes: dict[str, int] = {}  # "label code" -> count: what the run exercised

    # ---- helpers -----------------------------------------------------------------------------

    def _next(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}{self.serial}"

    def _policy(self, null_p: float = 0.1, bad_p: float = 0.03) -> str | None:
        x = self.rng.random()
        if x < bad_p:
            return "bad"
        if x < bad_p + null_p:
            return None
        return self.rng.choice(sorted(POLICIES))

    def _cidr(self, addr: Addr) -> str | None:
        return addr.cidr if self.rng.random() < 0.5 else None

    def set_request(
        self, label: str, uid: str, rid: str, aid: str, addr: Addr, cidr: str | None, key: str | None
    ) -> Request:
        self.gen += 1
        inp: str | None = None if key is None else (BAD_INPUT if key == "bad" else POLICIES[key].input)
        env = envelope("SET_BINDING", uid, rid, aid, addr=addr, cidr=cidr, inp=inp, generation=self.gen)
        expect = self.model.set_binding(uid, rid, aid, addr, cidr, key)
        # What the Fastlet keeps: the binding plus which policy key it carried (for the logs).
        env["_storm"] = {"policy": key, "addr": ADDRS.index(addr)}
        return self._req(label, "POST", ACTIONS, env, expect, uid, "set")

    def hook_request(self, label: str, uid: str, rid: str, aid: str, name: str) -> Request:
        env = envelope("LIFECYCLE_HOOK", uid, rid, aid, hook=name)
        return self._req(label, "POST", ACTIONS, env, self.model.hook(uid, rid, aid, name), uid, "hook")

    def remove_request(self, label: str, uid: str, rid: str, aid: str) -> Request:
        env = envelope("REMOVE_BINDING", uid, rid, aid)
        return self._req(label, "POST", ACTIONS, env, self.model.remove(uid, rid, aid), uid, "remove")

    def _req(
        self, label: str, method: str, path: str, env: dict[str, Any], expect: int, uid: str, kind: str
    ) -> Request:
        wire = {k: v for k, v in env.items() if not k.startswith("_")}
        return Request(label, method, path, json.dumps(wire).encode(), {}, expect, uid, kind, env)

    def vault_request(self, label: str, method: str, uid: str, key: str | None = None) -> Request:
        suffix_only = self.rng.random() < 0.5
        path = "/credential-vault" if suffix_only else f"/v1/sandboxfleets/{uid}/egress/credential-vault"
        headers = {"X-Fast-Sandbox-Uid": uid} if suffix_only else {}
        body = json.dumps(vault_doc(key)).encode() if key is not None else None
        rev = None
        if method == "PUT":
            assert key is not None
            expect = self.model.vault_put(uid, key)
        elif method == "DELETE":
            expect = self.model.vault_delete(uid)
        else:
            s = self.model.subs.get(uid)
            expect = 200 if s is not None and s.vault is not None else 404
            rev = s.vault_rev if s is not None and s.vault is not None else None
        return Request(label, method, path, body, headers, expect, uid, "vault", check_rev=rev)

    # ---- Fastlet memory ------------------------------------------------------------------------

    def remember(self, req: Request) -> None:
        """What a Fastlet/proxy route keeps after an action the daemon accepted (or, killed in
        flight, would have accepted on the retry: the model's prediction stands for it)."""
        env = req.env
        if req.expect >= 300 or env is None:  # refused, or a vault request: vaults only
            self._sync_vaults()
            return
        if req.kind == "set":
            prev = self.live.get(req.uid)
            fence = (env["revision"]["runtimeInstanceId"], env["revision"]["attachmentId"])
            hooks: list[str] = []
            if prev is not None:
                pf = (prev.env["revision"]["runtimeInstanceId"], prev.env["revision"]["attachmentId"])
                if pf == fence:
                    hooks = prev.hooks
            self.live[req.uid] = Live(env, hooks)
        elif req.kind == "hook":
            live = self.live.get(req.uid)
            name = env["hook"]["name"]
            if live is not None and name not in live.hooks:
                live.hooks.append(name)
        elif req.kind == "remove" and req.uid not in self.model.subs:
            self.live.pop(req.uid, None)
        self._sync_vaults()

    def _sync_vaults(self) -> None:
        for uid, live in self.live.items():
            s = self.model.subs.get(uid)
            live.vault = s.vault if s is not None else None

    # ---- sending -------------------------------------------------------------------------------

    def send(self, req: Request) -> None:
        assert self.http is not None
        code, body = self.http.call(req.method, req.path, req.body, req.headers)
        self._judge(req, code, body)
        self.remember(req)

    def _judge(self, req: Request, code: int, body: str) -> None:
        key = f"{req.label} {code}"
        self.codes[key] = self.codes.get(key, 0) + 1
        if code != req.expect:
            self.tally.note("mismatches", f"{req.label}: got {code} {body[:120]!r}, model says {req.expect}")
        elif req.check_rev is not None:
            try:
                rev = json.loads(body).get("revision")
            except ValueError:
                rev = None
            if rev != req.check_rev:
                self.tally.note(
                    "mismatches", f"{req.label}: vault revision {rev}, model says {req.check_rev}"
                )

    # ---- the action mix ------------------------------------------------------------------------

    def random_requests(self) -> list[Request] | str:
        """The next random action as its requests (model applied), or "dns"."""
        m = self.model
        registered = sorted(m.subs)
        absent = [u for u in UIDS if u not in m.subs]
        kinds = [
            ("register", 14),
            ("register_cached_vault", 3),
            ("activate", 16),
            ("update", 14),
            ("revert", 5),
            ("rebind", 7),
            ("rekey", 4),
            ("remove", 7),
            ("stale", 3),
            ("vault_put", 8),
            ("vault_delete", 3),
            ("vault_get", 2),
            ("dns", 14),
        ]
        kind = self.rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
        needs_registered = kind not in ("register", "register_cached_vault", "dns")
        if (kind.startswith("register") and not absent) or (needs_registered and not registered):
            kind = "register" if absent else "update"
        if kind == "dns":
            return "dns"
        if kind.startswith("register"):
            return self._register_requests(kind, absent)
        if kind == "vault_put":
            # Mostly a subject whose policy can cover the binding (else 400 every time).
            covered = [u for u in registered if (c := m.coverage(m.subs[u])) is not None and c.covers_api]
            if covered and self.rng.random() < 0.7:
                registered = covered
        uid = self.rng.choice(registered)
        return self._subject_requests(kind, uid, m.subs[uid])

    def _register_requests(self, kind: str, absent: list[str]) -> list[Request] | str:
        """A SET_BINDING for a new uid; for ``register_cached_vault`` after a vault push."""
        m = self.model
        if kind == "register":
            uid = self.rng.choice(absent)
            # Mostly a free address; sometimes a taken one (409, §2 PROPOSED).
            free = [a for a in ADDRS if not m.conflict(uid, a)]
            addr = self.rng.choice(free if free and self.rng.random() < 0.85 else ADDRS)
            return [
                self.set_request(kind, uid, self._next("r"), "a1", addr, self._cidr(addr), self._policy())
            ]
        uid = self.rng.choice(absent)
        free = [a for a in ADDRS if not m.conflict(uid, a)]
        if not free:
            return "dns"
        addr = self.rng.choice(free)
        key = self.rng.choice(["api", "wild", "cidr"])
        put = self.vault_request("cached vault PUT", "PUT", uid, self.rng.choice(VAULT_KEYS))
        return [
            put,
            self.set_request("register after cached push", uid, self._next("r"), "a1", addr, None, key),
        ]

    def _subject_requests(self, kind: str, uid: str, s: Sub) -> list[Request]:
        """The requests of one action on the registered subject ``uid``."""
        if kind == "activate":
            name = DPR if self.rng.random() < 0.75 else RR
            return [self.hook_request(f"hook {name}", uid, s.rid, s.aid, name)]
        if kind == "update":
            return [self.set_request("update", uid, s.rid, s.aid, s.addr, s.cidr, self._policy(null_p=0))]
        if kind == "revert":
            return [self.set_request("revert", uid, s.rid, s.aid, s.addr, s.cidr, None)]
        if kind == "rebind":
            rid, aid = (self._next("r"), s.aid) if self.rng.random() < 0.5 else (s.rid, self._next("a"))
            addr = s.addr if self.rng.random() < 0.5 else self.rng.choice(ADDRS)
            return [self.set_request("rebind", uid, rid, aid, addr, self._cidr(addr), self._policy())]
        if kind == "rekey":
            addr = self.rng.choice(ADDRS)
            return [
                self.set_request("rekey", uid, s.rid, s.aid, addr, self._cidr(addr), self._policy(null_p=0))
            ]
        if kind == "remove":
            return [self.remove_request("remove", uid, s.rid, s.aid)]
        if kind == "stale":
            if self.rng.random() < 0.5:
                return [self.hook_request("stale hook", uid, s.rid + "-old", s.aid, DPR)]
            return [self.remove_request("stale remove", uid, s.rid, s.aid + "-old")]
        if kind == "vault_put":
            return [self.vault_request("vault PUT", "PUT", uid, self.rng.choice(VAULT_KEYS))]
        if kind == "vault_delete":
            return [self.vault_request("vault DELETE", "DELETE", uid)]
        return [self.vault_request("vault GET", "GET", uid)]

    def dns_query(self) -> None:
        assert self.topo is not None
        gateways = {s.addr.gw for s in self.model.subs.values()}
        choices = [a for a in ADDRS if a.sandbox is not None and a.gw in gateways]
        if not choices:
            return
        addr = self.rng.choice(choices)
        assert addr.sandbox is not None
        name, qtype = self.rng.choice(DNS_NAMES)
        want, addrs = self.model.dns(addr.ip, name, qtype)
        status, answers = self.topo.dig(addr.sandbox, name, qtype, server=addr.gw)
        self.tally.dns_queries += 1
        got = {a for a in answers if _is_ip(a)}
        if want == "NXDOMAIN" and got:
            self.tally.note(
                "stale_allows", f"DNS {name} from {addr.ip}: answered {sorted(got)}, model says NXDOMAIN"
            )
        elif status != want or not addrs <= got:
            self.tally.note(
                "mismatches",
                f"DNS {name} {qtype} from {addr.ip}: {status} {sorted(got)}, model {want} {sorted(addrs)}",
            )

    # ---- kernel comparison ------------------------------------------------------------------------

    def kernel(self) -> Kernel:
        assert self.daemon is not None
        return Kernel.parse(self.daemon.table_json())

    def check_header_only(self) -> None:
        """Right after a restart, before any replay: nothing but the deny-all header."""
        k = self.kernel()
        self.tally.restart_checks += 1
        extra = k.names() - self.header_sets - self.header_chains - HEADER_COUNTERS
        if extra:
            self.tally.note("restart_not_header", f"objects besides the header: {sorted(extra)[:8]}")
        for name in self.header_sets:
            elems = k.sets.get(name, set()) | set(k.maps.get(name, {}))
            if elems:
                self.tally.note("restart_not_header", f"{name} not empty: {sorted(elems)[:6]}")
        if (
            self.header_rules is not None
            and {c: k.rules.get(c, []) for c in self.header_chains} != self.header_rules
        ):
            self.tally.note("restart_not_header", "header rules differ from the first start's")

    def compare(self, when: str) -> None:
        k = self.kernel()
        self.tally.comparisons += 1
        self._compare_header(k, when)
        self._compare_objects(k, when)
        for fam in ("v4", "v6"):
            self._compare_table_wide(k, when, fam)
        self._compare_subjects(k, when)
        if "subj" in self.templates and [int(_refuses(r)) for r in self.templates["subj"]] != [1, 1, 1, 1]:
            self.tally.note(
                "missing_denies",
                "a subject chain does not hold exactly its four deny-set drops (deny, denyp)",
            )

    def _compare_header(self, k: Kernel, when: str) -> None:
        note = self.tally.note
        if self.header_rules is None:
            self.header_rules = {c: k.rules.get(c, []) for c in self.header_chains}
            # The first start's header is the reference: it must end the forward hook with
            # the unmarked-drop and the sandbox input chain with a drop (fail closed).
            if not self.header_rules["dispatch"] or not _refuses(self.header_rules["dispatch"][-1]):
                note("missing_denies", "header dispatch chain does not end with a drop")
            if not self.header_rules["sandbox_in"] or not _refuses(self.header_rules["sandbox_in"][-1]):
                note("missing_denies", "header sandbox_in chain does not end with a drop")
            if not self.header_rules["deny_verdict"] or '"drop"' not in self.header_rules["deny_verdict"][-1]:
                note("missing_denies", "header deny_verdict chain does not end with a drop")
        elif {c: k.rules.get(c, []) for c in self.header_chains} != self.header_rules:
            note("missing_denies", f"{when}: header rules changed")

    def _compare_objects(self, k: Kernel, when: str) -> None:
        """Objects: the expected ones per registered subject, nothing else."""
        expected_names = self.header_sets | self.header_chains | HEADER_COUNTERS
        optional: set[str] = set()
        for s in self.model.subs.values():
            auditing = s.state == "active" and s.policy is not None and POLICIES[s.policy].audit
            kinds = (
                SUBJECT_SET_KINDS if auditing else [k for k in SUBJECT_SET_KINDS if k not in AUDIT_SET_KINDS]
            )
            expected_names |= {f"subj_{s.nid}_{kind}" for kind in kinds}
            optional |= {f"subj_{s.nid}_{kind}" for kind in AUDIT_SET_KINDS}
            expected_names |= {f"subj_{s.nid}", f"mark_{s.nid}"} | (
                {f"subj_{s.nid}_in"} if self.mitm else set()
            )
            expected_names |= {
                f"subj_{s.nid}_audit_deny",
                f"subj_{s.nid}_audit_default",
                f"subj_{s.nid}_dropped",
            }
        have = k.names()
        for name in sorted(have - expected_names - optional):
            self.tally.note("leaked_objects", f"{when}: {name}")
        for name in sorted(expected_names - have):
            self.tally.note("missing_denies", f"{when}: missing object {name}")

    def _compare_table_wide(self, k: Kernel, when: str, fam: str) -> None:
        """The table-wide maps and sets of one family."""
        subs = self.model.subs
        mine = [s for s in subs.values() if (":" in s.addr.ip) == (fam == "v6")]
        want_disp = {s.addr.ip: f"subj_{s.nid}" for s in mine}
        want_mark = {s.addr.ip: f"mark_{s.nid}" for s in mine}
        keyed = [(f"dispatch_{fam}", want_disp), (f"marking_{fam}", want_mark)]
        if self.mitm:
            keyed.append((f"mitm_in_{fam}", {s.addr.ip: f"subj_{s.nid}_in" for s in mine}))
            self._set_diff(when, f"mitm_src_{fam}", k, {s.addr.ip for s in mine}, deny=False)
        for mname, want in keyed:
            self._map_diff(when, mname, k.maps.get(mname, {}), want)
        self._counter_map_diff(when, fam, k, {s.addr.ip: f"subj_{s.nid}_dropped" for s in mine})
        self._set_diff(when, f"sandboxes_{fam}", k, {s.addr.ip for s in mine}, deny=True)
        gws = {s.addr.gw for s in subs.values() if (":" in s.addr.gw) == (fam == "v6")}
        self._set_diff(when, f"dns_gw_{fam}", k, gws, deny=False)
        nets = [
            ipaddress.ip_network(s.cidr) for s in subs.values() if s.cidr and (":" in s.cidr) == (fam == "v6")
        ]
        want_nets = {_net_text(n) for n in ipaddress.collapse_addresses(nets)}  # type: ignore[type-var]
        self._set_diff(when, f"sandbox_nets_{fam}", k, want_nets, deny=True)

    def _map_diff(self, when: str, mname: str, got: dict[str, str], want: dict[str, str]) -> None:
        note = self.tally.note
        for ip, target in got.items():
            if want.get(ip) != target:
                note("stale_allows", f"{when}: {mname} {ip} -> {target}, model {want.get(ip)}")
        for ip, target in want.items():
            if ip not in got:
                owner = self.model.owner_of_ip(ip)
                cat = "missing_denies" if owner is not None and owner.state == "denying" else "mismatches"
                note(cat, f"{when}: {mname} lacks {ip} -> {target}")

    def _counter_map_diff(self, when: str, fam: str, k: Kernel, want_ctr: dict[str, str]) -> None:
        """Counting only (never an allow): every dispatched key's refusals go to its own
        subject's counter, and no other key is in the counter map."""
        got_ctr = k.maps.get(f"drop_counter_{fam}", {})
        for ip, counter in got_ctr.items():
            if want_ctr.get(ip) != counter:
                self.tally.note(
                    "mismatches", f"{when}: drop_counter_{fam} {ip} -> {counter}, model {want_ctr.get(ip)}"
                )
        for ip in k.maps.get(f"dispatch_{fam}", {}):
            if ip in want_ctr and ip not in got_ctr:
                self.tally.note("mismatches", f"{when}: drop_counter_{fam} lacks {ip}")

    def _compare_subjects(self, k: Kernel, when: str) -> None:
        """Per subject: set contents and fixed rules."""
        for s in self.model.subs.values():
            p = POLICIES[s.policy] if s.state == "active" and s.policy is not None else None
            for kind in SUBJECT_SET_KINDS:
                name = f"subj_{s.nid}_{kind}"
                if name not in k.sets:
                    continue  # reported as a missing object
                if kind.startswith("dyn"):
                    allowed = set(s.leases) if p is not None else set()
                    fam6 = kind.endswith("v6")
                    for e in sorted(k.sets[name] - {a for a in allowed if (":" in a) == fam6}):
                        self.tally.note(
                            "stale_allows", f"{when}: {name} holds {e} (no still-allowed name taught it)"
                        )
                    continue
                contents = p.sets.get(kind, frozenset()) if p is not None else frozenset()
                self._set_diff(
                    when,
                    name,
                    k,
                    set(contents),
                    deny=kind.split("_")[0] in ("deny", "wdeny", "denyp", "wdenyp"),
                )
            self._compare_rules(k, when, s)

    def _compare_rules(self, k: Kernel, when: str, s: Sub) -> None:
        chains = [(f"subj_{s.nid}", "subj"), (f"mark_{s.nid}", "mark")]
        if self.mitm:
            chains.append((f"subj_{s.nid}_in", "in"))
        audited = f"subj_{s.nid}_audit_v4" in k.sets
        for chain, tkey in chains:
            if chain not in k.chains:
                continue
            # The nft id appears in set, counter and log-prefix names; the rest is the same
            # among subjects with (or among those without) the audit objects.
            rules = [r.replace(s.nid, "ID") for r in k.rules.get(chain, [])]
            if tkey == "mark" and sum('"log"' in r for r in rules) != (6 if audited else 0):
                self.tally.note("missing_denies", f"{when}: {chain} audit rules do not match its audit sets")
            if tkey != "subj" and audited:
                tkey += ":audit"
            template = self.templates.setdefault(tkey, rules)
            if rules != template:
                self.tally.note(
                    "missing_denies", f"{when}: rules of {chain} differ from every other subject's"
                )

    def _set_diff(self, when: str, name: str, k: Kernel, want: set[str], *, deny: bool) -> None:
        got = k.sets.get(name)
        if got is None:
            return
        for e in sorted(got - want):
            opens = not deny and (
                name.startswith(("dns_gw", "mitm_src")) or name.split("_")[-2] in ALLOW_KINDS
            )
            self.tally.note(
                "stale_allows" if opens else "mismatches", f"{when}: {name} holds {e}, model does not"
            )
        for e in sorted(want - got):
            self.tally.note("missing_denies" if deny else "mismatches", f"{when}: {name} lacks {e}")

    def inject(self, what: str) -> None:
        """Self-check of the oracle (``--inject``): change the kernel behind egressd's back the
        way a defect would, so the next comparison must report it (a run that cannot see a
        rogue element proves nothing)."""
        assert self.daemon is not None
        subs = sorted(self.model.subs.values(), key=lambda s: s.uid)
        if what == "leak":
            self.daemon.nft("add", "chain", "inet", TABLE, "subj_s_ghost")
        elif what == "allow":
            target = f"subj_{subs[0].nid}_allow_v4" if subs else "dns_gw_v4"
            self.daemon.nft("add", "element", "inet", TABLE, target, "{ 203.0.113.7 }")
        elif what == "deny":
            self.daemon.nft("delete", "element", "inet", TABLE, "sandboxes_v4", f"{{ {self._any_v4()} }}")
        self.tally.injected += 1

    def _any_v4(self) -> str:
        for s in self.model.subs.values():
            if ":" not in s.addr.ip:
                return s.addr.ip
        raise RuntimeError("--inject deny needs a registered IPv4 subject at --inject-at")

    # ---- kill, restart, replay --------------------------------------------------------------------

    def start_daemon(self) -> None:
        assert self.daemon is not None and self.http is not None
        self.daemon.start(wait=False)
        self.daemon.wait_ready(timeout=30)
        code, body = self.http.call("GET", "/_fastlet/v1/actions/status")
        doc = json.loads(body) if code == 200 else {}
        new_id = str(doc.get("instanceId", ""))
        if not doc.get("ready") or not new_id or new_id == self.instance_id:
            self.tally.note("instance_id_reused", f"status after start: {code} {body[:120]!r}")
        self.instance_id = new_id

    def kill(self, inflight: list[Request] | None) -> None:
        assert self.daemon is not None and self.daemon.proc is not None and self.http is not None
        pid = self.daemon.proc.pid
        conn = None
        if inflight:
            # Earlier requests of a compound action complete; the last one is in flight.
            for req in inflight[:-1]:
                self.send(req)
            req = inflight[-1]
            conn = self.http.send(req.method, req.path, req.body, req.headers)
            time.sleep(self.rng.choice([0.0, self.rng.uniform(0, 0.002), self.rng.uniform(0, 0.01)]))
            self.remember(req)  # the Fastlet's intent: it retries or replays it either way
            self.tally.inflight_kills += 1
        os.kill(pid, signal.SIGKILL)  # the daemon we started, by its PID
        self.daemon.proc.wait(10)
        self.daemon.kill()  # bookkeeping only: the process is gone
        self.tally.kills += 1
        if conn is not None:
            with contextlib.suppress(OSError, http.client.HTTPException):
                code, _ = PodHTTP.answer(conn)
                self.tally.inflight_answered += 1
                if inflight and code != inflight[-1].expect:
                    self.tally.note(
                        "mismatches", f"in-flight {inflight[-1].label}: {code}, model {inflight[-1].expect}"
                    )
        self.model.reset()
        if self.rng.random() < self.args.startup_kill:
            # Killed again while starting (before, during or after the table reset): the
            # next start must still begin from the deny-all header.
            self.daemon.start(wait=False)
            time.sleep(self.rng.uniform(0, 1.5))
            assert self.daemon.proc is not None
            os.kill(self.daemon.proc.pid, signal.SIGKILL)
            self.daemon.proc.wait(10)
            self.daemon.kill()
            self.tally.kills += 1
            self.tally.startup_kills += 1
        self.start_daemon()
        self.check_header_only()
        self.replay()
        self.compare("after replay")

    def replay(self) -> None:
        """The Fastlet's answer to a new instanceId, plus the proxy route's vault re-push."""
        self.tally.replays += 1
        uids = sorted(self.live)
        self.rng.shuffle(uids)
        for uid in uids:
            live = self.live[uid]
            env = live.env
            rev = env["revision"]
            before = live.vault is not None and self.rng.random() < 0.5
            reqs: list[Request] = []
            if before:
                assert live.vault is not None
                reqs.append(self.vault_request("replay vault (cached)", "PUT", uid, live.vault))
            meta = env["_storm"]
            addr = ADDRS[meta["addr"]]
            net = env["attachment"]["network"]
            expect = self.model.set_binding(
                uid,
                rev["runtimeInstanceId"],
                rev["attachmentId"],
                addr,
                net.get("privateCidr"),
                meta["policy"],
            )
            reqs.append(
                Request("replay SET_BINDING", "POST", ACTIONS, self._wire(env), {}, expect, uid, "set", env)
            )
            for name in list(live.hooks):
                reqs.append(
                    self.hook_request(
                        f"replay {name}", uid, rev["runtimeInstanceId"], rev["attachmentId"], name
                    )
                )
            if live.vault is not None and not before:
                reqs.append(self.vault_request("replay vault", "PUT", uid, live.vault))
            # The model was advanced while building (in order); now send in the same order.
            for req in reqs:
                assert self.http is not None
                code, body = self.http.call(req.method, req.path, req.body, req.headers)
                self._judge(req, code, body)
                self.tally.replayed_requests += 1
        self._sync_vaults()

    @staticmethod
    def _wire(env: dict[str, Any]) -> bytes:
        return json.dumps({k: v for k, v in env.items() if not k.startswith("_")}).encode()

    # ---- main loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        cleanup_stale()
        self.topo = Topology(prefix=f"egs{os.getpid()}", sandboxes=4).up_()
        try:
            self.daemon = Daemon(self.topo, table=TABLE, port=self.args.port, env=self._daemon_env())
            self.http = PodHTTP(self.topo.pod, self.args.port)
            self.start_daemon()
            self.check_header_only()
            self._storm()
            self.compare("at the end")
        except BaseException:
            if self.daemon is not None:
                print(self.daemon.log_text()[-3000:], file=sys.stderr)
            raise
        finally:
            if self.http is not None:
                self.http.close()
            if self.daemon is not None and self.daemon.proc is not None:
                self.daemon.kill(signal.SIGTERM)
            self.topo.down()

    def _daemon_env(self) -> dict[str, str]:
        if not self.mitm:
            return {}
        assert self.topo is not None
        w = self.topo.workdir
        return {
            "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
            "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(self.args.port + 1),
            "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(self.topo.tls_dir / "trust"),
            "EGRESSD_MITM_CONFDIR": str(w / "mitm-conf"),
            "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(w / "mitm-run" / "active.sock"),
            "EGRESSD_MITM_WORKERS": "1",
        }

    def _storm(self) -> None:
        """The random actions, with the kills (some in flight) at random points among them."""
        n, kills = self.args.actions, self.args.kills
        points = set(self.rng.sample(range(1, n), min(kills, n - 1))) if kills else set()
        inflight_points = {p for p in points if self.rng.random() < self.args.inflight}
        started = time.monotonic()
        for i in range(n):
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"storm exceeded --max-seconds at action {i}")
            reqs = self.random_requests()
            self.tally.actions += 1
            if i in inflight_points and isinstance(reqs, list):
                self.kill(reqs)
                continue
            if isinstance(reqs, list):
                for req in reqs:
                    self.send(req)
            else:
                self.dns_query()
            if i in points:
                self.kill(None)
                continue
            self._after_action(i)
            if self.args.verbose and i % 100 == 0:
                print(
                    f"storm: {i}/{n} actions, {self.tally.kills} kills, {time.monotonic() - started:.0f}s",
                    flush=True,
                )

    def _after_action(self, i: int) -> None:
        if i == self.args.inject_at and self.args.inject:
            self.inject(self.args.inject)
            self.compare(f"after injecting {self.args.inject}")
        if self.args.check_every and i % self.args.check_every == 0:
            self.compare(f"after action {i}")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _net_text(n: ipaddress.IPv4Network | ipaddress.IPv6Network) -> str:
    return str(n.network_address) if n.num_addresses == 1 else str(n)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM/SIGHUP unwind like Ctrl-C, so the namespaces are removed on the way out."""

    def raise_(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {s: signal.signal(s, raise_) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--actions", type=int, default=1000)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--inflight", type=float, default=0.5, help="share of kills during an in-flight action")
    ap.add_argument(
        "--startup-kill", type=float, default=0.2, help="share of restarts killed again while starting"
    )
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--check-every",
        type=int,
        default=1,
        help="compare kernel and model every N actions (0: only after replays)",
    )
    ap.add_argument("--port", type=int, default=18610)
    ap.add_argument("--max-seconds", type=float, default=1800)
    ap.add_argument("--mitm", action="store_true", help="run egressd with the transparent MITM")
    ap.add_argument(
        "--inject",
        choices=("allow", "leak", "deny"),
        default=None,
        help="self-check: plant a stale allow, a leaked chain or a missing deny at --inject-at (must fail)",
    )
    ap.add_argument("--inject-at", type=int, default=20)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("storm: needs root (network namespaces, nft)", file=sys.stderr)
        return 2
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 32)
    storm = Storm(args)
    started = time.monotonic()
    with _signals_raise():
        storm.run()
    t = storm.tally
    elapsed = time.monotonic() - started
    summary = {
        "seed": args.seed,
        "actions": t.actions,
        "kills": t.kills,
        "inflightKills": t.inflight_kills,
        "inflightAnswered": t.inflight_answered,
        "startupKills": t.startup_kills,
        "replays": t.replays,
        "replayedRequests": t.replayed_requests,
        "comparisons": t.comparisons,
        "restartChecks": t.restart_checks,
        "dnsQueries": t.dns_queries,
        "staleAllows": t.stale_allows,
        "missingDenies": t.missing_denies,
        "leakedObjects": t.leaked_objects,
        "restartNotHeader": t.restart_not_header,
        "instanceIdReused": t.instance_id_reused,
        "mismatches": t.mismatches,
        "injected": t.injected,
        "elapsedS": round(elapsed, 1),
    }
    if args.verbose:
        for key in sorted(storm.codes):
            print(f"storm: exercised {key}: {storm.codes[key]}")
    for line in t.details:
        print(f"storm: {line}")
    print("storm: " + " ".join(f"{k}={v}" for k, v in summary.items()))
    if args.json_out is not None:
        args.json_out.write_text(
            json.dumps(summary | {"codes": storm.codes, "details": t.details}, indent=2) + "\n"
        )
    if t.violations:
        print(f"storm: FAILED, {t.violations} violation(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
