"""DNS-learned leases against the real kernel (docs/reference/behaviour.md §14.1, 14.4, 14.6; §7, §9).

Each test tries to break one property with real packets from sandbox namespaces: narrowing
a policy (SET_BINDING in place, the fleet ``/policy`` route, an always-rules reload) must take
the addresses that only a now-denied name taught out of the kernel's dyn sets, cut the flows
to them, and the refresh must never put them back; the per-subject lease cap bounds the dyn
sets and trims answers to what the kernel took; a narrowing the kernel refuses is reported
(/healthz 503, metric) and retried until it converges.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

from tests.kernel.test_fleet_enforcement import _rule_handle
from tests.kernel.topology import GATEWAY6, UP_NET, Daemon, Topology, envelope, nft_genid

DPR = "sandbox.data-plane-ready"
A_IP, B_IP, DEEP_IP = f"{UP_NET}.2", f"{UP_NET}.3", f"{UP_NET}.4"
MULTI_IPS = [f"{UP_NET}.5", f"{UP_NET}.6", f"{UP_NET}.7"]  # multi.test (topology.ZONE)
V6_IP = "fd00:204::2"  # v6.test
DYN4 = "subj_s_sb1_dyn_v4"
DYN6 = "subj_s_sb1_dyn_v6"

_ports = iter(range(18240, 18280))


def rules(*allow: str, deny: tuple[str, ...] = (), default: str = "deny") -> dict[str, object]:
    egress = [{"action": "deny", "target": t} for t in deny] + [
        {"action": "allow", "target": t} for t in allow
    ]
    return {"defaultAction": default, "egress": egress}


def bind(d: Daemon, policy: object, i: int = 1) -> tuple[int, str]:
    text = policy if policy is None else json.dumps(policy)
    return d.post(envelope("SET_BINDING", f"sb{i}", ip=Topology.sb_ip(i), policy=text))


def activate(d: Daemon, policy: dict[str, object], i: int = 1) -> None:
    assert bind(d, policy, i) == (200, "{}")
    assert d.post(envelope("LIFECYCLE_HOOK", f"sb{i}", hook=DPR)) == (200, "{}")


@contextlib.contextmanager
def own_daemon(topo: Topology, name: str, env: dict[str, str]) -> Iterator[Daemon]:
    d = Daemon(topo, table=f"egt-{name}", port=next(_ports), env=env).start()
    try:
        yield d
    finally:
        d.kill(15)
        topo.ns(topo.pod, "nft", "delete", "table", "inet", d.table, check=False)


def set_json(d: Daemon, name: str) -> dict[str, Any]:
    out = d.nft("-j", "list", "set", "inet", d.table, name)
    for item in json.loads(out)["nftables"]:
        if "set" in item:
            return dict(item["set"])
    raise AssertionError(f"no set {name} in {out}")


def dyn_expiries(d: Daemon, name: str = DYN4) -> dict[str, int | None]:
    """The addresses the kernel's dyn set holds right now -> seconds left (None: unknown)."""
    out: dict[str, int | None] = {}
    for e in set_json(d, name).get("elem", []):
        if isinstance(e, dict) and "elem" in e:
            out[str(e["elem"]["val"])] = e["elem"].get("expires")
        else:
            out[str(e)] = None
    return out


def dyn(d: Daemon, name: str = DYN4) -> set[str]:
    return set(dyn_expiries(d, name))


def _keepalive(topo: Topology, sb: int, ip: str, seconds: float = 2.5) -> Any:
    """ONE connection from sandbox ``sb`` to ``ip``:80 reused every 0.2 s; prints ok/dead per
    request (tests/kernel/test_fleet_enforcement.py's, shorter)."""
    return topo.spawn(
        topo.sb(sb),
        "python3",
        "-c",
        (
            "import socket,time\n"
            f"s=socket.create_connection(('{ip}',80),timeout=1)\n"
            "print('up',flush=True)\n"
            f"end=time.time()+{seconds}\n"
            "while time.time()<end:\n"
            "  try:\n"
            "    s.sendall(b'GET /keep HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'); d=s.recv(65536)\n"
            "    print('ok' if d else 'dead',flush=True)\n"
            "  except OSError:\n"
            "    print('dead',flush=True)\n"
            "  time.sleep(0.2)\n"
        ),
        ready_line="up",
    )


def explain(d: Daemon, i: int, target: str) -> dict[str, Any]:
    code, body = d.get(f"/v1/explain?ip={Topology.sb_ip(i)}&target={target}")
    assert code == 200, body
    return dict(json.loads(body))


def policy_route(d: Daemon, method: str, body: object, uid: str = "sb1") -> tuple[int, str]:
    path = d.topo.workdir / "policy-route.json"
    path.write_text(json.dumps(body))
    url = f"http://127.0.0.1:{d.port}/v1/sandboxfleets/{uid}/egress/policy"
    return d._curl("-X", method, "-H", "Content-Type: application/json", "--data-binary", f"@{path}", url)


def metric(d: Daemon, name: str) -> float:
    code, body = d.get("/metrics")
    assert code == 200
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def wait_until(cond: Any, what: str, timeout: float = 8.0, d: Daemon | None = None) -> None:
    deadline = time.monotonic() + timeout
    for _ in range(1000):
        if cond():
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}" + (": " + d.log_text()[-1500:] if d else ""))


def verdict(holder: Any) -> list[str]:
    out, _ = holder.communicate(timeout=20)
    results = out.split()
    assert "ok" in results, "the keep-alive flow never worked: " + out
    return list(results)


# ---- 14.1: narrowing by name ---------------------------------------------------------------------


def test_in_place_deny_all_revokes_the_learned_address_and_cuts_its_flow(
    topo: Topology, daemon: Daemon
) -> None:
    activate(daemon, rules("a.test"))
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    assert topo.reaches(1, A_IP)
    assert dyn(daemon) == {A_IP}
    assert explain(daemon, 1, A_IP)["decision"] == "allow"
    holder = _keepalive(topo, 1, A_IP)
    time.sleep(0.5)
    # In place: same fence, the policy now allows nothing.
    assert bind(daemon, {"defaultAction": "deny"}) == (200, "{}")
    assert dyn(daemon) == set(), "the revoked address is still in the kernel's dyn set"
    assert dyn(daemon, DYN6) == set()
    assert verdict(holder)[-1] == "dead", "an established flow to the revoked address survived"
    assert not topo.reaches(1, A_IP)
    doc = explain(daemon, 1, A_IP)
    assert doc["decision"] == "deny", doc
    assert explain(daemon, 1, "a.test")["decision"] == "deny"
    assert topo.dig(1, "a.test") == ("NXDOMAIN", [])


def test_in_place_narrowing_keeps_only_what_a_still_allowed_name_taught(
    topo: Topology, daemon: Daemon
) -> None:
    activate(daemon, rules("a.test", "b.test"))
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
    assert dyn(daemon) == {A_IP, B_IP}
    cut, kept = _keepalive(topo, 1, A_IP), _keepalive(topo, 1, B_IP)
    time.sleep(0.5)
    before = dyn_expiries(daemon)[B_IP]
    assert bind(daemon, rules("b.test")) == (200, "{}")
    after = dyn_expiries(daemon)
    assert set(after) == {B_IP}, "only the still-allowed name's address may survive"
    # The kept lease is re-added with what was left of it (seconds), not the set's 6 min default.
    # (mypy does not narrow a dict item by its "is not None".)
    assert before is not None and after[B_IP] is not None and after[B_IP] <= before + 1, (before, after)  # type: ignore[operator]
    assert verdict(cut)[-1] == "dead", "an established flow to the revoked address survived"
    kept_results = verdict(kept)
    assert "dead" not in kept_results, "a flow to a still-allowed name's address was cut"
    assert not topo.reaches(1, A_IP)
    assert topo.reaches(1, B_IP)
    assert explain(daemon, 1, A_IP)["decision"] == "deny"
    assert explain(daemon, 1, B_IP)["decision"] == "allow"


def test_policy_route_delete_and_patch_revoke_learned_addresses(topo: Topology, daemon: Daemon) -> None:
    activate(daemon, rules("a.test", "b.test", "deep.test"))
    for name, ip in (("a.test", A_IP), ("b.test", B_IP), ("deep.test", DEEP_IP)):
        assert topo.dig(1, name) == ("NOERROR", [ip])
    assert dyn(daemon) == {A_IP, B_IP, DEEP_IP}
    holder = _keepalive(topo, 1, A_IP)
    time.sleep(0.5)
    # DELETE removes the name's rule: its address leaves the kernel, its flow is cut.
    code, body = policy_route(daemon, "DELETE", ["a.test"])
    assert code == 200, body
    assert dyn(daemon) == {B_IP, DEEP_IP}
    assert verdict(holder)[-1] == "dead", "an established flow to the revoked address survived"
    assert not topo.reaches(1, A_IP)
    # PATCH turning a name into a deny does the same.
    code, body = policy_route(daemon, "PATCH", [{"action": "deny", "target": "b.test"}])
    assert code == 200, body
    assert dyn(daemon) == {DEEP_IP}
    assert not topo.reaches(1, B_IP)
    assert explain(daemon, 1, B_IP)["decision"] == "deny"
    # The name stays allowed but its address is now denied: the lease leaves as well.
    code, body = policy_route(daemon, "PATCH", [{"action": "deny", "target": DEEP_IP}])
    assert code == 200, body
    assert dyn(daemon) == set(), "a lease whose address the new policy denies stayed in the dyn set"
    assert not topo.reaches(1, DEEP_IP)


def test_an_address_two_names_taught_stays_while_one_of_them_is_allowed(
    topo: Topology, daemon: Daemon
) -> None:
    activate(daemon, rules("b.test", "secret-exfil.test"))  # both names answer B_IP
    assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
    assert topo.dig(1, "secret-exfil.test") == ("NOERROR", [B_IP])
    assert bind(daemon, rules("b.test")) == (200, "{}")
    assert dyn(daemon) == {B_IP} and topo.reaches(1, B_IP)
    # The remaining name goes too: the address was taught by nobody still allowed. Allowing
    # the other name again does not bring it back: that name was forgotten with the change.
    assert bind(daemon, rules("secret-exfil.test")) == (200, "{}")
    assert dyn(daemon) == set()
    assert not topo.reaches(1, B_IP)


def test_narrowing_revokes_ipv6_leases(topo: Topology, daemon: Daemon) -> None:
    code, body = daemon.post(
        envelope(
            "SET_BINDING",
            "v6",
            ip=topo.sb_ip6(2),
            gateway=GATEWAY6,
            policy=json.dumps(rules("v6.test", "a.test")),
        )
    )
    assert (code, body) == (200, "{}")
    assert daemon.post(envelope("LIFECYCLE_HOOK", "v6", hook=DPR)) == (200, "{}")
    assert topo.dig(2, "v6.test", "AAAA", server=GATEWAY6) == ("NOERROR", [V6_IP])
    assert dyn(daemon, "subj_s_v6_dyn_v6") == {V6_IP}
    assert topo.reaches(2, V6_IP)
    code, body = daemon.post(
        envelope("SET_BINDING", "v6", ip=topo.sb_ip6(2), gateway=GATEWAY6, policy=json.dumps(rules("a.test")))
    )
    assert (code, body) == (200, "{}")
    assert dyn(daemon, "subj_s_v6_dyn_v6") == set()
    assert not topo.reaches(2, V6_IP)


def test_always_deny_reload_of_a_name_revokes_its_learned_address(topo: Topology) -> None:
    rules_dir = topo.workdir / "always-leases"
    rules_dir.mkdir(exist_ok=True)
    (rules_dir / "deny.always").unlink(missing_ok=True)
    env = {"EGRESSD_ALWAYS_RULES_DIR": str(rules_dir), "EGRESSD_ALWAYS_RULES_RELOAD_INTERVAL": "1"}
    with own_daemon(topo, "lease-always", env) as d:
        activate(d, rules("a.test", "b.test"))
        assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
        assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
        holder = _keepalive(topo, 1, A_IP)
        time.sleep(0.5)
        # Only the NAME is denied (not its address): the lease it taught must go anyway.
        (rules_dir / "deny.always").write_text("a.test\n")
        wait_until(lambda: topo.dig(1, "a.test")[0] == "NXDOMAIN", "the reload", d=d)
        assert dyn(d) == {B_IP}, "the always-denied name's address is still in the dyn set"
        assert verdict(holder)[-1] == "dead", "an established flow to the always-denied name survived"
        assert not topo.reaches(1, A_IP)
        assert topo.reaches(1, B_IP)


# ---- 14.1 / §9: the refresh never renews a revoked address ---------------------------------------


def test_refresh_never_renews_an_address_no_allowed_name_taught(topo: Topology) -> None:
    env = {"EGRESSD_DNS_LEASE_MIN": "3", "EGRESSD_DNS_LEASE_MAX": "3", "EGRESSD_REFRESH_INTERVAL": "1"}
    with own_daemon(topo, "lease-refresh", env) as d:
        activate(d, rules("a.test", "b.test", A_IP + "/32"))
        assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
        # A live flow to the address; the new policy still allows the address literally (so
        # the flow is not cut and the refresh sees it active), but no longer the name.
        holder = topo.spawn(
            topo.sb(1),
            "python3",
            "-c",
            (
                "import socket,time\n"
                f"s=socket.create_connection(('{A_IP}',8080),timeout=2)\n"
                "s.sendall(b'GET /hold HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'); s.recv(4096)\n"
                "print('held',flush=True); time.sleep(7)\n"
            ),
            ready_line="held",
        )
        try:
            assert dyn(d) == {A_IP}
            assert bind(d, rules("b.test", A_IP + "/32")) == (200, "{}")
            assert dyn(d) == set()
            deadline = time.monotonic() + 4.5  # > the 3 s lease, several refresh ticks
            while time.monotonic() < deadline:
                assert A_IP not in dyn(d), "the refresh renewed an address only a denied name taught"
                time.sleep(0.25)
            assert topo.reaches(1, A_IP, port=8080)  # the literal allow still works
            # Allowing the name again does not resurrect the forgotten lease by itself.
            assert bind(d, rules("a.test", "b.test")) == (200, "{}")
            assert A_IP not in dyn(d)
        finally:
            topo.stop(holder)


# ---- 14.4: bounded state -------------------------------------------------------------------------


def test_lease_cap_sizes_the_dyn_sets_and_refuses_the_answer_that_does_not_fit(topo: Topology) -> None:
    with own_daemon(topo, "lease-cap", {"EGRESSD_MAX_LEASES_PER_SUBJECT": "2"}) as d:
        activate(d, rules("a.test", "b.test", "deep.test", "multi.test"))
        assert set_json(d, DYN4).get("size") == 2, set_json(d, DYN4)
        assert set_json(d, DYN6).get("size") == 2, set_json(d, DYN6)
        assert "size 2" in d.nft("list", "set", "inet", d.table, DYN4)
        assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
        assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
        status, answers = topo.dig(1, "deep.test")
        assert status == "SERVFAIL" and DEEP_IP not in answers, (status, answers)
        assert dyn(d) == {A_IP, B_IP}
        assert topo.reaches(1, A_IP) and topo.reaches(1, B_IP)
        assert not topo.reaches(1, DEEP_IP)
        # A renewal of a held address always fits.
        assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
        assert topo.dig(1, "multi.test")[0] == "SERVFAIL"
        assert not any(topo.reaches(1, ip, timeout=0.5) for ip in MULTI_IPS)
        # A narrowing frees the revoked leases' room, in the book and in the kernel alike.
        assert bind(d, rules("b.test", "deep.test")) == (200, "{}")
        assert topo.dig(1, "deep.test") == ("NOERROR", [DEEP_IP]), d.log_text()[-1500:]
        assert dyn(d) == {B_IP, DEEP_IP}
        assert topo.reaches(1, DEEP_IP) and not topo.reaches(1, A_IP)
        assert "size 2" in d.nft("list", "set", "inet", d.table, DYN4)


def test_lease_cap_trims_a_multi_address_answer_to_what_the_kernel_took(topo: Topology) -> None:
    with own_daemon(topo, "lease-trim", {"EGRESSD_MAX_LEASES_PER_SUBJECT": "2"}) as d:
        activate(d, rules("a.test", "multi.test"))
        status, answers = topo.dig(1, "multi.test")
        assert status == "NOERROR"
        assert len(answers) == 2 and set(answers) <= set(MULTI_IPS), answers
        assert dyn(d) == set(answers), "the reply carries an address the kernel does not hold"
        (dropped,) = set(MULTI_IPS) - set(answers)
        assert all(topo.reaches(1, ip) for ip in answers)
        assert not topo.reaches(1, dropped)
        # The cap is full: a one-address answer for another allowed name does not fit.
        assert topo.dig(1, "a.test")[0] == "SERVFAIL"
        assert not topo.reaches(1, A_IP)
        # Over TCP the same.
        status, answers_tcp = topo.dig(1, "multi.test", tcp=True)
        assert status == "NOERROR" and set(answers_tcp) == set(answers)


def test_expired_leases_free_room_under_the_cap(topo: Topology) -> None:
    env = {
        "EGRESSD_MAX_LEASES_PER_SUBJECT": "2",
        "EGRESSD_DNS_LEASE_MIN": "2",
        "EGRESSD_DNS_LEASE_MAX": "2",
    }
    with own_daemon(topo, "lease-expire", env) as d:
        activate(d, rules("a.test", "b.test", "deep.test"))
        assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
        assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
        assert topo.dig(1, "deep.test")[0] == "SERVFAIL"
        # After the 2 s leases (and the book's grace) the cap has room again: the kernel must
        # agree with the book, or the new answer would fail with a full set.
        time.sleep(4.5)
        assert dyn(d) == set()
        assert topo.dig(1, "deep.test") == ("NOERROR", [DEEP_IP]), d.log_text()[-1500:]
        assert topo.reaches(1, DEEP_IP)
        assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
        assert topo.dig(1, "b.test")[0] == "SERVFAIL"


# ---- 14.6: a refused narrowing is reported and retried -------------------------------------------


def _sabotage_v6_allow_set(d: Daemon) -> str:
    """A real kernel refusal (as in test_fleet_enforcement): take away the subject's v6 allow
    set (and the one rule naming it), so any swap or flush naming it fails. Returns the rule."""
    rule = "ip6 daddr @subj_s_sb1_allow_v6 meta mark set 0x00000002"
    handle = _rule_handle(d, "mark_s_sb1", rule)
    d.nft("delete", "rule", "inet", d.table, "mark_s_sb1", "handle", handle)
    d.nft("delete", "set", "inet", d.table, "subj_s_sb1_allow_v6")
    return rule


def _repair_v6_allow_set(d: Daemon, rule: str) -> None:
    d.nft("add", "set", "inet", d.table, "subj_s_sb1_allow_v6", "{ type ipv6_addr; flags interval; }")
    d.nft("add", "rule", "inet", d.table, "mark_s_sb1", *rule.split())


def test_refused_narrowing_swap_is_reported_and_retried_until_revoked(topo: Topology, daemon: Daemon) -> None:
    # The v6 allow rule: the narrowing rewrites the sabotaged set (a swap leaves the sets whose
    # content does not change alone, so a change of names alone would not name it).
    activate(daemon, rules("a.test", "b.test", "2001:db8:ffff::1"))
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    rule = _sabotage_v6_allow_set(daemon)
    code, body = bind(daemon, rules("b.test"))
    assert code == 500, body
    code, body = daemon.get("/healthz")
    assert code == 503 and "revocation pending: s-sb1" in body, (code, body)
    assert metric(daemon, "egressd_revocations_pending") == 1
    _repair_v6_allow_set(daemon, rule)
    # egressd retries by itself (backoff up to 5 s): no Fastlet retry here.
    wait_until(lambda: daemon.get("/healthz")[0] == 200, "the retried revocation", timeout=12, d=daemon)
    assert metric(daemon, "egressd_revocations_pending") == 0
    assert dyn(daemon) == set()
    assert not topo.reaches(1, A_IP)
    assert topo.dig(1, "a.test") == ("NXDOMAIN", [])
    assert topo.dig(1, "b.test") == ("NOERROR", [B_IP])
    assert topo.reaches(1, B_IP)


def test_refused_revert_is_reported_denies_dns_and_converges(topo: Topology, daemon: Daemon) -> None:
    activate(daemon, rules("a.test"))
    assert topo.dig(1, "a.test") == ("NOERROR", [A_IP])
    rule = _sabotage_v6_allow_set(daemon)
    code, body = bind(daemon, None)
    assert code == 500, body
    code, body = daemon.get("/healthz")
    assert code == 503 and "revocation pending: s-sb1" in body, (code, body)
    # While the kernel still holds the old state, DNS already answers as denying and learns nothing.
    assert topo.dig(1, "a.test") == ("NXDOMAIN", [])
    _repair_v6_allow_set(daemon, rule)
    wait_until(lambda: daemon.get("/healthz")[0] == 200, "the retried revert", timeout=12, d=daemon)
    assert metric(daemon, "egressd_revocations_pending") == 0
    assert dyn(daemon) == set()
    assert not topo.reaches(1, A_IP)
    # The Fastlet's own retry of the same action converges too (idempotent).
    assert bind(daemon, None)[0] == 200


def test_a_few_thousand_records_over_tcp_are_learned_up_to_the_cap_in_one_transaction(
    topo: Topology,
) -> None:
    """docs/reference/behaviour.md §14.4 x 14.5: big.test answers 3000 A records (over TCP only: far past any
    UDP size); with a cap of 2500 the kernel takes 2500 in one transaction and the reply
    carries exactly those."""
    with own_daemon(topo, "lease-big", {"EGRESSD_MAX_LEASES_PER_SUBJECT": "2500"}) as d:
        activate(d, rules("big.test"))
        before = nft_genid(topo, topo.pod)
        status, answers = topo.dig(1, "big.test", tcp=True)
        after = nft_genid(topo, topo.pod)
        assert status == "NOERROR"
        assert len(answers) == 2500 == len(set(answers)), len(answers)
        held = dyn(d)
        assert held == set(answers), "the reply and the kernel's dyn set differ"
        assert after - before == 1, "the answer was not learned in exactly one transaction"
        assert "size 2500" in d.nft("list", "set", "inet", d.table, DYN4)
        if A_IP in answers:
            assert topo.reaches(1, A_IP)
