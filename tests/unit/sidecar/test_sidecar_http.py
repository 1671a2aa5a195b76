"""Sidecar HTTP surface (docs/reference/behaviour.md §5, §6, §13) over a SidecarEngine on a fake kernel."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from structlog.testing import capture_logs

from egressd.actionhandler.envelope import MAX_BODY_BYTES
from egressd.metrics import EgressMetrics
from egressd.policy import DENY_ALL, AlwaysRules, NetworkPolicy, Verdict, judge_domain, parse_policy
from egressd.policy.namecheck import NameReason, Wire
from egressd.sidecar import engine as engine_module
from egressd.sidecar.engine import SidecarEngine
from egressd.sidecar.http import AUTH_HEADER, SidecarHTTP, VaultPrerequisites, token_matches
from egressd.sidecarnft.ruleset import SidecarTable
from tests.unit.fakekernel import FakeTx

TOKEN = "tok-PLANTED-7c1e"
SECRET = "zz-PLANTED-SECRET-4b2d-zz"
AUTH = {AUTH_HEADER: TOKEN}


@dataclass
class Env:
    client: TestClient[Any, Any]
    engine: SidecarEngine
    kernel: FakeTx
    http: SidecarHTTP
    path: Path


def ready_prereqs(**kw: Any) -> VaultPrerequisites:
    base: dict[str, Any] = {
        "token_set": True,
        "mitm_transparent": True,
        "ssl_insecure": False,
        "mode": "dns+nft",
        "mitm_ready": lambda: True,
    }
    base.update(kw)
    return VaultPrerequisites(**base)


async def make_env(
    aiohttp_client: Any,
    tmp_path: Path,
    *,
    policy: NetworkPolicy = DENY_ALL,
    token: str | None = TOKEN,
    prereqs: VaultPrerequisites | None = None,
    max_rules: int = 4096,
    mode: str = "dns+nft",
) -> Env:
    kernel = FakeTx(yield_each_call=False)
    path = tmp_path / "policy.json"
    table = SidecarTable(table="T", mode="dns" if mode == "dns" else "dns+nft")
    engine = SidecarEngine(table, kernel, policy, persist_path=path)
    await engine.install()
    http = SidecarHTTP(
        engine,
        EgressMetrics(),
        token=token,
        max_rules=max_rules,
        prerequisites=prereqs or ready_prereqs(),
    )
    client = await aiohttp_client(http.app())
    return Env(client, engine, kernel, http, path)


@pytest.fixture
async def env(aiohttp_client: Any, tmp_path: Path) -> Env:
    return await make_env(aiohttp_client, tmp_path)


async def call(
    env: Env, method: str, path: str, body: object = None, *, raw: bytes | None = None
) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    resp = await env.client.request(method, path, data=data, headers=AUTH)
    text = await resp.text()
    if resp.content_type == "application/json":
        return resp.status, json.loads(text)
    return resp.status, text


def rules(policy: dict[str, Any]) -> list[tuple[str, str]]:
    return [(r["action"], r["target"]) for r in policy["egress"]]


# ---- auth --------------------------------------------------------------------------------------


async def test_missing_and_wrong_token_get_the_same_401(env: Env) -> None:
    for headers in ({}, {AUTH_HEADER: "nope"}, {AUTH_HEADER: ""}, {AUTH_HEADER: TOKEN + "x"}):
        for method, path in (("GET", "/policy"), ("PATCH", "/policy"), ("GET", "/credential-vault/bindings")):
            resp = await env.client.request(method, path, headers=headers, data=b"[]")
            assert resp.status == 401
            assert await resp.text() == "unauthorized\n"
    assert env.kernel.scripts[1:] == []  # nothing applied


async def test_healthz_and_metrics_need_no_token(env: Env) -> None:
    assert (await env.client.get("/healthz")).status == 200
    resp = await env.client.get("/metrics")
    assert resp.status == 200
    assert "egress_policy_denied_total" in await resp.text()
    assert TOKEN not in await resp.text()


async def test_no_token_configured_means_open_api(aiohttp_client: Any, tmp_path: Path) -> None:
    env = await make_env(aiohttp_client, tmp_path, token=None)
    assert (await env.client.get("/policy")).status == 200


def test_token_compare() -> None:
    assert token_matches(None, None)
    assert token_matches("a", "a")
    assert not token_matches("a", None)
    assert not token_matches("a", "b")
    assert not token_matches("a", "\udcff")


# ---- /policy -----------------------------------------------------------------------------------


async def test_get_policy_shape(env: Env) -> None:
    status, body = await call(env, "GET", "/policy")
    assert status == 200
    assert body == {
        "status": "ok",
        "mode": "deny_all",
        "enforcementMode": "dns+nft",
        "policy": {"defaultAction": "deny", "egress": []},
        "nameCheck": False,  # no MITM here (docs/reference/behaviour.md §18)
    }


async def test_post_and_put_replace(env: Env) -> None:
    pol = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "A.test."}]}
    for method in ("POST", "PUT"):
        status, body = await call(env, method, "/policy", pol)
        assert (status, body) == (200, {"status": "ok", "mode": "enforcing", "enforcementMode": "dns+nft"})
        _, got = await call(env, "GET", "/policy")
        assert rules(got["policy"]) == [("allow", "a.test")]


@pytest.mark.parametrize("raw", [b"", b"  ", b"{}", b"null"])
async def test_reset_bodies_mean_deny_all(env: Env, raw: bytes) -> None:
    await call(env, "POST", "/policy", {"egress": [{"action": "allow", "target": "a.test"}]})
    status, body = await call(env, "POST", "/policy", raw=raw)
    assert status == 200 and body["mode"] == "deny_all"
    if not raw.strip():
        assert body["reason"] == "policy reset to default deny-all"
    _, got = await call(env, "GET", "/policy")
    assert got["policy"] == {"defaultAction": "deny", "egress": []}


@pytest.mark.parametrize(
    ("method", "raw"),
    [
        ("POST", b"{"),
        ("POST", b"[1,2]"),
        ("POST", b'{"defaultAction":"maybe"}'),
        ("POST", b'{"egress":[{"action":"foo","target":"x.com"}]}'),
        ("POST", b'{"egress":[{"action":"allow","target":""}]}'),
        ("PUT", b'{"egress":{"action":"allow"}}'),
        ("POST", b"\xff\xfe"),
        ("PATCH", b""),
        ("PATCH", b"null"),
        ("PATCH", b"[]"),
        ("PATCH", b"{}"),
        ("PATCH", b'[{"action":"allow"}]'),
        ("PATCH", b'[{"action":"allow","target":"*"}]'),
        ("PATCH", b"[1"),
        ("DELETE", b""),
        ("DELETE", b"[]"),
        ("DELETE", b"[1]"),
        ("DELETE", b'"a.test"'),
    ],
)
async def test_malformed_bodies_are_400_one_line_and_change_nothing(
    env: Env, method: str, raw: bytes
) -> None:
    await call(env, "POST", "/policy", {"egress": [{"action": "allow", "target": "keep.test"}]})
    before = len(env.kernel.scripts)
    file_before = env.path.read_text()
    status, body = await call(env, method, "/policy", raw=raw)
    assert status == 400, body
    assert isinstance(body, str) and body.count("\n") == 1 and body.strip()
    assert len(env.kernel.scripts) == before
    assert env.path.read_text() == file_before
    _, got = await call(env, "GET", "/policy")
    assert rules(got["policy"]) == [("allow", "keep.test")]


async def test_patch_vectors(env: Env) -> None:
    status, _ = await call(
        env,
        "PATCH",
        "/policy",
        [{"action": "allow", "target": "example.com"}, {"action": "deny", "target": "example.com"}],
    )
    assert status == 200
    _, got = await call(env, "GET", "/policy")
    assert rules(got["policy"]) == [("allow", "example.com")]

    await call(
        env,
        "POST",
        "/policy",
        {"egress": [{"action": "allow", "target": "a.com"}, {"action": "allow", "target": "b.com"}]},
    )
    await call(env, "PATCH", "/policy", [{"action": "deny", "target": "A.com"}])
    _, got = await call(env, "GET", "/policy")
    assert rules(got["policy"]) == [("deny", "a.com"), ("allow", "b.com")]


async def test_patch_keeps_default_action(env: Env) -> None:
    await call(env, "POST", "/policy", {"defaultAction": "allow"})
    await call(env, "PATCH", "/policy", [{"action": "deny", "target": "evil.test"}])
    _, got = await call(env, "GET", "/policy")
    assert got["policy"]["defaultAction"] == "allow"
    assert got["mode"] == "enforcing"


async def test_delete_vectors(env: Env) -> None:
    await call(
        env,
        "POST",
        "/policy",
        {"egress": [{"action": "allow", "target": "a.com"}, {"action": "allow", "target": "b.com"}]},
    )
    status, body = await call(env, "DELETE", "/policy", ["B.COM", " "])
    assert status == 200 and "reason" not in body
    _, got = await call(env, "GET", "/policy")
    assert rules(got["policy"]) == [("allow", "a.com")]
    before = len(env.kernel.scripts)
    status, body = await call(env, "DELETE", "/policy", ["nothere.test"])
    assert status == 200 and body["reason"] == "no matching targets found"
    assert len(env.kernel.scripts) == before  # no transaction for a no-op


async def test_rule_cap_413(aiohttp_client: Any, tmp_path: Path) -> None:
    env = await make_env(aiohttp_client, tmp_path, max_rules=2)
    three = [{"action": "allow", "target": f"{i}.test"} for i in range(3)]
    reason = "policy has 3 rules, more than OPENSANDBOX_EGRESS_MAX_RULES=2\n"
    for method in ("POST", "PUT"):
        assert await call(env, method, "/policy", {"egress": three}) == (413, reason)
    assert (await call(env, "POST", "/policy", {"egress": three[:2]}))[0] == 200
    scripts = len(env.kernel.scripts)
    assert await call(env, "PATCH", "/policy", three[2:]) == (413, reason)
    assert len(env.kernel.scripts) == scripts  # refused before any transaction
    _, got = await call(env, "GET", "/policy")
    assert len(got["policy"]["egress"]) == 2


async def test_rule_cap_zero_is_unlimited(aiohttp_client: Any, tmp_path: Path) -> None:
    env = await make_env(aiohttp_client, tmp_path, max_rules=0)
    many = [{"action": "allow", "target": f"10.9.{i // 256}.{i % 256}"} for i in range(5000)]
    assert (await call(env, "POST", "/policy", {"egress": many}))[0] == 200
    _, got = await call(env, "GET", "/policy")
    assert len(got["policy"]["egress"]) == 5000


async def test_body_over_1mib_is_413(env: Env) -> None:
    status, _ = await call(env, "POST", "/policy", raw=b" " * (MAX_BODY_BYTES + 1))
    assert status == 413


async def test_other_methods_405(env: Env) -> None:
    resp = await env.client.request("OPTIONS", "/policy", headers=AUTH)
    assert resp.status == 405
    assert "PATCH" in resp.headers["Allow"]


async def test_policy_is_persisted_before_the_kernel_sees_it(env: Env) -> None:
    seen: list[str] = []
    env.kernel.on_call = lambda call: seen.append(env.path.read_text())
    await call(env, "PATCH", "/policy", [{"action": "allow", "target": "new.test"}])
    assert seen and "new.test" in seen[0]
    assert "new.test" in env.path.read_text()


async def test_kernel_failure_is_500_and_changes_nothing(env: Env) -> None:
    await call(env, "POST", "/policy", {"egress": [{"action": "allow", "target": "old.test"}]})
    file_before = env.path.read_text()
    env.kernel.fail(times=None)
    status, body = await call(env, "PATCH", "/policy", [{"action": "allow", "target": "new.test"}])
    assert status == 500 and "policy apply" in body
    env.kernel.heal()
    _, got = await call(env, "GET", "/policy")
    assert rules(got["policy"]) == [("allow", "old.test")]
    assert env.path.read_text() == file_before  # the file is put back in line with the kernel


async def test_persist_failure_is_500_before_any_kernel_change(aiohttp_client: Any, tmp_path: Path) -> None:
    env = await make_env(aiohttp_client, tmp_path)
    env.engine.persist_path = tmp_path / "missing-dir" / "policy.json"
    before = len(env.kernel.scripts)
    status, body = await call(env, "POST", "/policy", {"defaultAction": "allow"})
    assert status == 500 and "persist" in body
    assert len(env.kernel.scripts) == before
    assert env.engine.user == DENY_ALL


async def test_every_change_is_one_wholesale_rebuild(env: Env) -> None:
    await call(env, "POST", "/policy", {"egress": [{"action": "allow", "target": "10.0.0.0/24"}]})
    op, script = env.kernel.scripts[-1]
    assert op == "static_apply"
    assert script.startswith("add table inet T\ndelete table inet T\nadd table inet T\n")
    assert "elements = { 10.0.0.0/24 }" in script


async def test_mode_dns_reports_enforcement_mode(aiohttp_client: Any, tmp_path: Path) -> None:
    env = await make_env(aiohttp_client, tmp_path, mode="dns")
    _, body = await call(env, "GET", "/policy")
    assert body["enforcementMode"] == "dns"


# ---- DNS side ----------------------------------------------------------------------------------


async def test_every_client_is_the_implicit_subject_and_learning_follows_the_policy(env: Env) -> None:
    await call(env, "POST", "/policy", {"egress": [{"action": "allow", "target": "a.test"}]})
    asker = env.engine.asker(ip_address("10.0.0.99"))
    assert asker.policy is not None and [r.target for r in asker.policy.egress] == ["a.test"]
    assert env.engine.asker(ip_address("127.0.0.1")).uid == asker.uid
    a_ip, b_ip = ip_address("10.204.0.2"), ip_address("10.204.0.3")
    await env.engine.learn(asker.uid, asker.fence, [(a_ip, 90)], "A.test.")
    assert "10.204.0.2 timeout 90s expires 90s" in env.kernel.scripts[-1][1]
    # A rebuild keeps a lease whose name is still allowed ...
    await call(env, "PATCH", "/policy", [{"action": "allow", "target": "b.test"}])
    assert "10.204.0.2 timeout" in env.kernel.scripts[-1][1]
    # ... and an answer that raced the change is decided under the new policy.
    await env.engine.learn(asker.uid, asker.fence, [(b_ip, 90)], "b.test")
    assert "10.204.0.3 timeout 90s" in env.kernel.scripts[-1][1]
    # Denying a name drops its leases at once, in the same transaction.
    await call(env, "DELETE", "/policy", ["a.test"])
    last = env.kernel.scripts[-1][1]
    assert "10.204.0.2" not in last and "10.204.0.3 timeout" in last
    before = len(env.kernel.scripts)
    await env.engine.learn(asker.uid, asker.fence, [(a_ip, 90)], "a.test")
    assert len(env.kernel.scripts) == before  # a.test is denied now: nothing added
    # Without a name (a renewal) only an address a still-allowed name taught is re-added.
    await env.engine.learn(asker.uid, asker.fence, [(ip_address("10.9.9.9"), 90)])
    assert len(env.kernel.scripts) == before
    fresh = env.engine.asker(ip_address("10.0.0.99"))
    await env.engine.learn(fresh.uid, fresh.fence, [(ip_address("10.9.9.9"), 90)])
    assert len(env.kernel.scripts) == before
    await env.engine.learn(fresh.uid, fresh.fence, [(b_ip, 90)])
    assert len(env.kernel.scripts) == before + 1


async def test_leases_expire_out_of_rebuilds(aiohttp_client: Any, tmp_path: Path) -> None:
    env = await make_env(
        aiohttp_client, tmp_path, policy=parse_policy('{"egress":[{"action":"allow","target":"a.test"}]}')
    )
    now = [1000.0]
    env.engine.subjects.clock = lambda: now[0]
    ip = ip_address("10.204.0.2")
    asker = env.engine.asker(ip)
    await env.engine.learn(asker.uid, asker.fence, [(ip, 60)], "a.test")
    now[0] += 30
    await call(env, "PATCH", "/policy", [{"action": "allow", "target": "c.test"}])
    assert "10.204.0.2 timeout 30s expires 30s" in env.kernel.scripts[-1][1]
    now[0] += 31
    await call(env, "PATCH", "/policy", [{"action": "allow", "target": "d.test"}])
    assert "10.204.0.2" not in env.kernel.scripts[-1][1]
    assert env.engine.leases.live(now[0]) == {}


async def test_always_rules_merge_into_dns_and_nft(env: Env) -> None:
    always = AlwaysRules(
        deny=parse_policy('{"egress":[{"action":"deny","target":"evil.test"}]}').egress,
        allow=parse_policy('{"egress":[{"action":"allow","target":"9.9.9.9"}]}').egress,
    )
    await env.engine.set_always_rules(always)
    assert "elements = { 9.9.9.9 }" in env.kernel.scripts[-1][1]
    _, got = await call(env, "GET", "/policy")
    assert got["policy"]["egress"] == []  # GET shows the user policy only
    asker = env.engine.asker(ip_address("10.0.0.1"))
    assert asker.policy is not None and asker.policy.egress[0].target == "evil.test"


# ---- /credential-vault -------------------------------------------------------------------------

VAULT = {
    "credentials": [{"name": "k", "source": {"type": "inline", "value": SECRET}}],
    "bindings": [
        {"name": "b", "match": {"hosts": ["api.allowed.test"]}, "auth": {"type": "bearer", "credential": "k"}}
    ],
}
ALLOW_API = {"egress": [{"action": "allow", "target": "api.allowed.test"}]}


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"token_set": False}, "OPENSANDBOX_EGRESS_TOKEN"),
        ({"mitm_transparent": False}, "MITMPROXY_TRANSPARENT"),
        ({"ssl_insecure": True}, "SSL_INSECURE"),
        ({"mode": "dns"}, "dns+nft"),
        ({"mitm_ready": lambda: False}, "not ready"),
    ],
)
async def test_vault_writes_412_without_prerequisites(
    aiohttp_client: Any, tmp_path: Path, kw: dict[str, Any], needle: str
) -> None:
    env = await make_env(
        aiohttp_client, tmp_path, policy=parse_policy(json.dumps(ALLOW_API)), prereqs=ready_prereqs(**kw)
    )
    mutation = {"credentials": {"add": [{"name": "k2", "source": {"type": "inline", "value": SECRET}}]}}
    for method, payload in (("POST", VAULT), ("PUT", VAULT), ("PATCH", mutation)):
        status, body = await call(env, method, "/credential-vault", payload)
        assert status == 412 and needle in body and SECRET not in body
    # A malformed body is a 400 first: it could never succeed.
    for method, raw in (
        ("POST", b""),
        ("PUT", b"{"),
        ("PATCH", b'{"credentials": 1}'),
        ("POST", b'{"x": 1}'),
    ):
        status, body = await call(env, method, "/credential-vault", raw=raw)
        assert status == 400, (method, raw, body)
    assert (await call(env, "GET", "/credential-vault"))[0] == 404
    assert env.http.vault is None


def test_default_mitm_ready_is_false() -> None:
    p = VaultPrerequisites(token_set=True, mitm_transparent=True, ssl_insecure=False, mode="dns+nft")
    assert p.problem() == "credential proxy (transparent MITM) is not ready"


async def test_vault_lifecycle_when_ready(aiohttp_client: Any, tmp_path: Path) -> None:
    env = await make_env(aiohttp_client, tmp_path, policy=parse_policy(json.dumps(ALLOW_API)))
    with capture_logs() as logs:
        status, state = await call(env, "POST", "/credential-vault", VAULT)
        assert status == 201 and state["revision"] == 1
        assert (await call(env, "POST", "/credential-vault", VAULT))[0] == 409
        status, got = await call(env, "GET", "/credential-vault")
        assert status == 200 and got == state
        assert (await call(env, "GET", "/credential-vault/credentials"))[1]["credentials"][0]["name"] == "k"
        assert (await call(env, "GET", "/credential-vault/bindings"))[1]["bindings"][0]["name"] == "b"
        assert (await call(env, "GET", "/credential-vault/credentials/k"))[0] == 200
        assert (await call(env, "GET", "/credential-vault/bindings/b"))[0] == 200
        assert (await call(env, "GET", "/credential-vault/bindings/zz"))[0] == 404
        assert (await call(env, "POST", "/credential-vault/bindings", {}))[0] == 405
        assert (await call(env, "PATCH", "/credential-vault", {"expectedRevision": 7}))[0] == 409
        status, patched = await call(
            env,
            "PATCH",
            "/credential-vault",
            {
                "expectedRevision": 1,
                "credentials": {
                    "replace": [{"name": "k", "source": {"type": "inline", "value": SECRET + "2"}}]
                },
            },
        )
        assert status == 200 and patched["revision"] == 2
        # A policy change that uncovers a binding host is refused.
        status, body = await call(env, "DELETE", "/policy", ["api.allowed.test"])
        assert status == 400 and "credential binding" in body
        status, _ = await call(env, "PUT", "/credential-vault", VAULT)
        assert status == 200
        assert (await call(env, "DELETE", "/credential-vault"))[0] == 204
        assert (await call(env, "DELETE", "/credential-vault"))[0] == 404
        assert (await call(env, "GET", "/credential-vault/credentials"))[0] == 404
    assert SECRET not in json.dumps(logs, default=str)


async def test_vault_binding_needs_policy_coverage(env: Env) -> None:
    status, body = await call(env, "POST", "/credential-vault", VAULT)
    assert status == 400 and SECRET not in body
    assert (await call(env, "POST", "/credential-vault", raw=b"{"))[0] == 400


async def test_vault_active_and_unknown_paths_404(env: Env) -> None:
    assert (await call(env, "GET", "/credential-vault/_active"))[0] == 404
    assert (await call(env, "GET", "/credential-vault/other"))[0] == 404
    assert (await env.client.get("/v1/sandboxfleets/x/egress/policy", headers=AUTH)).status == 404


def test_outbound_destinations_skip_own_addresses() -> None:
    from egressd.sidecarnft.backend import outbound_destinations

    text = "\n".join(
        [
            "ipv4 2 tcp 6 300 ESTABLISHED src=10.203.0.11 dst=10.204.0.3 sport=1 dport=80 src=10.204.0.3 dst=10.203.0.11",
            "ipv4 2 tcp 6 300 ESTABLISHED src=10.203.0.1 dst=10.203.0.11 sport=2 dport=18080 src=10.203.0.11 dst=10.203.0.1",
            "ipv4 2 udp 17 30 src=10.203.0.11 dst=10.204.0.2 sport=3 dport=53 src=127.0.0.1 dst=10.203.0.11",
            "ipv4 2 tcp 6 300 ESTABLISHED src=127.0.0.1 dst=127.0.0.1 sport=4 dport=18080",
            "garbage",
        ]
    )
    got = outbound_destinations(text, [ip_address("10.203.0.11")])
    assert got == {ip_address("10.204.0.3"), ip_address("10.204.0.2")}


def test_outbound_flows_leave_the_dns_the_proxy_answers() -> None:
    """The app's DNS to any address is redirected to the local proxy (reply from loopback):
    a narrowing must not offer it for a cut (its in-flight answer would be lost; seen as a DNS
    timeout right after a policy change). DNS really sent out (an exempt nameserver: the reply
    comes from the server) and other ports stay flows."""
    from egressd.sidecarnft.backend import outbound_flows

    text = "\n".join(
        [
            "ipv4 2 udp 17 30 src=10.203.0.11 dst=10.203.0.1 sport=3 dport=53 [UNREPLIED] "
            "src=127.0.0.1 dst=10.203.0.11 sport=15353 dport=3 mark=0 zone=0 use=2",
            "ipv4 2 tcp 6 300 ESTABLISHED src=10.203.0.11 dst=10.203.0.9 sport=5 dport=53 "
            "src=127.0.0.1 dst=10.203.0.11 sport=15353 dport=5 [ASSURED] mark=0 zone=0 use=2",
            "ipv6 10 udp 17 30 src=fd00:203::11 dst=fd00:203::1 sport=6 dport=53 "
            "src=::1 dst=fd00:203::11 sport=15353 dport=6 mark=0 zone=0 use=2",
            "ipv4 2 udp 17 30 src=10.203.0.11 dst=10.204.0.2 sport=7 dport=53 "
            "src=10.204.0.2 dst=10.203.0.11 sport=53 dport=7 mark=0 zone=0 use=2",
            "ipv4 2 tcp 6 300 ESTABLISHED src=10.203.0.11 dst=10.203.0.1 sport=8 dport=443 "
            "src=127.0.0.1 dst=10.203.0.11 sport=18081 dport=8 [ASSURED] mark=0 zone=0 use=2",
        ]
    )
    got = outbound_flows(text, [ip_address("10.203.0.11"), ip_address("fd00:203::11")])
    assert got == {(ip_address("10.204.0.2"), "udp", 53), (ip_address("10.203.0.1"), "tcp", 443)}


def test_outbound_flows_leave_the_flows_already_cut() -> None:
    """A cut marks a flow (REVOKED_FLOW_MARK) and keeps its entry: the second look must not
    find it again (it would log a late cut that never was), whatever other mark bits it has."""
    from egressd.kernel.conntrack import carries_mark
    from egressd.sidecarnft.backend import outbound_flows
    from egressd.sidecarnft.ruleset import REVOKED_FLOW_MARK

    def line(sport: int, mark: int) -> str:
        return (
            f"ipv4 2 tcp 6 300 ESTABLISHED src=10.203.0.11 dst=10.204.0.6 sport={sport} dport=22 "
            f"src=10.204.0.6 dst=10.203.0.11 sport=22 dport={sport} [ASSURED] mark={mark} zone=0 use=2"
        )

    assert carries_mark(line(1, REVOKED_FLOW_MARK), REVOKED_FLOW_MARK)
    assert carries_mark(line(1, REVOKED_FLOW_MARK | 0x5), REVOKED_FLOW_MARK)
    assert not carries_mark(line(1, 0), REVOKED_FLOW_MARK) and not carries_mark(line(1, 0x5), REVOKED_FLOW_MARK)
    assert not carries_mark("mark=x", REVOKED_FLOW_MARK)
    own = [ip_address("10.203.0.11")]
    assert outbound_flows(line(1, REVOKED_FLOW_MARK | 0x5), own) == set()
    assert outbound_flows("\n".join([line(1, REVOKED_FLOW_MARK), line(2, 0x5)]), own) == {
        (ip_address("10.204.0.6"), "tcp", 22)
    }


def test_outbound_flows_leave_the_forwarders_zone() -> None:
    """The DNS forwarder's flows are in conntrack zone 1 (original direction): mark 0x1 passes
    them whatever the policy, and conntrack-tools cannot update them by tuple, so a narrowing
    whose deny covers a resolver must not offer them for a cut (it would log a failure each time)."""
    from egressd.kernel.conntrack import zoned
    from egressd.sidecarnft.backend import outbound_flows

    def line(zone: str) -> str:
        return (
            "ipv4 2 udp 17 29 src=10.203.0.11 dst=10.0.0.53 sport=40001 dport=53 "
            f"src=10.0.0.53 dst=10.203.0.11 sport=53 dport=40001 mark=0 {zone} use=2"
        )

    assert zoned(line("zone-orig=1")) and zoned(line("zone=3")) and zoned(line("zone-reply=2"))
    assert not zoned(line("zone=0")) and not zoned(line(""))
    own = [ip_address("10.203.0.11")]
    assert outbound_flows(line("zone-orig=1"), own) == set()
    assert outbound_flows(line("zone=0"), own) == {(ip_address("10.0.0.53"), "udp", 53)}


async def test_allows_ip_mirrors_the_ruleset(aiohttp_client: Any, tmp_path: Path) -> None:
    env = await make_env(
        aiohttp_client,
        tmp_path,
        policy=parse_policy(
            '{"egress":[{"action":"allow","target":"10.0.0.0/24"},{"action":"deny","target":"10.0.0.1"},'
            '{"action":"allow","target":"a.test"}]}'
        ),
    )
    e = env.engine
    assert e.allows_ip(ip_address("10.0.0.2"))
    assert not e.allows_ip(ip_address("10.0.0.1"))  # deny beats allow
    assert not e.allows_ip(ip_address("10.9.9.9"))
    asker = e.asker(ip_address("10.0.0.5"))
    await e.learn(asker.uid, asker.fence, [(ip_address("10.9.9.9"), 60)], "a.test")
    assert e.allows_ip(ip_address("10.9.9.9"))  # learned


async def test_a_change_schedules_the_flow_cut(
    aiohttp_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The subject engine judges the namespace's flows by the policy just committed and cuts,
    # through the whole-table backend, exactly the ones it refuses.
    monkeypatch.setattr(engine_module, "CUT_RECHECK_S", 0.01)
    env = await make_env(aiohttp_client, tmp_path)
    cut = fake_flows(monkeypatch, env.engine, ["10.204.0.3", "10.204.0.9"])
    env.engine.cut_flows = True
    await call(env, "POST", "/policy", {"egress": [{"action": "allow", "target": "10.204.0.3"}]})
    await asyncio.gather(*env.engine._background)
    assert cut == [(None, ip_address("10.204.0.9"))] * 2  # the fake's flows outlive a cut: both looks
    cut.clear()
    await call(env, "POST", "/policy", {"egress": []})
    await asyncio.gather(*env.engine._background)
    assert cut == [(None, ip_address("10.204.0.3")), (None, ip_address("10.204.0.9"))] * 2  # both looks


async def test_healthz_reports_enforcement_and_mitm(aiohttp_client: Any, tmp_path: Path) -> None:
    engine = SidecarEngine(SidecarTable(table="T"), FakeTx(yield_each_call=False), DENY_ALL)
    http = SidecarHTTP(
        engine,
        EgressMetrics(),
        token=TOKEN,
        max_rules=10,
        prerequisites=ready_prereqs(),
        extra_health=lambda: "mitmproxy not ready",
    )
    client = await aiohttp_client(http.app())
    resp = await client.get("/healthz")
    assert (resp.status, await resp.text()) == (503, "enforcement not installed\n")
    await engine.install()
    resp = await client.get("/healthz")
    assert (resp.status, await resp.text()) == (503, "mitmproxy not ready\n")
    http._extra_health = None
    assert (await client.get("/healthz")).status == 200
    assert (await client.post("/healthz")).status == 405


async def test_a_shorter_answer_never_shortens_a_lease(aiohttp_client: Any, tmp_path: Path) -> None:
    env = await make_env(
        aiohttp_client, tmp_path, policy=parse_policy('{"egress":[{"action":"allow","target":"a.test"}]}')
    )
    now = [500.0]
    env.engine.subjects.clock = lambda: now[0]
    ip = ip_address("10.204.0.2")
    asker = env.engine.asker(ip)
    await env.engine.learn(asker.uid, asker.fence, [(ip, 300)], "a.test")
    now[0] += 100
    await env.engine.learn(asker.uid, asker.fence, [(ip, 60)])
    assert "10.204.0.2 timeout 200s expires 200s" in env.kernel.scripts[-1][1]
    assert env.engine.leases.live(now[0])[ip] == 800.0


async def test_rules_count_follows_the_installed_ruleset(env: Env) -> None:
    base = env.engine.rules_installed
    assert base > 0
    await call(env, "POST", "/policy", {"defaultAction": "allow"})
    assert env.engine.rules_installed == base - 1  # no tail drop under policy accept


async def test_audit_mode_is_refused_by_the_sidecar(env: Env) -> None:
    before = await call(env, "GET", "/policy")
    for method in ("POST", "PUT"):
        status, body = await call(env, method, "/policy", {"defaultAction": "deny", "mode": "audit"})
        assert status == 400 and "not supported by the sidecar" in body
    assert await call(env, "GET", "/policy") == before


def test_audit_initial_policy_is_refused() -> None:
    from egressd.sidecar.persist import InitialPolicyError, choose_initial

    with pytest.raises(InitialPolicyError, match="sidecar"):
        choose_initial(None, None, '{"defaultAction":"deny","mode":"audit"}')
    fallback = choose_initial('{"mode":"audit"}', None, None)
    assert fallback.source == "default" and fallback.warning and "sidecar" in fallback.warning


# ---- docs/reference/behaviour.md §14.3: Unicode targets are A-labels -------------------------------------------------


async def test_unicode_targets_become_a_labels_and_invalid_ones_are_400(env: Env) -> None:
    doc = {"defaultAction": "allow", "egress": [{"action": "deny", "target": "évil.com"}]}
    status, body = await call(env, "POST", "/policy", raw=json.dumps(doc, ensure_ascii=False).encode())
    assert status == 200, body
    _, got = await call(env, "GET", "/policy")
    assert rules(got["policy"]) == [("deny", "xn--vil-9la.com")]  # the normalised A-label form
    asker = env.engine.asker(ip_address("127.0.0.1"))
    assert asker.policy is not None
    assert judge_domain(asker.policy, "xn--vil-9la.com.").verdict is Verdict.DENY
    before = len(env.kernel.scripts)
    for method, raw in (
        ("POST", json.dumps({"egress": [{"action": "allow", "target": "☃.com"}]}, ensure_ascii=False)),
        ("PUT", json.dumps({"egress": [{"action": "allow", "target": "ab--é.com"}]}, ensure_ascii=False)),
        ("PATCH", json.dumps([{"action": "allow", "target": "é" * 64 + ".com"}], ensure_ascii=False)),
    ):
        status, body = await call(env, method, "/policy", raw=raw.encode())
        assert status == 400 and "internationalised" in body and body.count("\n") == 1, (method, body)
    assert len(env.kernel.scripts) == before
    _, got = await call(env, "GET", "/policy")
    assert rules(got["policy"]) == [("deny", "xn--vil-9la.com")]
    # DELETE by the Unicode form removes the A-label rule.
    status, body = await call(env, "DELETE", "/policy", ["ÉVIL.com"])
    assert status == 200 and "reason" not in body
    _, got = await call(env, "GET", "/policy")
    assert got["policy"]["egress"] == []


async def test_invalid_policy_write_does_not_echo_the_input(env: Env) -> None:
    """A 400 for a policy write names the field, never the value (a pasted token)."""
    for method, body in (
        ("POST", {"egress": [{"action": "allow", "target": SECRET + "/x"}]}),
        ("PUT", {"egress": [{"action": "allow", "target": SECRET + "☃.com"}]}),
        ("PATCH", [{"action": SECRET, "target": "x.com"}]),
    ):
        status, text = await call(env, method, "/policy", body)
        assert status == 400 and "[0]" in text and SECRET not in text, (method, text)


async def test_vault_caps_hold_on_the_sidecar(aiohttp_client: Any, tmp_path: Path) -> None:
    """14.7 on the sidecar's /credential-vault: over a cap is 400 naming the limit, whatever
    the prerequisites; a PATCH cannot grow the vault past it."""
    from egressd.vault.types import VaultLimits

    env = await make_env(aiohttp_client, tmp_path, policy=parse_policy(json.dumps(ALLOW_API)))
    env.http.vault_limits = VaultLimits(credentials=1)
    two = [{"name": n, "source": {"type": "inline", "value": SECRET}} for n in ("k", "k2")]
    status, body = await call(env, "PUT", "/credential-vault", {**VAULT, "credentials": two})
    assert status == 400 and "EGRESSD_VAULT_MAX_CREDENTIALS" in body and SECRET not in body
    assert env.http.vault is None
    assert (await call(env, "PUT", "/credential-vault", VAULT))[0] == 201
    status, body = await call(env, "PATCH", "/credential-vault", {"credentials": {"add": two[1:]}})
    assert status == 400 and "2 credentials exceed the limit of 1" in body
    hosts = [f"h{i}.allowed.test" for i in range(65)]
    binding = {**VAULT["bindings"][0], "match": {"hosts": hosts}}
    status, body = await call(env, "PUT", "/credential-vault", {**VAULT, "bindings": [binding]})
    assert status == 400 and "hosts per binding" in body


async def test_a_vault_item_name_with_control_characters_is_400(aiohttp_client: Any, tmp_path: Path) -> None:
    """docs/reference/behaviour.md §20.3: an operator is shown these names; an escape sequence is refused."""
    env = await make_env(aiohttp_client, tmp_path, policy=parse_policy(json.dumps(ALLOW_API)))
    evil = json.loads(json.dumps(VAULT))
    evil["credentials"][0]["name"] = evil["bindings"][0]["auth"]["credential"] = "k\x1b]0;owned\x07\x1b[2J"
    status, body = await call(env, "PUT", "/credential-vault", evil)
    assert status == 400 and "credentials[0].name" in body and "printable" in body
    assert "\x1b" not in body and SECRET not in body
    assert (await call(env, "GET", "/credential-vault"))[0] == 404


async def test_a_vault_item_name_with_spaces_at_its_ends_is_400(aiohttp_client: Any, tmp_path: Path) -> None:
    """docs/reference/behaviour.md §20.3 wins over §6's trimming: " k" is refused, never stored as "k"."""
    env = await make_env(aiohttp_client, tmp_path, policy=parse_policy(json.dumps(ALLOW_API)))
    spaced = json.loads(json.dumps(VAULT))
    spaced["credentials"][0]["name"] = spaced["bindings"][0]["auth"]["credential"] = " k"
    for method in ("PUT", "POST"):
        status, body = await call(env, method, "/credential-vault", spaced)
        assert status == 400 and "credentials[0].name" in body and "space" in body, body
    assert (await call(env, "GET", "/credential-vault"))[0] == 404
    assert (await call(env, "PUT", "/credential-vault", VAULT))[0] == 201
    patch = {"bindings": {"delete": [f"{spaced['bindings'][0]['name']} "]}}
    status, body = await call(env, "PATCH", "/credential-vault", patch)
    assert status == 400 and "bindings.delete[0]" in body, body


async def test_a_cut_that_misses_is_retried_once_by_the_policy_in_force(
    aiohttp_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A first pass that fails (a conntrack read or delete error) leaves a refused flow on its
    # established state: the second look cuts it and says so; the failure is logged, not raised.
    monkeypatch.setattr(engine_module, "CUT_RECHECK_S", 0.01)
    env = await make_env(aiohttp_client, tmp_path)
    cut = fake_flows(monkeypatch, env.engine, ["10.204.0.3"], fail_first=True)
    env.engine.cut_flows = True
    with capture_logs() as logs:
        await call(env, "POST", "/policy", {"egress": []})
        results = await asyncio.gather(*env.engine._background)
    assert cut == [(None, ip_address("10.204.0.3"))] and results == [1]
    events = [(e["event"], e.get("attempt"), e.get("destinations")) for e in logs if e["event"].startswith("conntrack")]
    assert events == [
        ("conntrack.cut_failed", 1, None),
        ("conntrack.cut", None, 1),
        ("conntrack.cut_late", None, 1),
    ]


def fake_flows(
    monkeypatch: pytest.MonkeyPatch, engine: SidecarEngine, destinations: list[str], *, fail_first: bool = False
) -> list[tuple[Any, Any]]:
    """The namespace's outbound flows go to ``destinations``; returns the flows cut (a first
    read that fails when ``fail_first``)."""
    reads: list[int] = []
    cut: list[tuple[Any, Any]] = []

    async def outbound() -> list[Any]:
        reads.append(1)
        if fail_first and len(reads) == 1:
            raise RuntimeError("conntrack read failed")
        return [(ip_address(d), "tcp", 443) for d in destinations]

    async def cut_flow(flow: tuple[Any, ...]) -> None:
        cut.append((flow[0], flow[1]))

    monkeypatch.setattr(engine.backend, "_outbound", outbound)
    monkeypatch.setattr(engine.backend, "cut_flow", cut_flow)
    return cut


async def test_mode_dns_still_knows_which_name_taught_an_address(aiohttp_client: Any, tmp_path: Path) -> None:
    """The name check (docs/reference/behaviour.md §18) asks who taught an address: in mode dns
    nothing consults the dyn sets, but the lease book learns all the same (kernel untouched)."""
    allow = parse_policy('{"defaultAction":"deny","egress":[{"action":"allow","target":"a.test"}]}')
    env = await make_env(aiohttp_client, tmp_path, mode="dns", policy=allow)
    ip = ip_address("10.204.0.3")
    scripts = len(env.kernel.scripts)
    assert await env.engine.learn("sidecar", env.engine.fence, [(ip, 30)], "a.test") == [ip]
    assert await env.engine.learn("sidecar", env.engine.fence, [(ip, 30)], "b.test") == [ip]  # not allowed
    assert len(env.kernel.scripts) == scripts
    _, admitted = env.engine.check_name(Wire.TLS, "a.test", ip, 443)
    _, spoofed = env.engine.check_name(Wire.TLS, "b.test", ip, 443)
    assert admitted is not None and admitted.admit
    assert spoofed is not None and not spoofed.admit and spoofed.reason is NameReason.SNI_NOT_ALLOWED
