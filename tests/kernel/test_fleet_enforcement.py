"""Fleet enforcement against the real kernel, with real connections from sandbox namespaces."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest

from tests.kernel.topology import GATEWAY, UPSTREAM_IPS, Daemon, Topology, envelope

UP_A, UP_B, UP_C, UP_D = UPSTREAM_IPS[0], UPSTREAM_IPS[1], UPSTREAM_IPS[2], UPSTREAM_IPS[3]
DPR = "sandbox.data-plane-ready"


def allow_ips(*ips: str, deny: tuple[str, ...] = ()) -> dict[str, object]:
    rules = [{"action": "allow", "target": ip} for ip in ips] + [
        {"action": "deny", "target": ip} for ip in deny
    ]
    return {"defaultAction": "deny", "egress": rules}


def bind(
    d: Daemon, i: int, policy: object, *, uid: str | None = None, rid: str = "r1", aid: str = "a1"
) -> None:
    code, body = d.post(
        envelope("SET_BINDING", uid or f"sb{i}", rid=rid, aid=aid, ip=Topology.sb_ip(i), policy=policy)
    )
    assert (code, body) == (200, "{}"), body


def activate(d: Daemon, uid: str, *, rid: str = "r1", aid: str = "a1") -> None:
    code, body = d.post(envelope("LIFECYCLE_HOOK", uid, rid=rid, aid=aid, hook=DPR))
    assert (code, body) == (200, "{}"), body


def test_unknown_and_denying_sources_reach_nothing(topo: Topology, daemon: Daemon) -> None:
    # sb1 never registered; sb2 registered but not yet data-plane-ready.
    bind(daemon, 2, allow_ips(UP_A))
    assert not topo.reaches(1, UP_A)
    assert not topo.reaches(2, UP_A)
    assert not topo.reaches(2, UP_B)


def test_active_subject_reaches_exactly_its_allowed_ips(topo: Topology, daemon: Daemon) -> None:
    policy = {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": UP_A},
            {"action": "allow", "target": "10.204.0.0/29"},  # .0-.7: UP_B..UP_F
            {"action": "deny", "target": UP_C},  # deny beats allow at the IP layer
        ],
    }
    bind(daemon, 1, policy)
    activate(daemon, "sb1")
    assert topo.reaches(1, UP_A)
    assert topo.reaches(1, UP_B)
    assert not topo.reaches(1, UP_C)
    assert not topo.reaches(1, UPSTREAM_IPS[6])  # .8, outside the /29
    assert topo.reaches(1, UP_A, port=8080)
    # Unknown source and another sandbox with no binding stay closed.
    assert not topo.reaches(3, UP_A)


def test_sibling_policies_are_isolated_and_sandboxes_cannot_reach_each_other(
    topo: Topology, daemon: Daemon
) -> None:
    bind(daemon, 1, allow_ips(UP_A))
    bind(daemon, 2, allow_ips(UP_B))
    activate(daemon, "sb1")
    activate(daemon, "sb2")
    assert topo.reaches(1, UP_A) and not topo.reaches(1, UP_B)
    assert topo.reaches(2, UP_B) and not topo.reaches(2, UP_A)
    # Bridged sandbox-to-sandbox traffic is forwarded through the hook and dropped.
    topo.spawn(topo.sb(2), "python3", "-m", "http.server", "8000", "--bind", topo.sb_ip(2))
    time.sleep(0.3)
    assert topo.curl(1, f"http://{topo.sb_ip(2)}:8000/") == 0


def test_default_allow_with_ip_deny(topo: Topology, daemon: Daemon) -> None:
    bind(daemon, 1, {"defaultAction": "allow", "egress": [{"action": "deny", "target": UP_B}]})
    activate(daemon, "sb1")
    assert topo.reaches(1, UP_A)
    assert not topo.reaches(1, UP_B)


def test_policy_update_applies_in_place_and_null_closes(topo: Topology, daemon: Daemon) -> None:
    bind(daemon, 1, allow_ips(UP_A))
    activate(daemon, "sb1")
    assert topo.reaches(1, UP_A)

    # In-place update: same fence, new policy, no hook needed; no window where both apply.
    bind(daemon, 1, allow_ips(UP_B))
    assert topo.reaches(1, UP_B)
    assert not topo.reaches(1, UP_A)

    # Updates while traffic flows: every probe is either the old or the new policy.
    for n in range(5):
        target = [UP_A, UP_B][n % 2]
        bind(daemon, 1, allow_ips(target))
        assert topo.reaches(1, target)

    # SET_BINDING(null) reverts to deny-first.
    code, body = daemon.post(envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy=None))
    assert code == 200, body
    assert not topo.reaches(1, UP_A)
    assert not topo.reaches(1, UP_B)
    # And a later data-plane-ready has nothing pending.
    code, _ = daemon.post(envelope("LIFECYCLE_HOOK", "sb1", hook=DPR))
    assert code == 409


def test_remove_leaves_nothing_of_the_subject_while_others_keep_working(
    topo: Topology, daemon: Daemon
) -> None:
    bind(daemon, 1, allow_ips(UP_A))
    bind(daemon, 2, allow_ips(UP_B))
    activate(daemon, "sb1")
    activate(daemon, "sb2")
    assert "subj_s_sb1_allow_v4" in daemon.object_names()
    code, body = daemon.post(envelope("REMOVE_BINDING", "sb1"))
    assert (code, body) == (200, "{}")
    names = daemon.object_names()
    assert not {n for n in names if "sb1" in n}, names
    assert topo.sb_ip(1) not in daemon.map_keys("dispatch_v4")
    assert topo.sb_ip(1) not in daemon.map_keys("marking_v4")
    assert not topo.reaches(1, UP_A)
    assert topo.reaches(2, UP_B)
    # The shared gateway redirect stays while sb2 uses it.
    assert GATEWAY in daemon.nft("list", "set", "inet", daemon.table, "dns_gw_v4")
    daemon.post(envelope("REMOVE_BINDING", "sb2"))
    assert GATEWAY not in daemon.nft("list", "set", "inet", daemon.table, "dns_gw_v4")
    assert not any(n.startswith(("subj_", "mark_")) for n in daemon.object_names())


def test_rebind_never_carries_the_old_policy_over(topo: Topology, daemon: Daemon) -> None:
    bind(daemon, 1, allow_ips(UP_A))
    activate(daemon, "sb1")
    assert topo.reaches(1, UP_A)
    # New runtime instance, same uid: denying until its own data-plane-ready.
    bind(daemon, 1, allow_ips(UP_B), rid="r2")
    assert not topo.reaches(1, UP_A)
    assert not topo.reaches(1, UP_B)
    # A delayed hook of the previous instance must not activate the new one.
    code, _ = daemon.post(envelope("LIFECYCLE_HOOK", "sb1", rid="r1", hook=DPR))
    assert code == 409
    assert not topo.reaches(1, UP_B)
    activate(daemon, "sb1", rid="r2")
    assert topo.reaches(1, UP_B)
    assert not topo.reaches(1, UP_A)


def test_rebind_to_another_ip_leaves_no_stale_dispatch(topo: Topology, daemon: Daemon) -> None:
    bind(daemon, 1, allow_ips(UP_A))
    activate(daemon, "sb1")
    # Same uid moves to sb3's address under a new attachment.
    code, body = daemon.post(
        envelope("SET_BINDING", "sb1", aid="a2", ip=topo.sb_ip(3), policy=json.dumps(allow_ips(UP_A)))
    )
    assert code == 200, body
    assert daemon.map_keys("dispatch_v4") == {topo.sb_ip(3)}
    activate(daemon, "sb1", aid="a2")
    assert topo.reaches(3, UP_A)
    assert not topo.reaches(1, UP_A)


def test_deny_first_window_never_reaches_upstream(topo: Topology, daemon: Daemon) -> None:
    bind(daemon, 4, allow_ips(UP_D))
    marker = f"/deny-first-{time.monotonic_ns()}"
    for _ in range(3):
        assert topo.curl(4, f"http://{UP_D}{marker}", timeout=0.5) == 0
    code, _ = daemon.post(envelope("LIFECYCLE_HOOK", "sb4", hook="sandbox.runtime-ready"))
    assert code == 200
    assert topo.curl(4, f"http://{UP_D}{marker}", timeout=0.5) == 0
    seen = [r for r in topo.upstream_requests() if str(r.get("path", "")).startswith(marker)]
    assert seen == [], "a request made before data-plane-ready reached the upstream"
    activate(daemon, "sb4")
    assert topo.curl(4, f"http://{UP_D}{marker}-after") == 200
    assert [r["client"] for r in topo.upstream_requests() if str(r.get("path", "")).startswith(marker)] == [
        topo.sb_ip(4)
    ]


def test_nft_failure_leaves_subject_denying_and_retry_converges(topo: Topology, daemon: Daemon) -> None:
    # A real kernel refusal: an object with the subject's set name but the wrong type.
    daemon.nft("add", "set", "inet", daemon.table, "subj_s_sb1_allow_v4", "{ type inet_service; }")
    code, body = daemon.post(
        envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy=json.dumps(allow_ips(UP_A)))
    )
    assert code == 500, body
    assert body.startswith("deny-first install:")
    assert not topo.reaches(1, UP_A)
    code, _ = daemon.post(envelope("LIFECYCLE_HOOK", "sb1", hook=DPR))
    assert code in (409, 500)
    assert not topo.reaches(1, UP_A)
    daemon.nft("delete", "set", "inet", daemon.table, "subj_s_sb1_allow_v4")
    # The Fastlet retries the same action; it converges.
    code, body = daemon.post(
        envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy=json.dumps(allow_ips(UP_A)))
    )
    assert (code, body) == (200, "{}")
    activate(daemon, "sb1")
    assert topo.reaches(1, UP_A)


def test_failed_activation_keeps_pending_and_retry_succeeds(topo: Topology, daemon: Daemon) -> None:
    bind(daemon, 1, allow_ips(UP_A))
    # Sabotage for a real kernel refusal: take away the v4 allow set (and the one rule that
    # references it), so the activation's fill (adds only: deny-first sets are empty) names a
    # set that does not exist.
    rule = "ip daddr @subj_s_sb1_allow_v4 meta mark set 0x00000002"
    handle = _rule_handle(daemon, "mark_s_sb1", rule)
    daemon.nft("delete", "rule", "inet", daemon.table, "mark_s_sb1", "handle", handle)
    daemon.nft("delete", "set", "inet", daemon.table, "subj_s_sb1_allow_v4")
    code, body = daemon.post(envelope("LIFECYCLE_HOOK", "sb1", hook=DPR))
    assert code == 500, body
    assert not topo.reaches(1, UP_A)
    # Repair, then the retried hook activates the same (kept) pending policy.
    daemon.nft(
        "add", "set", "inet", daemon.table, "subj_s_sb1_allow_v4", "{ type ipv4_addr; flags interval; }"
    )
    daemon.nft("add", "rule", "inet", daemon.table, "mark_s_sb1", *rule.split())
    activate(daemon, "sb1")
    assert topo.reaches(1, UP_A)
    # And a second retry of the same hook is idempotent.
    activate(daemon, "sb1")


def _rule_handle(d: Daemon, chain: str, text: str) -> str:
    for line in d.nft("-a", "list", "chain", "inet", d.table, chain).splitlines():
        if text in line and "# handle" in line:
            return line.rsplit("# handle", 1)[1].strip()
    raise AssertionError(f"rule {text!r} not found in {chain}")


def test_kill9_restart_resets_then_replay_restores(topo: Topology, daemon: Daemon) -> None:
    bind(daemon, 1, allow_ips(UP_A))
    bind(daemon, 2, allow_ips(UP_B))
    activate(daemon, "sb1")
    before_id = daemon.status()["instanceId"]
    assert topo.reaches(1, UP_A) and not topo.reaches(2, UP_B)
    before = _normalised_table(daemon)

    daemon.kill(signal.SIGKILL)
    # Dead daemon: the table stays and keeps enforcing.
    assert topo.reaches(1, UP_A) and not topo.reaches(2, UP_B)
    daemon.start(wait=False)
    # The moment HTTP answers, the table is already reset to the deny-all header.
    deadline = time.monotonic() + 15
    while daemon.get("/healthz")[0] != 200:
        assert time.monotonic() < deadline, daemon.log_text()
        time.sleep(0.02)
    assert not any(n.startswith(("subj_", "mark_")) for n in daemon.object_names())
    assert not topo.reaches(1, UP_A)
    after_id = daemon.status()["instanceId"]
    assert after_id != before_id

    # The Fastlet replays the latest SET_BINDING and the reached hooks per live sandbox.
    bind(daemon, 1, allow_ips(UP_A))
    bind(daemon, 2, allow_ips(UP_B))
    activate(daemon, "sb1")
    assert _normalised_table(daemon) == before
    assert topo.reaches(1, UP_A) and not topo.reaches(2, UP_B)


def _normalised_table(d: Daemon) -> list[str]:
    items = []
    for item in d.table_json():
        for kind, obj in item.items():
            if kind == "metainfo" or not isinstance(obj, dict):
                continue
            # Counter values are traffic, not state (docs/reference/behaviour.md §15 counts every refusal).
            o = {
                k: v
                for k, v in obj.items()
                if k != "handle" and not (kind == "counter" and k in ("packets", "bytes"))
            }
            if "elem" in o:
                o["elem"] = sorted(json.dumps(e, sort_keys=True) for e in o["elem"])
            items.append(json.dumps({kind: o}, sort_keys=True))
    return sorted(items)


def _with_deep(policy: dict[str, object]) -> dict[str, object]:
    """``policy`` plus an allow of deep.test (topology.ZONE: its A record is UP_C)."""
    rules = [*policy["egress"], {"action": "allow", "target": "deep.test"}]  # type: ignore[misc]
    return {**policy, "egress": rules}


def test_other_subjects_changes_never_touch_a_subjects_leases(topo: Topology, daemon: Daemon) -> None:
    bind(daemon, 1, _with_deep(allow_ips()))
    activate(daemon, "sb1")
    # A DNS-learned lease, taught by deep.test through the DNS proxy.
    assert topo.dig(1, "deep.test") == ("NOERROR", [UP_C])
    assert topo.reaches(1, UP_C)
    # Add, update, rebind and remove other subjects; sb1's lease and access must survive.
    bind(daemon, 2, allow_ips(UP_A))
    activate(daemon, "sb2")
    bind(daemon, 2, allow_ips(UP_B))
    bind(daemon, 3, allow_ips(UP_A))
    bind(daemon, 3, allow_ips(UP_A), rid="r2")
    assert daemon.post(envelope("REMOVE_BINDING", "sb2"))[0] == 200
    assert daemon.post(envelope("REMOVE_BINDING", "sb3", rid="r2"))[0] == 200
    # An in-place policy update of sb1 itself keeps the leases of names it still allows
    # (docs/reference/behaviour.md §14.1: those of names it no longer allows go with the update).
    bind(daemon, 1, _with_deep(allow_ips(UP_D)))
    assert UP_C in daemon.nft("list", "set", "inet", daemon.table, "subj_s_sb1_dyn_v4")
    assert topo.reaches(1, UP_C)
    assert topo.reaches(1, UP_D)


def test_in_place_updates_have_no_transient_window(topo: Topology, daemon: Daemon) -> None:
    """Probe continuously while the policy flips between {A} and {A, B}.

    A is allowed by both versions, so every probe to A must pass (no transient closure);
    C is allowed by neither, so no probe to C may pass (no transient opening).
    """
    bind(daemon, 1, allow_ips(UP_A))
    activate(daemon, "sb1")
    script = (
        "import socket,sys,time\n"
        "ok=bad=0\n"
        "end=time.time()+float(sys.argv[1])\n"
        "while time.time()<end:\n"
        "  for ip,want in ((sys.argv[2],True),(sys.argv[3],False)):\n"
        "    s=socket.socket(); s.settimeout(0.3)\n"
        "    try:\n"
        "      s.connect((ip,80)); got=True\n"
        "    except OSError:\n"
        "      got=False\n"
        "    s.close()\n"
        "    if got==want: ok+=1\n"
        "    else: bad+=1; print('WRONG',ip,got,flush=True)\n"
        "print('DONE',ok,bad,flush=True)\n"
    )
    prober = topo.spawn(topo.sb(1), "python3", "-c", script, "4", UP_A, UP_C)
    deadline = time.monotonic() + 3.5
    flips = 0
    while time.monotonic() < deadline and flips < 200:
        bind(daemon, 1, allow_ips(UP_A, UP_B) if flips % 2 == 0 else allow_ips(UP_A))
        flips += 1
    out, _ = prober.communicate(timeout=15)
    assert flips >= 10
    assert "WRONG" not in out, out
    ok = int(out.split("DONE")[1].split()[0])
    assert ok > 10, out


def test_revert_cuts_established_flows(topo: Topology, daemon: Daemon) -> None:
    bind(daemon, 1, allow_ips(UP_A))
    activate(daemon, "sb1")
    # One keep-alive connection, used every 0.2 s; it prints whether each request got through.
    holder = _keepalive(topo, 1, UP_A)
    time.sleep(1.0)
    code, _ = daemon.post(envelope("SET_BINDING", "sb1", ip=topo.sb_ip(1), policy=None))
    assert code == 200
    out, _ = holder.communicate(timeout=15)
    results = out.split()
    assert "ok" in results, out
    assert results[-1] == "dead", "the established flow survived the revert: " + out


def test_no_lateral_movement_even_with_allow_all_or_a_covering_cidr(topo: Topology, daemon: Daemon) -> None:
    bind(daemon, 1, {"defaultAction": "allow", "egress": []})
    bind(daemon, 2, allow_ips("10.203.0.0/24", UP_A))
    activate(daemon, "sb1")
    activate(daemon, "sb2")
    topo.spawn(topo.sb(3), "python3", "-m", "http.server", "8000", "--bind", topo.sb_ip(3))
    bind(daemon, 3, allow_ips(UP_A))
    activate(daemon, "sb3")
    time.sleep(0.3)
    assert topo.reaches(1, UP_B), "allow-all still reaches the internet"
    assert topo.reaches(2, UP_A)
    # ... but never another sandbox: neither via allow-all nor via a CIDR covering the subnet.
    assert topo.curl(1, f"http://{topo.sb_ip(3)}:8000/") == 0
    assert topo.curl(2, f"http://{topo.sb_ip(3)}:8000/") == 0


def test_in_place_narrowing_cuts_only_disallowed_flows(topo: Topology, daemon: Daemon) -> None:
    bind(daemon, 1, allow_ips(UP_A, UP_B))
    activate(daemon, "sb1")

    kept, dropped = _keepalive(topo, 1, UP_A), _keepalive(topo, 1, UP_B)
    time.sleep(1.0)
    bind(daemon, 1, allow_ips(UP_A))  # in place: B is no longer allowed
    kept_out, _ = kept.communicate(timeout=15)
    dropped_out, _ = dropped.communicate(timeout=15)
    assert kept_out.split()[-1] == "ok", "an allowed established flow was cut: " + kept_out
    assert dropped_out.split()[-1] == "dead", "a flow to a removed destination survived: " + dropped_out


# Issue 28: an in-place change reads conntrack (and cuts) only when it takes something away.
# Each narrowing below leaves the sets' shape alone in a way a shortcut could mistake for
# "nothing refused": a deny inside a still-allowed prefix, a prefix shrinking to a part of
# itself, allow-all turned into a list; the widening must cut nothing.
NARROW_PART = [
    (allow_ips("10.204.0.0/29"), allow_ips("10.204.0.0/29", deny=(UP_B,)), "dead"),
    (allow_ips("10.204.0.0/29"), allow_ips(UP_A), "dead"),
    ({"defaultAction": "allow", "egress": []}, allow_ips(UP_A), "dead"),
    (allow_ips(UP_A, UP_B), allow_ips("10.204.0.0/29"), "ok"),
]


@pytest.mark.parametrize(("before", "after", "b_ends"), NARROW_PART)
def test_in_place_change_cuts_a_flow_exactly_when_it_refuses_its_destination(
    topo: Topology, daemon: Daemon, before: object, after: object, b_ends: str
) -> None:
    bind(daemon, 1, before)
    activate(daemon, "sb1")
    kept, other = _keepalive(topo, 1, UP_A), _keepalive(topo, 1, UP_B)
    time.sleep(1.0)
    bind(daemon, 1, after)  # in place
    kept_out, _ = kept.communicate(timeout=15)
    other_out, _ = other.communicate(timeout=15)
    assert kept_out.split()[-1] == "ok", "an allowed established flow was cut: " + kept_out
    assert other_out.split()[-1] == b_ends, f"the flow to {UP_B} should end {b_ends}: " + other_out
    assert topo.reaches(1, UP_B) is (b_ends == "ok")


def _keepalive(topo: Topology, sb: int, ip: str) -> Any:
    """A process in sandbox ``sb`` reusing ONE connection to ``ip``:80 every 0.2 s for 4 s,
    printing "ok" or "dead" per request."""
    return topo.spawn(
        topo.sb(sb),
        "python3",
        "-c",
        (
            "import socket,time\n"
            f"s=socket.create_connection(('{ip}',80),timeout=1)\n"
            "print('up',flush=True)\n"
            "end=time.time()+4\n"
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
