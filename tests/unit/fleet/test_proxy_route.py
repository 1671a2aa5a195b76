"""Proxy-route credential channel (docs/behaviour.md §4, §6; docs/protocol.md proxy-route rows) over the real app.

A real ControlPlane on a recording fake kernel, a ProxyRouteAPI with a controllable clock and
FleetHTTP served by pytest-aiohttp. Registration is driven with real action envelopes. Every
HTTP exchange is recorded and every test runs under ``structlog.testing.capture_logs``: the
autouse ``env`` teardown asserts that the planted credential value never appeared in a
response (status line, headers, body) nor in a log event.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp.test_utils import TestClient
from structlog.testing import capture_logs
from yarl import URL

from egressd.actionhandler.control import ControlPlane
from egressd.actionhandler.envelope import API_VERSION
from egressd.fleet.proxyroute import ProxyRouteAPI
from egressd.fleet.server import ACTIONS_PATH, FleetHTTP
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.metrics import EgressMetrics
from egressd.policy import EMPTY_ALWAYS, AlwaysRules, Verdict
from egressd.policy.always import parse_always_text
from egressd.vault.keys import KeyStore
from egressd.vault.pending import MAX_PER_UID
from tests.unit.fakekernel import FakeTx

SECRET = "sk-PLANTED-0xdeadbeef"
TTL = 30.0

POLICY: dict[str, Any] = {
    "defaultAction": "deny",
    "egress": [
        {"action": "allow", "target": "api.example.com"},
        {"action": "allow", "target": "*.svc.example.org"},
        {"action": "allow", "target": "9.9.9.9"},
    ],
}
POLICY_TEXT = json.dumps(POLICY)

VAULT_SUFFIXES = [
    "/credential-vault",
    "/credential-vault/credentials",
    "/credential-vault/credentials/tok",
    "/credential-vault/bindings",
    "/credential-vault/bindings/b1",
]
SUB_RESOURCES = VAULT_SUFFIXES[1:]
ALL_GET_SUFFIXES = [*VAULT_SUFFIXES, "/policy"]
WRITE_METHODS = ["PUT", "POST", "PATCH", "DELETE"]


# --------------------------------------------------------------------------- fakes


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


# --------------------------------------------------------------------------- envelopes


def set_binding(
    uid: str = "u-1",
    input: str | None = POLICY_TEXT,
    *,
    ip: str = "10.0.0.5",
    gw: str = "10.0.0.1",
    rid: str = "r1",
    aid: str = "a1",
    gen: int | None = 1,
    attachment: bool = True,
) -> dict[str, Any]:
    revision: dict[str, Any] = {"runtimeInstanceId": rid, "attachmentId": aid}
    if gen is not None:
        revision["specGeneration"] = gen
    doc: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "operation": "SET_BINDING",
        "sandbox": {"uid": uid},
        "revision": revision,
        "binding": {"input": input},
    }
    if attachment:
        doc["attachment"] = {"network": {"ip": ip, "gateway": gw, "hostVeth": f"veth-{uid}"}}
    return doc


def hook(
    uid: str = "u-1", name: str = "sandbox.data-plane-ready", *, rid: str = "r1", aid: str = "a1"
) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "operation": "LIFECYCLE_HOOK",
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": rid, "attachmentId": aid},
        "hook": {"name": name, "sequence": 1},
    }


def remove(uid: str = "u-1", *, rid: str = "r1", aid: str = "a1") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "operation": "REMOVE_BINDING",
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": rid, "attachmentId": aid},
    }


def vault_doc(
    value: str = SECRET,
    *,
    host: str = "api.example.com",
    cred: str = "tok",
    binding: str = "b1",
    auth: str = "bearer",
) -> dict[str, Any]:
    return {
        "credentials": [{"name": cred, "source": {"type": "inline", "value": value}}],
        "bindings": [
            {
                "name": binding,
                "match": {"hosts": [host]},
                "auth": {"type": auth, "credential": cred},
            }
        ],
    }


def path_for(uid: str, suffix: str) -> str:
    return f"/v1/sandboxfleets/{uid}/egress{suffix}"


# --------------------------------------------------------------------------- environment


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Env:
    client: TestClient[Any, Any]
    control: ControlPlane
    proxy: ProxyRouteAPI
    tx: FakeTx
    metrics: EgressMetrics
    clock: FakeClock
    transcript: list[str] = field(default_factory=list)

    async def raw(
        self, method: str, url: str | URL, *, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> Reply:
        resp = await self.client.request(method, url, data=body, headers=headers)
        data = await resp.read()
        reply = Reply(resp.status, data, dict(resp.headers))
        self.transcript.append(f"{resp.status} {resp.reason} {reply.headers!r} {data!r}")
        return reply

    async def act(self, doc: object) -> Reply:
        return await self.raw("POST", ACTIONS_PATH, body=json.dumps(doc).encode())

    async def ok(self, doc: object) -> None:
        reply = await self.act(doc)
        assert reply.status == 200, reply.text

    async def call(
        self,
        method: str,
        suffix: str,
        uid: str = "u-1",
        *,
        body: object = None,
        raw_body: bytes | None = None,
        form: str = "path",
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """One proxy-route request: ``form`` "path" (/v1/sandboxfleets/...) or "header"."""
        hdrs = dict(headers or {})
        if form == "path":
            url = path_for(uid, suffix)
        else:
            url = suffix
            hdrs.setdefault("X-Fast-Sandbox-Uid", uid)
        data = raw_body if raw_body is not None else (None if body is None else json.dumps(body).encode())
        return await self.raw(method, url, body=data, headers=hdrs)

    async def register(
        self, uid: str = "u-1", *, active: bool = True, input: str | None = POLICY_TEXT, **kw: Any
    ) -> None:
        await self.ok(set_binding(uid, input, **kw))
        if active:
            await self.ok(hook(uid, rid=kw.get("rid", "r1"), aid=kw.get("aid", "a1")))

    async def metrics_text(self) -> str:
        return (await self.raw("GET", "/metrics")).text

    def state(self, uid: str = "u-1") -> str:
        entry = self.control.registry.get(uid)
        return "absent" if entry is None else entry.state.value


async def make_env(
    aiohttp_client: Any,
    *,
    max_rules: int = 4096,
    pending_ttl: float = TTL,
    always: AlwaysRules = EMPTY_ALWAYS,
    keys: KeyStore | None = None,
    keys_dir: Path | None = None,
) -> Env:
    tx = FakeTx()
    metrics = EgressMetrics()
    clock = FakeClock()
    control = ControlPlane(
        FleetPlanKernel(TableConfig(), tx),
        always=always,
        metrics=metrics,
        keys=keys if keys is not None else KeyStore(keys_dir),
        pending_ttl=pending_ttl,
        max_rules=max_rules,
    )
    await control.reset_table()
    proxy = ProxyRouteAPI(control, max_rules=max_rules, clock=clock)
    # Wired as egressd.main does.
    metrics.pending_pushes.collect_from(lambda: {(): float(control.credentials.pending_pushes.count())})
    metrics.subjects.collect_from(control.report.state_counts)
    client = await aiohttp_client(FleetHTTP(control, metrics, proxy=proxy).app())
    return Env(client, control, proxy, tx, metrics, clock)


@pytest.fixture
def logs() -> Iterator[list[Any]]:
    with capture_logs() as captured:
        yield captured


def assert_no_secret(env: Env, logs: list[dict[str, Any]], *secrets: str) -> None:
    for secret in secrets or (SECRET,):
        for line in env.transcript:
            assert secret not in line
        for event in logs:
            assert secret not in repr(event)
            assert secret not in str(event)


@pytest.fixture
async def env(aiohttp_client: Any, logs: list[dict[str, Any]]) -> AsyncIterator[Env]:
    e = await make_env(aiohttp_client)
    yield e
    assert_no_secret(e, logs)


def pending_count(env: Env) -> int:
    return env.control.credentials.pending_pushes.count()


def pending_metric(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("egressd_pending_pushes "):
            return float(line.split()[1])
    raise AssertionError("egressd_pending_pushes missing from /metrics")


# =========================================================================== §4 routing table


@pytest.mark.parametrize("form", ["path", "header"])
@pytest.mark.parametrize("suffix", ALL_GET_SUFFIXES)
async def test_unknown_uid_get_anything_is_404(env: Env, suffix: str, form: str) -> None:
    reply = await env.call("GET", suffix, "nobody", form=form)
    assert reply.status == 404
    assert pending_count(env) == 0


@pytest.mark.parametrize("form", ["path", "header"])
@pytest.mark.parametrize("method", WRITE_METHODS)
async def test_unknown_uid_vault_write_is_202_with_empty_body(env: Env, method: str, form: str) -> None:
    reply = await env.call(method, "/credential-vault", "nobody", body=vault_doc(), form=form)
    assert reply.status == 202
    assert reply.body == b""
    assert pending_count(env) == 1
    assert env.state("nobody") == "absent"
    assert "nobody" not in env.control.vaults


@pytest.mark.parametrize("state", ["absent", "denying", "active"])
@pytest.mark.parametrize("method", WRITE_METHODS)
@pytest.mark.parametrize("suffix", SUB_RESOURCES)
async def test_non_get_on_a_sub_resource_is_405_with_allow(
    env: Env, suffix: str, method: str, state: str
) -> None:
    if state != "absent":
        await env.register(active=state == "active")
        assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 201
    before = env.control.vaults.get("u-1")
    rev = before.revision if before else None
    for form in ("path", "header"):
        reply = await env.call(method, suffix, body=vault_doc("other-value"), form=form)
        assert reply.status == 405
        assert reply.headers["Allow"] == "GET"
    assert pending_count(env) == 0
    after = env.control.vaults.get("u-1")
    assert (after.revision if after else None) == rev


@pytest.mark.parametrize("state", ["denying", "active"])
@pytest.mark.parametrize("form", ["path", "header"])
async def test_registered_vault_writes_apply_immediately(env: Env, state: str, form: str) -> None:
    await env.register(active=state == "active")
    assert env.state() == state
    reply = await env.call("PUT", "/credential-vault", body=vault_doc(), form=form)
    assert reply.status == 201
    assert reply.json()["revision"] == 1
    assert pending_count(env) == 0
    got = await env.call("GET", "/credential-vault", form=form)
    assert got.status == 200
    assert got.json()["revision"] == 1


async def test_path_id_and_header_disagree_is_403(env: Env) -> None:
    await env.register()
    for method in ("GET", "PUT"):
        reply = await env.call(
            method, "/credential-vault", "u-1", body=vault_doc(), headers={"X-Fast-Sandbox-Uid": "u-2"}
        )
        assert reply.status == 403
    assert "u-1" not in env.control.vaults
    assert pending_count(env) == 0
    # Agreeing (after trimming) is fine.
    reply = await env.call(
        "PUT", "/credential-vault", "u-1", body=vault_doc(), headers={"X-Fast-Sandbox-Uid": " u-1 "}
    )
    assert reply.status == 201


@pytest.mark.parametrize("suffix", [*ALL_GET_SUFFIXES])
async def test_no_sandbox_named_is_400(env: Env, suffix: str) -> None:
    for method in ("GET", "PUT"):
        reply = await env.raw(method, suffix, body=b"{}")
        assert reply.status == 400
    assert pending_count(env) == 0


@pytest.mark.parametrize(
    "url",
    [
        "/v1/sandboxfleets/" + "x" * 129 + "/egress/credential-vault",
        "/v1/sandboxfleets/a%00b/egress/credential-vault",
        "/v1/sandboxfleets/a%2Fb/egress/credential-vault",
        "/v1/sandboxfleets/a%2fb/egress/credential-vault",
        "/v1/sandboxfleets/a%5Cb/egress/credential-vault",
        "/v1/sandboxfleets//egress/credential-vault",
        "/v1/sandboxfleets/%20/egress/credential-vault",
    ],
    ids=["129-chars", "nul", "slash", "slash-lower", "backslash", "empty", "blank"],
)
async def test_invalid_path_id_is_400(env: Env, url: str) -> None:
    for method in ("GET", "PUT", "DELETE"):
        reply = await env.raw(method, URL(url, encoded=True), body=json.dumps(vault_doc()).encode())
        assert reply.status == 400, (method, reply.text)
    assert pending_count(env) == 0


@pytest.mark.parametrize(
    "uid", ["x" * 129, "a/b", "a\\b", "", "   "], ids=["long", "slash", "bs", "empty", "blank"]
)
async def test_invalid_header_id_is_400(env: Env, uid: str) -> None:
    for method in ("GET", "PUT"):
        reply = await env.raw(method, "/credential-vault", body=b"{}", headers={"X-Fast-Sandbox-Uid": uid})
        assert reply.status == 400
    assert pending_count(env) == 0


async def test_128_char_id_is_valid(env: Env) -> None:
    uid = "x" * 128
    assert (await env.call("GET", "/credential-vault", uid)).status == 404
    assert (await env.call("PUT", "/credential-vault", uid, body=vault_doc())).status == 202


@pytest.mark.parametrize("form", ["path", "header"])
@pytest.mark.parametrize("suffix", ["/credential-vault/_active", "/credential-vault/_active/"])
async def test_active_endpoint_is_never_served_over_http(env: Env, suffix: str, form: str) -> None:
    await env.register(ip="10.0.0.5")
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 201
    for method in ("GET", "PUT"):
        reply = await env.call(method, f"{suffix}?clientIp=10.0.0.5", form=form)
        assert reply.status == 404
        assert SECRET not in reply.text
        assert "If-None-Match" not in reply.headers and "ETag" not in reply.headers
    assert pending_count(env) == 0


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", "", "0x10", "+1", "1e3", str(2**64), "²"])
@pytest.mark.parametrize("method", ["GET", "PUT"])
async def test_unparseable_generation_is_400(env: Env, value: str, method: str) -> None:
    reply = await env.call(
        method, "/credential-vault", "nobody", body=vault_doc(), headers={"X-Fast-Sandbox-Generation": value}
    )
    assert reply.status == 400
    assert pending_count(env) == 0


@pytest.mark.parametrize("value", ["0", " 7 ", str(2**64 - 1)])
async def test_parseable_generation_is_accepted(env: Env, value: str) -> None:
    reply = await env.call(
        "PUT", "/credential-vault", "nobody", body=vault_doc(), headers={"X-Fast-Sandbox-Generation": value}
    )
    assert reply.status == 202
    assert pending_count(env) == 1


async def test_suffix_only_form_serves_every_route(env: Env) -> None:
    await env.register()
    assert (await env.call("POST", "/credential-vault", body=vault_doc(), form="header")).status == 201
    for suffix in ALL_GET_SUFFIXES:
        by_header = await env.call("GET", suffix, form="header")
        by_path = await env.call("GET", suffix, form="path")
        assert by_header.status == 200, suffix
        assert by_header.json() == by_path.json()
    patch = {"expectedRevision": 1, "credentials": {"replace": [{"name": "tok", "source": {"value": "v2"}}]}}
    assert (await env.call("PATCH", "/credential-vault", body=patch, form="header")).status == 200
    assert (await env.call("PUT", "/credential-vault", body=vault_doc("v3"), form="header")).status == 200
    pol = await env.call("PUT", "/policy", body=POLICY, form="header")
    assert pol.status == 200
    assert (await env.call("DELETE", "/credential-vault", form="header")).status == 204
    assert (await env.call("GET", "/credential-vault", form="header")).status == 404
    # A trailing slash names the same resource.
    assert (await env.call("GET", "/credential-vault/credentials/", form="header")).status == 404
    assert (await env.call("GET", "/policy/", form="path")).status == 200


async def test_unknown_suffix_is_404(env: Env) -> None:
    await env.register()
    assert (await env.call("GET", "/credential-vault/nope")).status == 404
    assert (await env.call("PUT", "/credential-vault/credentials/a/b")).status == 404
    assert (await env.raw("GET", "/v1/sandboxfleets/u-1/egress/other")).status == 404


# =========================================================================== §6 operation table


@pytest.fixture
async def active(env: Env) -> Env:
    await env.register()
    return env


async def test_post_creates_then_409(active: Env) -> None:
    env = active
    reply = await env.call("POST", "/credential-vault", body=vault_doc())
    assert reply.status == 201
    state = reply.json()
    assert state == {
        "revision": 1,
        "credentials": [{"name": "tok", "sourceType": "inline", "revision": 1}],
        "bindings": [
            {
                "name": "b1",
                "revision": 1,
                "match": {
                    "schemes": ["https"],
                    "hosts": ["api.example.com"],
                    "methods": ["GET", "POST", "PUT", "PATCH", "DELETE"],
                    "paths": ["/*"],
                },
                "auth": {"type": "bearer"},
            }
        ],
    }
    again = await env.call("POST", "/credential-vault", body=vault_doc("another"))
    assert again.status == 409
    assert (await env.call("GET", "/credential-vault")).json() == state


async def test_put_create_identical_changed(active: Env) -> None:
    env = active
    first = await env.call("PUT", "/credential-vault", body=vault_doc())
    assert first.status == 201
    assert first.json()["revision"] == 1
    tag = env.control.vaults["u-1"].tag
    same = await env.call("PUT", "/credential-vault", body=vault_doc())
    assert same.status == 200
    assert same.json() == first.json()
    assert env.control.vaults["u-1"].tag == tag
    changed = await env.call("PUT", "/credential-vault", body=vault_doc("rotated-value"))
    assert changed.status == 200
    body = changed.json()
    assert body["revision"] == 2
    assert body["credentials"][0]["revision"] == 2
    assert body["bindings"][0]["revision"] == 2
    assert env.control.vaults["u-1"].tag != tag


async def test_put_of_a_credential_only_vault_then_two_credentials(active: Env) -> None:
    env = active
    doc = vault_doc()
    doc["credentials"].append({"name": "zz", "source": {"value": "second-value"}})
    assert (await env.call("PUT", "/credential-vault", body=doc)).status == 201
    creds = (await env.call("GET", "/credential-vault/credentials")).json()
    assert creds == {
        "revision": 1,
        "credentials": [
            {"name": "tok", "sourceType": "inline", "revision": 1},
            {"name": "zz", "sourceType": "inline", "revision": 1},
        ],
    }


async def test_patch_table(active: Env) -> None:
    env = active
    add_cred = {"credentials": {"add": [{"name": "extra", "source": {"value": "extra-value"}}]}}
    assert (await env.call("PATCH", "/credential-vault", body=add_cred)).status == 404
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 201

    # expectedRevision is checked before anything else in the body.
    stale = {"expectedRevision": 7, "credentials": {"delete": ["no-such"]}, "bogus": 1}
    reply = await env.call("PATCH", "/credential-vault", body=stale)
    assert reply.status == 409

    ok = await env.call("PATCH", "/credential-vault", body={"expectedRevision": 1, **add_cred})
    assert ok.status == 200
    state = ok.json()
    assert state["revision"] == 2
    revs = {c["name"]: c["revision"] for c in state["credentials"]}
    assert revs == {"tok": 1, "extra": 2}

    # Atomic: a valid add together with a delete of a missing name changes nothing.
    bad = {
        "credentials": {"add": [{"name": "third", "source": {"value": "third-value"}}], "delete": ["nope"]}
    }
    tag = env.control.vaults["u-1"].tag
    reply = await env.call("PATCH", "/credential-vault", body=bad)
    assert reply.status == 400
    assert (await env.call("GET", "/credential-vault")).json() == state
    assert env.control.vaults["u-1"].tag == tag
    # Deleting a still-referenced credential -> 400 as a whole.
    reply = await env.call("PATCH", "/credential-vault", body={"credentials": {"delete": ["tok"]}})
    assert reply.status == 400
    assert (await env.call("GET", "/credential-vault")).json() == state


async def test_delete_then_create_restarts_at_revision_one(active: Env) -> None:
    env = active
    assert (await env.call("DELETE", "/credential-vault")).status == 404
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 201
    assert (await env.call("PUT", "/credential-vault", body=vault_doc("v2"))).json()["revision"] == 2
    reply = await env.call("DELETE", "/credential-vault")
    assert reply.status == 204
    assert reply.body == b""
    assert (await env.call("DELETE", "/credential-vault")).status == 404
    assert (await env.call("GET", "/credential-vault")).status == 404
    again = await env.call("POST", "/credential-vault", body=vault_doc("v3"))
    assert again.status == 201
    assert again.json()["revision"] == 1


async def test_reads(active: Env) -> None:
    env = active
    for suffix in VAULT_SUFFIXES:
        assert (await env.call("GET", suffix)).status == 404
    doc = vault_doc()
    doc["bindings"].append(
        {
            "name": "b0",
            "match": {"hosts": ["*.svc.example.org"], "schemes": ["HTTP"], "methods": ["get"]},
            "auth": {"type": "apiKey", "name": "x-api-key", "credential": "tok"},
        }
    )
    assert (await env.call("PUT", "/credential-vault", body=doc)).status == 201
    vault = (await env.call("GET", "/credential-vault")).json()
    assert [b["name"] for b in vault["bindings"]] == ["b0", "b1"]
    assert vault["bindings"][0]["auth"] == {"type": "apiKey", "name": "X-Api-Key"}
    assert vault["bindings"][0]["match"]["schemes"] == ["http"]
    assert vault["bindings"][0]["match"]["methods"] == ["GET"]
    assert (await env.call("GET", "/credential-vault/credentials")).json() == {
        "revision": 1,
        "credentials": vault["credentials"],
    }
    assert (await env.call("GET", "/credential-vault/bindings")).json() == {
        "revision": 1,
        "bindings": vault["bindings"],
    }
    assert (await env.call("GET", "/credential-vault/credentials/tok")).json() == {
        "name": "tok",
        "sourceType": "inline",
        "revision": 1,
    }
    assert (await env.call("GET", "/credential-vault/bindings/b1")).json() == vault["bindings"][1]
    assert (await env.call("GET", "/credential-vault/credentials/missing")).status == 404
    assert (await env.call("GET", "/credential-vault/bindings/missing")).status == 404
    for line in env.transcript:
        assert SECRET not in line


@pytest.mark.parametrize(
    "raw",
    [b"{", b"[]", b"null", b"", b'{"credentials":[],"bindings":[],"x":1}', b"\xff\xfe"],
    ids=["syntax", "array", "null", "empty", "unknown-key", "not-utf8"],
)
@pytest.mark.parametrize("method", ["PUT", "POST"])
async def test_invalid_bodies_are_400(active: Env, raw: bytes, method: str) -> None:
    reply = await active.call(method, "/credential-vault", raw_body=raw)
    assert reply.status == 400
    assert "u-1" not in active.control.vaults


async def test_bad_credential_values_are_400_without_echo(active: Env) -> None:
    env = active
    for value in (f"{SECRET}\r\nX-Evil: 1", f"\x00{SECRET}"):
        reply = await env.call("PUT", "/credential-vault", body=vault_doc(value))
        assert reply.status in (201, 400)
        assert SECRET not in reply.text
    doc = vault_doc()
    doc["credentials"].append({"name": "tok", "source": {"value": SECRET + "-dup"}})
    reply = await env.call("PUT", "/credential-vault", body=doc)
    assert reply.status == 400
    assert SECRET not in reply.text


# =========================================================================== coverage


async def test_binding_host_not_explicitly_allowed_is_400(active: Env) -> None:
    env = active
    for host in ("other.example.com", "example.com", "svc.example.org"):
        reply = await env.call("PUT", "/credential-vault", body=vault_doc(host=host))
        assert reply.status == 400, host
        assert "not covered" in reply.text
    # Covered: exact rule, and a host under the *. rule.
    assert (
        await env.call("PUT", "/credential-vault", body=vault_doc(host="a.svc.example.org"))
    ).status == 201
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 200


async def test_default_allow_alone_never_covers(env: Env) -> None:
    await env.register(input='{"defaultAction":"allow"}')
    reply = await env.call("PUT", "/credential-vault", body=vault_doc())
    assert reply.status == 400


async def test_denying_coverage_uses_pending_policy_and_always_rules(
    aiohttp_client: Any, logs: list[dict[str, Any]]
) -> None:
    always = AlwaysRules(
        deny=parse_always_text("blocked.example.net\n", "deny.always", Verdict.DENY),
        allow=parse_always_text("always.example.net\n", "allow.always", Verdict.ALLOW),
    )
    env = await make_env(aiohttp_client, always=always)
    await env.register(active=False)
    assert env.state() == "denying"
    assert (await env.call("PUT", "/credential-vault", body=vault_doc(host="nope.example.com"))).status == 400
    assert (
        await env.call("PUT", "/credential-vault", body=vault_doc(host="always.example.net"))
    ).status == 201
    reply = await env.call("PUT", "/credential-vault", body=vault_doc(host="api.example.com"))
    assert reply.status == 200
    assert reply.json()["revision"] == 2
    # A SET_BINDING whose policy no longer covers the kept vault is refused (docs/behaviour.md §14.1).
    uncovering: dict[str, Any] = {
        "defaultAction": "deny",
        "egress": [{"action": "allow", "target": "blocked.example.net"}],
    }
    refused = await env.act(set_binding(input=json.dumps(uncovering)))
    assert refused.status == 400 and "uncovers a credential binding" in refused.text
    # A user allow cannot cover a host that deny.always blocks.
    uncovering["egress"].append({"action": "allow", "target": "api.example.com"})
    await env.ok(set_binding(input=json.dumps(uncovering)))
    reply = await env.call("PUT", "/credential-vault", body=vault_doc(host="blocked.example.net"))
    assert reply.status == 400
    assert_no_secret(env, logs)


async def test_without_any_policy_bindings_are_refused(env: Env) -> None:
    await env.ok(set_binding(input=None))  # absent + null with attachment: denying, nothing pending
    assert env.state() == "denying"
    assert env.control.registry.get("u-1").pending is None  # type: ignore[union-attr]
    reply = await env.call("PUT", "/credential-vault", body=vault_doc())
    assert reply.status == 400
    assert "u-1" not in env.control.vaults
    # A vault without bindings needs no policy.
    no_bindings = {"credentials": vault_doc()["credentials"], "bindings": []}
    assert (await env.call("PUT", "/credential-vault", body=no_bindings)).status == 201


async def test_reverted_subject_refuses_bindings(active: Env) -> None:
    env = active
    await env.ok(set_binding(input=None))
    assert env.state() == "denying"
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 400


# =========================================================================== pending cache


async def test_pending_push_is_replayed_on_registration(env: Env) -> None:
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 202
    await env.ok(set_binding())
    assert pending_count(env) == 0
    got = await env.call("GET", "/credential-vault")
    assert got.status == 200
    assert got.json()["revision"] == 1


async def test_pending_push_expires_after_ttl(env: Env) -> None:
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 202
    env.clock.advance(TTL + 1)
    await env.ok(set_binding())
    assert (await env.call("GET", "/credential-vault")).status == 404
    assert pending_count(env) == 0


async def test_pending_push_just_before_ttl_is_replayed(env: Env) -> None:
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 202
    env.clock.advance(TTL - 1)
    await env.ok(set_binding())
    assert (await env.call("GET", "/credential-vault")).status == 200


async def test_custom_ttl(aiohttp_client: Any, logs: list[dict[str, Any]]) -> None:
    env = await make_env(aiohttp_client, pending_ttl=5)
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 202
    env.clock.advance(6)
    await env.ok(set_binding())
    assert (await env.call("GET", "/credential-vault")).status == 404
    assert_no_secret(env, logs)


async def test_expired_entries_are_pruned_so_the_cap_frees_up(env: Env) -> None:
    for _ in range(MAX_PER_UID):
        assert (await env.call("PUT", "/credential-vault", "nobody", body=vault_doc())).status == 202
    assert (await env.call("PUT", "/credential-vault", "nobody", body=vault_doc())).status == 503
    env.clock.advance(TTL + 1)
    assert (await env.call("PUT", "/credential-vault", "nobody", body=vault_doc())).status == 202
    assert pending_count(env) == 1


async def test_replay_in_arrival_order(env: Env) -> None:
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 202
    patch = {"expectedRevision": 1, "credentials": {"replace": [{"name": "tok", "source": {"value": "v2"}}]}}
    assert (await env.call("PATCH", "/credential-vault", body=patch)).status == 202
    await env.ok(set_binding())
    state = (await env.call("GET", "/credential-vault")).json()
    assert state["revision"] == 2
    assert state["credentials"][0]["revision"] == 2
    assert env.control.vaults["u-1"].vault.credentials["tok"].value == "v2"  # type: ignore[union-attr]


async def test_replay_order_is_not_reordered(env: Env) -> None:
    # PATCH first (fails on replay: no vault yet), then PUT: ends at revision 1.
    patch = {"credentials": {"add": [{"name": "x", "source": {"value": "vx"}}]}}
    assert (await env.call("PATCH", "/credential-vault", body=patch)).status == 202
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 202
    assert (await env.call("DELETE", "/credential-vault", "u-2")).status == 202
    await env.ok(set_binding())
    state = (await env.call("GET", "/credential-vault")).json()
    assert state["revision"] == 1
    assert [c["name"] for c in state["credentials"]] == ["tok"]
    # Another uid's pushes are not replayed for this one.
    assert pending_count(env) == 1


async def test_failed_replays_are_logged_and_do_not_fail_the_set_binding(
    env: Env, logs: list[dict[str, Any]]
) -> None:
    assert (await env.call("PUT", "/credential-vault", body=vault_doc(host="uncovered.test"))).status == 202
    assert (await env.call("POST", "/credential-vault", raw_body=b"{")).status == 202
    reply = await env.act(set_binding())
    assert reply.status == 200
    assert reply.json() == {}
    assert (await env.call("GET", "/credential-vault")).status == 404
    replays = [e for e in logs if e.get("event") == "pending.replayed"]
    assert [e["code"] for e in replays] == [400, 400]


@pytest.mark.parametrize(
    ("generation", "replayed"),
    [("4", False), ("0", False), ("5", True), ("6", True), (None, True)],
)
async def test_generation_fencing(env: Env, generation: str | None, replayed: bool) -> None:
    headers = {"X-Fast-Sandbox-Generation": generation} if generation is not None else None
    assert (await env.call("PUT", "/credential-vault", body=vault_doc(), headers=headers)).status == 202
    await env.ok(set_binding(gen=5))
    assert (await env.call("GET", "/credential-vault")).status == (200 if replayed else 404)
    assert pending_count(env) == 0


async def test_generation_fencing_mixed_queue(env: Env) -> None:
    def gen(n: int) -> dict[str, str]:
        return {"X-Fast-Sandbox-Generation": str(n)}

    assert (await env.call("PUT", "/credential-vault", body=vault_doc("old"), headers=gen(2))).status == 202
    assert (await env.call("PUT", "/credential-vault", body=vault_doc("cur"), headers=gen(3))).status == 202
    assert (await env.call("PUT", "/credential-vault", body=vault_doc("stale"), headers=gen(1))).status == 202
    await env.ok(set_binding(gen=3))
    store = env.control.vaults["u-1"]
    assert store.revision == 1
    assert store.vault.credentials["tok"].value == "cur"  # type: ignore[union-attr]


async def test_absent_specgeneration_is_zero_and_replays_everything(env: Env) -> None:
    hdr = {"X-Fast-Sandbox-Generation": "0"}
    assert (await env.call("PUT", "/credential-vault", body=vault_doc(), headers=hdr)).status == 202
    await env.ok(set_binding(gen=None))
    assert (await env.call("GET", "/credential-vault")).status == 200


@pytest.mark.parametrize("attachment", [True, False])
async def test_null_set_binding_drops_pending_even_for_absent_uid(env: Env, attachment: bool) -> None:
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 202
    assert (await env.call("PUT", "/policy", body=POLICY)).status == 202
    assert pending_count(env) == 2
    await env.ok(set_binding(input=None, attachment=attachment))
    assert pending_count(env) == 0
    await env.ok(set_binding())
    assert (await env.call("GET", "/credential-vault")).status == 404


@pytest.mark.parametrize("fence", [("r1", "a1"), ("other", "fence")])
async def test_remove_binding_drops_pending_even_for_absent_uid(env: Env, fence: tuple[str, str]) -> None:
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 202
    assert (await env.call("PUT", "/credential-vault", "u-2", body=vault_doc())).status == 202
    await env.ok(remove(rid=fence[0], aid=fence[1]))
    assert pending_count(env) == 1  # u-2's push stays
    await env.ok(set_binding())
    assert (await env.call("GET", "/credential-vault")).status == 404


async def test_more_than_32_pushes_for_one_uid_is_503(env: Env) -> None:
    for i in range(MAX_PER_UID):
        reply = await env.call("PUT", "/credential-vault", body=vault_doc(f"value-{i}"))
        assert reply.status == 202
    assert MAX_PER_UID == 32
    reply = await env.call("PUT", "/credential-vault", body=vault_doc())
    assert reply.status == 503
    assert (await env.call("PUT", "/policy", body=POLICY)).status == 503
    # Other uids are not affected.
    assert (await env.call("PUT", "/credential-vault", "u-2", body=vault_doc())).status == 202
    assert pending_count(env) == MAX_PER_UID + 1
    await env.ok(set_binding())
    state = (await env.call("GET", "/credential-vault")).json()
    assert state["revision"] == MAX_PER_UID
    assert env.control.vaults["u-1"].vault.credentials["tok"].value == f"value-{MAX_PER_UID - 1}"  # type: ignore[union-attr]


async def test_pending_pushes_metric(env: Env) -> None:
    assert pending_metric(await env.metrics_text()) == 0
    for uid in ("a", "b", "b"):
        assert (await env.call("PUT", "/credential-vault", uid, body=vault_doc())).status == 202
    assert (await env.call("PATCH", "/policy", "c", body=[])).status == 202
    text = await env.metrics_text()
    assert pending_metric(text) == 4
    assert SECRET not in text
    await env.ok(set_binding("b", ip="10.0.0.6"))
    assert pending_metric(await env.metrics_text()) == 2
    await env.ok(remove("a"))
    assert pending_metric(await env.metrics_text()) == 1
    await env.ok(set_binding("c", input=None, attachment=False))
    assert pending_metric(await env.metrics_text()) == 0


async def test_pending_body_limit_is_413(env: Env) -> None:
    big = b"{" + b" " * (1024 * 1024) + b"}"
    reply = await env.call("PUT", "/credential-vault", raw_body=big)
    assert reply.status == 413
    assert pending_count(env) == 0


# =========================================================================== lifecycle


async def put_vault(env: Env, uid: str = "u-1", value: str = SECRET) -> None:
    reply = await env.call("PUT", "/credential-vault", uid, body=vault_doc(value))
    assert reply.status in (200, 201), reply.text


async def test_remove_binding_clears_the_vault(active: Env) -> None:
    env = active
    await put_vault(env)
    await env.ok(remove())
    assert env.state() == "absent"
    assert "u-1" not in env.control.vaults
    assert (await env.call("GET", "/credential-vault")).status == 404
    await env.register()
    assert (await env.call("GET", "/credential-vault")).status == 404
    assert env.control.vault_for_ip(ipaddress.ip_address("10.0.0.5")) is None


async def test_remove_with_other_fence_keeps_the_vault(active: Env) -> None:
    env = active
    await put_vault(env)
    await env.ok(remove(rid="old"))
    assert (await env.call("GET", "/credential-vault")).status == 200


@pytest.mark.parametrize("state", ["denying", "active"])
async def test_rebind_clears_the_vault(env: Env, state: str) -> None:
    await env.register(active=state == "active")
    await put_vault(env)
    await env.ok(set_binding(rid="r2"))
    assert env.state() == "denying"
    assert (await env.call("GET", "/credential-vault")).status == 404
    await env.ok(hook(rid="r2"))
    assert (await env.call("GET", "/credential-vault")).status == 404
    assert env.control.vault_for_ip(ipaddress.ip_address("10.0.0.5")) is None


async def test_null_set_binding_clears_the_vault(active: Env) -> None:
    env = active
    await put_vault(env)
    await env.ok(set_binding(input=None))
    assert env.state() == "denying"
    assert (await env.call("GET", "/credential-vault")).status == 404
    await env.ok(set_binding())
    await env.ok(hook())
    assert (await env.call("GET", "/credential-vault")).status == 404


async def test_in_place_bare_policy_keeps_the_vault(active: Env) -> None:
    env = active
    await put_vault(env)
    tag = env.control.vaults["u-1"].tag
    changed = dict(POLICY, egress=[*POLICY["egress"], {"action": "allow", "target": "more.example.com"}])
    await env.ok(set_binding(input=json.dumps(changed), gen=2))
    assert env.state() == "active"
    got = await env.call("GET", "/credential-vault")
    assert got.status == 200
    assert got.json()["revision"] == 1
    assert env.control.vaults["u-1"].tag == tag
    # Also while denying (pushed vault, then a new pending policy).
    await env.ok(set_binding("u-2", ip="10.0.0.6"))
    await put_vault(env, "u-2")
    await env.ok(set_binding("u-2", input=json.dumps(changed), ip="10.0.0.6"))
    assert (await env.call("GET", "/credential-vault", "u-2")).status == 200
    await env.ok(hook("u-2"))
    assert (await env.call("GET", "/credential-vault", "u-2")).json()["revision"] == 1


async def test_vault_for_ip_only_for_active_subjects(env: Env) -> None:
    ip = ipaddress.ip_address("10.0.0.5")
    assert env.control.vault_for_ip(ip) is None
    await env.register(active=False)
    await put_vault(env)
    assert env.control.vault_for_ip(ip) is None  # denying: nothing injected
    await env.ok(hook())
    snap = env.control.vault_for_ip(ip)
    assert snap is not None
    assert snap.revision == 1
    assert snap.bindings[0].headers[0].value == f"Bearer {SECRET}"
    assert SECRET not in repr(snap) and SECRET not in str(snap)
    assert env.control.vault_for_ip(ipaddress.ip_address("10.0.0.99")) is None
    await env.ok(set_binding(input=None))
    assert env.control.vault_for_ip(ip) is None


async def test_vault_tag_changes_on_every_mutation(active: Env) -> None:
    env = active
    ip = ipaddress.ip_address("10.0.0.5")
    tags: list[str] = []

    def tag() -> str:
        snap = env.control.vault_for_ip(ip)
        assert snap is not None
        return snap.tag

    await put_vault(env)
    tags.append(tag())
    await put_vault(env)  # identical: no mutation, same tag
    assert tag() == tags[-1]
    patch = {"credentials": {"add": [{"name": "x", "source": {"value": "vx"}}]}}
    assert (await env.call("PATCH", "/credential-vault", body=patch)).status == 200
    tags.append(tag())
    await put_vault(env, value="changed")
    tags.append(tag())
    assert (
        await env.call("PATCH", "/credential-vault", body={"credentials": {"delete": ["nope"]}})
    ).status == 400
    assert tag() == tags[-1]
    assert (await env.call("DELETE", "/credential-vault")).status == 204
    assert env.control.vault_for_ip(ip) is None
    await put_vault(env)  # recreated with the very first content
    snap = env.control.vault_for_ip(ip)
    assert snap is not None and snap.revision == 1
    tags.append(snap.tag)
    assert len(set(tags)) == len(tags), tags
    assert [int(t.rsplit("-", 1)[1]) for t in tags] == [1, 2, 3, 1]


# =========================================================================== /policy


async def test_policy_get(env: Env) -> None:
    assert (await env.call("GET", "/policy")).status == 404
    await env.register(active=False)
    denying = await env.call("GET", "/policy")
    assert denying.status == 200
    assert denying.json()["status"] == "denying"
    assert "mode" in denying.json()
    assert "policy" not in denying.json()
    await env.ok(hook())
    active = (await env.call("GET", "/policy")).json()
    assert active == {
        "status": "active",
        "mode": "enforcing",
        "auditMode": False,
        "policy": {
            "defaultAction": "deny",
            "egress": [
                {"action": "allow", "target": "api.example.com"},
                {"action": "allow", "target": "*.svc.example.org"},
                {"action": "allow", "target": "9.9.9.9"},
            ],
        },
    }


@pytest.mark.parametrize(
    ("input", "mode"),
    [
        ('{"defaultAction":"deny"}', "deny_all"),
        ('{"defaultAction":"allow","egress":null}', "allow_all"),
        ("", "deny_all"),
    ],
)
async def test_policy_get_egress_is_always_a_list(env: Env, input: str, mode: str) -> None:
    await env.register(input=input)
    body = (await env.call("GET", "/policy")).json()
    assert body["status"] == "active"
    assert body["mode"] == mode
    assert body["policy"]["egress"] == []


@pytest.mark.parametrize("method", WRITE_METHODS)
async def test_policy_write_for_absent_is_cached_202(env: Env, method: str) -> None:
    reply = await env.call(method, "/policy", body=POLICY)
    assert reply.status == 202
    assert reply.json() == {"status": "pending", "reason": "subject not registered yet; push cached"}
    assert pending_count(env) == 1


async def test_policy_write_while_denying_is_discarded(env: Env) -> None:
    other = {"defaultAction": "allow", "egress": [{"action": "allow", "target": "evil.example.com"}]}
    # Cached push for the absent uid: flushed at SET_BINDING while denying -> discarded.
    assert (await env.call("PUT", "/policy", body=other)).status == 202
    await env.register(active=False)
    assert pending_count(env) == 0
    mark = env.tx.mark()
    for method, body in (
        ("PUT", other),
        ("POST", other),
        ("PATCH", other["egress"]),
        ("DELETE", ["api.example.com"]),
    ):
        reply = await env.call(method, "/policy", body=body)
        assert reply.status == 202
        assert reply.json() == {
            "status": "pending",
            "reason": "subject denying; SET_BINDING input is authoritative",
        }
    assert env.tx.applied_since(mark) == []
    assert pending_count(env) == 0
    await env.ok(hook())
    assert (await env.call("GET", "/policy")).json()["policy"] == json.loads(POLICY_TEXT)


async def test_policy_writes_while_active(active: Env) -> None:
    env = active
    new = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "8.8.4.4"}]}
    mark = env.tx.mark()
    reply = await env.call("PUT", "/policy", body=new)
    assert reply.status == 200
    assert reply.json() == {
        "status": "ok",
        "mode": "enforcing",
        "auditMode": False,
        "enforcementMode": "dns+nft",
    }
    swaps = env.tx.applied_since(mark, "static_apply")
    assert len(swaps) == 1 and "8.8.4.4" in swaps[0] and "9.9.9.9" not in swaps[0]
    assert (await env.call("GET", "/policy")).json()["policy"] == new

    mark = env.tx.mark()
    reply = await env.call("PATCH", "/policy", body=[{"action": "allow", "target": "1.1.1.1"}])
    assert reply.status == 200
    assert reply.json()["status"] == "ok"
    swaps = env.tx.applied_since(mark, "static_apply")
    assert len(swaps) == 1 and "1.1.1.1" in swaps[0] and "8.8.4.4" in swaps[0]
    egress = (await env.call("GET", "/policy")).json()["policy"]["egress"]
    assert egress == [{"action": "allow", "target": "1.1.1.1"}, {"action": "allow", "target": "8.8.4.4"}]

    mark = env.tx.mark()
    reply = await env.call("DELETE", "/policy", body=["8.8.4.4", "1.1.1.1"])
    assert reply.status == 200
    assert reply.json() == {
        "status": "ok",
        "mode": "deny_all",
        "auditMode": False,
        "enforcementMode": "dns+nft",
    }
    assert len(env.tx.applied_since(mark, "static_apply")) == 1
    assert (await env.call("GET", "/policy")).json()["policy"] == {"defaultAction": "deny", "egress": []}

    reply = await env.call("POST", "/policy", body={"defaultAction": "allow"})
    assert reply.status == 200
    assert reply.json()["mode"] == "allow_all"


async def test_policy_write_kernel_failure_is_500_and_changes_nothing(active: Env) -> None:
    env = active
    await put_vault(env)
    before = (await env.call("GET", "/policy")).json()
    env.tx.fail(op="static_apply", kinds=("script", "batch"))
    new = dict(POLICY, egress=[*POLICY["egress"], {"action": "allow", "target": "1.2.3.4"}])
    reply = await env.call("PUT", "/policy", body=new)
    assert reply.status == 500
    assert (await env.call("GET", "/policy")).json() == before
    assert (await env.call("PUT", "/policy", body=new)).status == 200
    assert (await env.call("GET", "/policy")).json()["policy"] == new


async def test_policy_delete_without_match_says_so(active: Env) -> None:
    env = active
    mark = env.tx.mark()
    reply = await env.call("DELETE", "/policy", body=["nothing.example"])
    assert reply.status == 200
    assert reply.json().get("reason") == "no matching targets found"
    assert env.tx.applied_since(mark) == []


async def test_policy_reset_by_empty_body_says_so(env: Env) -> None:
    await env.register()
    reply = await env.call("PUT", "/policy", raw_body=b"")
    assert reply.status == 200
    assert reply.json() == {
        "status": "ok",
        "mode": "deny_all",
        "auditMode": False,
        "reason": "policy reset to default deny-all",
        "enforcementMode": "dns+nft",
    }


async def test_next_set_binding_overrides_a_policy_write(active: Env) -> None:
    env = active
    assert (await env.call("PUT", "/policy", body={"defaultAction": "allow"})).status == 200
    await env.ok(set_binding(gen=2))
    assert (await env.call("GET", "/policy")).json()["policy"] == json.loads(POLICY_TEXT)


@pytest.mark.parametrize(
    ("method", "raw"),
    [
        ("PUT", b"{"),
        ("PUT", b"[]"),
        ("PUT", b'{"defaultAction":"maybe"}'),
        ("PUT", b'{"egress":[{"action":"allow","target":""}]}'),
        ("POST", b'{"egress":[{"action":"allow","target":"a.*.com"}]}'),
        ("PATCH", b""),
        ("PATCH", b"null"),
        ("PATCH", b"[]"),
        ("PATCH", b'[{"action":"sometimes","target":"x.com"}]'),
        ("DELETE", b""),
        ("DELETE", b"[]"),
        ("DELETE", b'{"a":1}'),
        ("DELETE", b"[1]"),
        ("PUT", b"\xff"),
    ],
)
async def test_invalid_policy_write_is_400_and_changes_nothing(active: Env, method: str, raw: bytes) -> None:
    env = active
    before = (await env.call("GET", "/policy")).json()
    mark = env.tx.mark()
    reply = await env.call(method, "/policy", raw_body=raw)
    assert reply.status == 400
    assert env.tx.applied_since(mark) == []
    assert (await env.call("GET", "/policy")).json() == before


CAP_REASON = "invalid binding input: policy has 4 rules, more than OPENSANDBOX_EGRESS_MAX_RULES=3\n"


def _policy_of(n: int) -> dict[str, Any]:
    return {
        "defaultAction": "deny",
        "egress": [{"action": "allow", "target": f"10.9.{i // 256}.{i % 256}"} for i in range(n)],
    }


async def test_set_binding_over_the_rule_cap_is_400_and_changes_nothing(aiohttp_client: Any) -> None:
    env = await make_env(aiohttp_client, max_rules=3)
    mark = env.tx.mark()
    reply = await env.act(set_binding(input=json.dumps(_policy_of(4))))
    assert reply.status == 400
    assert reply.headers.get("Content-Type", "").startswith("text/plain")
    assert reply.text == CAP_REASON
    assert env.state() == "absent" and env.tx.applied_since(mark) == []
    # At the cap it is accepted, and an over-cap in-place update of the active subject is
    # refused without touching what is installed.
    await env.register(input=json.dumps(_policy_of(3)))
    mark = env.tx.mark()
    reply = await env.act(set_binding(input=json.dumps(_policy_of(4)), gen=2))
    assert reply.status == 400 and "OPENSANDBOX_EGRESS_MAX_RULES=3" in reply.text
    assert env.tx.applied_since(mark) == []
    assert env.state() == "active"
    entry = env.control.registry.get("u-1")
    assert entry is not None and entry.policy is not None and len(entry.policy.egress) == 3


async def test_a_sealed_wrapper_over_the_rule_cap_is_refused_before_it_is_opened(aiohttp_client: Any) -> None:
    env = await make_env(aiohttp_client, max_rules=3)
    # The vault cannot be opened (no such key): the cap is what answers, so an over-cap input
    # never costs a decryption.
    bogus = {"v": 1, "kid": "nokey", "alg": "A256GCM", "ct": "AAAA"}
    for vault in (bogus, None):
        wrapper = {"osbEgressInput": 1, "policy": _policy_of(4), "vault": vault}
        reply = await env.act(set_binding(input=json.dumps(wrapper)))
        assert reply.status == 400
        assert reply.text == CAP_REASON
    assert env.state() == "absent"


async def test_rule_cap_zero_is_unlimited_and_always_rules_do_not_count(aiohttp_client: Any) -> None:
    env = await make_env(aiohttp_client, max_rules=0)
    await env.register(input=json.dumps(_policy_of(5000)))
    assert (await env.call("PUT", "/policy", body=_policy_of(6000))).status == 200
    always = AlwaysRules(deny=parse_always_text("1.1.1.1\n2.2.2.2\n", "deny.always", Verdict.DENY), allow=())
    env2 = await make_env(aiohttp_client, max_rules=2, always=always)
    await env2.register(input=json.dumps(_policy_of(2)))  # 2 user rules + 2 always-rules: within
    assert (await env2.call("PUT", "/policy", body=_policy_of(2))).status == 200


async def test_policy_rule_cap_is_400_naming_the_limit(
    aiohttp_client: Any, logs: list[dict[str, Any]]
) -> None:
    # Fleet: 400 like every other input refusal (docs/behaviour.md §14.5; the sidecar answers 413).
    env = await make_env(aiohttp_client, max_rules=2)
    await env.register(input='{"defaultAction":"deny","egress":[{"action":"allow","target":"a.com"}]}')
    three = {"defaultAction": "deny", "egress": [{"action": "allow", "target": f"{c}.com"} for c in "xyz"]}
    mark = env.tx.mark()
    for method in ("PUT", "POST"):
        reply = await env.call(method, "/policy", body=three)
        assert reply.status == 400
        assert reply.text == "policy has 3 rules, more than OPENSANDBOX_EGRESS_MAX_RULES=2\n"
        assert reply.headers.get("Content-Type", "").startswith("text/plain")
    patch = [{"action": "allow", "target": "b.com"}, {"action": "allow", "target": "c.com"}]
    reply = await env.call("PATCH", "/policy", body=patch)
    assert reply.status == 400 and "OPENSANDBOX_EGRESS_MAX_RULES=2" in reply.text
    assert env.tx.applied_since(mark) == []
    assert (await env.call("PATCH", "/policy", body=patch[:1])).status == 200
    two = dict(three, egress=three["egress"][:2])
    assert (await env.call("PUT", "/policy", body=two)).status == 200
    assert_no_secret(env, logs)


async def test_policy_change_uncovering_a_vault_binding_is_400(active: Env) -> None:
    env = active
    await put_vault(env)
    before = (await env.call("GET", "/policy")).json()
    vault_before = (await env.call("GET", "/credential-vault")).json()
    tag = env.control.vaults["u-1"].tag
    mark = env.tx.mark()
    attempts = [
        ("PUT", {"defaultAction": "deny", "egress": [{"action": "allow", "target": "9.9.9.9"}]}),
        ("PUT", {"defaultAction": "allow"}),
        ("POST", None),
        ("DELETE", ["API.example.com"]),
        ("PATCH", [{"action": "deny", "target": "api.example.com"}]),
    ]
    for method, body in attempts:
        reply = await env.call(method, "/policy", body=body)
        assert reply.status == 400, (method, body, reply.text)
    assert env.tx.applied_since(mark) == []
    assert (await env.call("GET", "/policy")).json() == before
    assert (await env.call("GET", "/credential-vault")).json() == vault_before
    assert env.control.vaults["u-1"].tag == tag
    # A change that keeps the host covered is fine.
    ok = await env.call("DELETE", "/policy", body=["9.9.9.9"])
    assert ok.status == 200


async def test_vault_write_after_a_policy_write_uses_the_new_policy(active: Env) -> None:
    env = active
    assert (await env.call("PUT", "/credential-vault", body=vault_doc(host="new.example.com"))).status == 400
    patch = [{"action": "allow", "target": "new.example.com"}]
    assert (await env.call("PATCH", "/policy", body=patch)).status == 200
    assert (await env.call("PUT", "/credential-vault", body=vault_doc(host="new.example.com"))).status == 201


# =========================================================================== secrets


def _walk(exc: BaseException) -> Iterator[BaseException]:
    """The exception and the chain a traceback would print (cause, unsuppressed context)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.append(e.__cause__)
        if not e.__suppress_context__:
            stack.append(e.__context__)


def assert_exception_clean(exc: BaseException, secret: str = SECRET) -> None:
    for e in _walk(exc):
        assert secret not in str(e)
        assert secret not in repr(e)
        assert all(secret not in repr(a) for a in e.args)


async def test_secret_never_leaks_across_the_proxy_route(env: Env, logs: list[dict[str, Any]]) -> None:
    structlog.get_logger("egressd.test").info("capture.check")
    # Pending pushes (valid and invalid), replay, live writes, errors of every kind.
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 202
    patch = {
        "expectedRevision": 1,
        "credentials": {"replace": [{"name": "tok", "source": {"value": SECRET + "2"}}]},
    }
    assert (await env.call("PATCH", "/credential-vault", body=patch)).status == 202
    assert (await env.call("PUT", "/credential-vault", body=vault_doc(host="uncovered.test"))).status == 202
    await env.register()
    assert env.control.vaults["u-1"].vault.credentials["tok"].value == SECRET + "2"  # type: ignore[union-attr]
    calls: list[tuple[str, str, object]] = [
        ("GET", "/credential-vault", None),
        ("GET", "/credential-vault/credentials", None),
        ("GET", "/credential-vault/credentials/tok", None),
        ("GET", "/credential-vault/bindings", None),
        ("GET", "/credential-vault/bindings/b1", None),
        ("GET", "/credential-vault/_active?clientIp=10.0.0.5", None),
        ("POST", "/credential-vault", vault_doc()),  # 409
        ("PATCH", "/credential-vault", {**patch, "expectedRevision": 99}),  # 409
        (
            "PATCH",
            "/credential-vault",
            {"credentials": {"add": [{"name": "tok", "source": {"value": SECRET}}]}},
        ),
        ("PUT", "/credential-vault", vault_doc(host="uncovered.test")),  # 400
        ("PUT", "/credential-vault", vault_doc(f"{SECRET}\r\n")),
        ("PUT", "/credential-vault", {**vault_doc(), "extra": SECRET}),
        ("PUT", "/credential-vault/credentials/tok", vault_doc()),  # 405
        ("PUT", "/policy", {"defaultAction": "deny"}),  # 400: uncovers
        ("PUT", "/credential-vault", vault_doc()),
    ]
    for method, suffix, body in calls:
        await env.call(method, suffix, body=body)
    ip = ipaddress.ip_address("10.0.0.5")
    snap = env.control.vault_for_ip(ip)
    assert snap is not None and any(SECRET in r for r in snap.redactions)  # planted indeed
    assert SECRET not in repr(env.control.vaults["u-1"])
    assert SECRET not in repr(env.control.credentials.pending_pushes.__dict__)
    metrics = await env.metrics_text()
    assert SECRET not in metrics
    await env.ok(remove())
    assert any(e.get("event") == "capture.check" for e in logs)
    assert any(e.get("event") == "vault.write" for e in logs)
    assert_no_secret(env, logs)


async def test_pending_push_repr_never_shows_the_body(env: Env) -> None:
    assert (await env.call("PUT", "/credential-vault", "nobody", body=vault_doc())).status == 202
    queue = env.control.credentials.pending_pushes._by_uid["nobody"]
    assert SECRET not in repr(queue)
    assert SECRET not in str(queue)


async def test_vault_errors_carry_no_secret(env: Env) -> None:
    from egressd.vault.parse import parse_create, parse_mutation
    from egressd.vault.store import VaultStore
    from egressd.vault.types import VaultError

    bad_docs: list[object] = [
        vault_doc(f"{SECRET}\r\nX: y"),
        {**vault_doc(), "bogus": SECRET},
        {"credentials": [{"name": "a", "source": {"type": "vault", "value": SECRET}}], "bindings": []},
        {"credentials": [{"name": "a", "source": {"value": SECRET}, "x": 1}], "bindings": []},
        {
            "credentials": [
                {"name": "a", "source": {"value": SECRET}},
                {"name": "a", "source": {"value": SECRET}},
            ],
            "bindings": [],
        },
        {
            "credentials": [{"name": "a", "source": {"value": SECRET}}],
            "bindings": [
                {
                    "name": "b",
                    "match": {"hosts": ["api.example.com"]},
                    "auth": {
                        "type": "passthrough",
                        "substitutions": [
                            {"credential": "a", "placeholder": SECRET, "in": ["body"]},
                            {"credential": "a", "placeholder": SECRET, "in": ["body"]},
                        ],
                    },
                }
            ],
        },
    ]
    raised = 0
    for doc in bad_docs:
        try:
            parse_create(doc)
        except VaultError as exc:
            raised += 1
            assert_exception_clean(exc)
        status, body = VaultStore().put(doc, None)
        assert status == 400
        assert SECRET not in json.dumps(body)
    assert raised == len(bad_docs)
    try:
        parse_mutation({"credentials": {"add": [{"name": "a", "source": {"value": 5}}], "x": SECRET}})
    except VaultError as exc:
        assert_exception_clean(exc)
    else:  # pragma: no cover
        raise AssertionError("expected VaultError")


# =========================================================================== concurrency


N_SUBJECTS = 20
N_REVISIONS = 10


async def _register_many(env: Env, n: int) -> list[str]:
    uids = [f"c-{i}" for i in range(n)]
    await asyncio.gather(*(env.register(uid, ip=f"10.1.0.{i + 10}") for i, uid in enumerate(uids)))
    assert all(env.state(uid) == "active" for uid in uids)
    return uids


async def test_concurrent_puts_end_in_one_of_them(env: Env) -> None:
    uids = await _register_many(env, N_SUBJECTS)
    values = {uid: [f"{SECRET}-{uid}-{k}" for k in range(N_REVISIONS)] for uid in uids}
    jobs: list[tuple[str, int, dict[str, Any]]] = []
    for uid in uids:
        for k, value in enumerate(values[uid]):
            jobs.append((uid, k, vault_doc(value)))
        # Duplicates of an earlier body and invalid bodies are mixed in.
        jobs.append((uid, 0, vault_doc(values[uid][0])))
        jobs.append((uid, -1, vault_doc(host="uncovered.test")))
    random.Random(7).shuffle(jobs)
    replies = await asyncio.gather(
        *(env.call("PUT", "/credential-vault", uid, body=doc) for uid, _, doc in jobs)
    )
    for uid in uids:
        mine = [(k, r) for (u, k, _), r in zip(jobs, replies, strict=True) if u == uid]
        assert sorted(r.status for k, r in mine if k == -1) == [400]
        ok = [(k, r) for k, r in mine if k != -1]
        assert all(r.status in (200, 201) for _, r in ok)
        assert [r.status for _, r in ok].count(201) == 1
        revisions = sorted({r.json()["revision"] for _, r in ok})
        store = env.control.vaults[uid]
        final = store.vault
        assert final is not None
        # Revision = number of distinct successful changes (every accepted change got a new one).
        assert revisions == list(range(1, final.revision + 1))
        assert N_REVISIONS <= final.revision <= N_REVISIONS + 1
        final_value = final.credentials["tok"].value
        assert final_value in values[uid]
        # The reply carrying the final revision is the PUT whose content won.
        winners = {k for k, r in ok if r.json()["revision"] == final.revision}
        assert {values[uid][k] for k in winners} == {final_value}
        snap = env.control.vault_for_ip(ipaddress.ip_address(f"10.1.0.{uids.index(uid) + 10}"))
        assert snap is not None and snap.tag == store.tag
        assert snap.bindings[0].headers[0].value == f"Bearer {final_value}"


async def test_sequenced_puts_end_at_the_last_one(env: Env) -> None:
    uids = await _register_many(env, N_SUBJECTS)

    async def run(uid: str) -> list[int]:
        revs = []
        for k in range(N_REVISIONS):
            reply = await env.call("PUT", "/credential-vault", uid, body=vault_doc(f"{SECRET}-{uid}-{k}"))
            assert reply.status == (201 if k == 0 else 200)
            revs.append(reply.json()["revision"])
        return revs

    results = await asyncio.gather(*(run(uid) for uid in uids))
    for uid, revs in zip(uids, results, strict=True):
        assert revs == list(range(1, N_REVISIONS + 1))
        state = (await env.call("GET", "/credential-vault", uid)).json()
        assert state["revision"] == N_REVISIONS
        assert state["credentials"] == [{"name": "tok", "sourceType": "inline", "revision": N_REVISIONS}]
        assert env.control.vaults[uid].vault.credentials["tok"].value == f"{SECRET}-{uid}-{N_REVISIONS - 1}"  # type: ignore[union-attr]


async def test_concurrent_pushes_and_registration(env: Env) -> None:
    """Pushes racing the registering SET_BINDING are either replayed or applied live, never lost."""
    pushes = [
        env.call(
            "PATCH",
            "/credential-vault",
            body={"credentials": {"add": [{"name": f"c{i}", "source": {"value": f"{SECRET}-{i}"}}]}},
        )
        for i in range(10)
    ]
    first = await env.call("PUT", "/credential-vault", body=vault_doc())
    assert first.status == 202
    results = await asyncio.gather(env.act(set_binding()), *pushes)
    assert results[0].status == 200
    assert all(r.status in (200, 202) for r in results[1:])
    state = (await env.call("GET", "/credential-vault")).json()
    assert sorted(c["name"] for c in state["credentials"]) == sorted(["tok", *(f"c{i}" for i in range(10))])
    assert state["revision"] == 11
    assert pending_count(env) == 0


@pytest.mark.parametrize(
    ("method", "body"),
    [
        ("POST", {"egress": [{"action": "allow", "target": SECRET + "/x"}]}),
        ("PUT", {"egress": [{"action": "allow", "target": "a*" + SECRET + ".com"}]}),
        ("PUT", {"egress": [{"action": "allow", "target": SECRET + "☃.com"}]}),
        ("PATCH", [{"action": SECRET, "target": "x.com"}]),
    ],
    ids=["cidr", "wildcard", "idna", "patch-action"],
)
async def test_invalid_policy_write_does_not_echo_the_input(active: Env, method: str, body: object) -> None:
    """Like the binding input: the 400 names the field, never the value (a pasted token)."""
    reply = await active.call(method, "/policy", body=body)
    assert reply.status == 400 and "[0]" in reply.text, reply.text
    assert SECRET not in reply.text  # the env fixture checks the transcript and logs again


async def test_a_vault_item_name_with_control_characters_is_400(active: Env) -> None:
    """docs/behaviour.md §20.3: an operator is shown these names; an escape sequence is refused."""
    env = active
    doc = vault_doc(SECRET)
    doc["bindings"][0]["name"] = "b\x9b2J\u202e"
    reply = await env.call("PUT", "/credential-vault", body=doc)
    assert reply.status == 400, reply.text
    assert "bindings[0].name" in reply.text and "printable" in reply.text and "\x9b" not in reply.text
    assert (await env.call("GET", "/credential-vault")).status == 404


@pytest.mark.parametrize("method", ["PUT", "POST"])
@pytest.mark.parametrize(
    ("where", "field"),
    [("cred", "credentials[0].name"), ("binding", "bindings[0].name")],
)
async def test_a_vault_item_name_with_spaces_at_its_ends_is_400(
    active: Env, method: str, where: str, field: str
) -> None:
    """docs/behaviour.md §20.3 wins over §6's trimming: " tok " is refused, never stored as "tok"."""
    env = active
    doc = vault_doc(cred=" tok ") if where == "cred" else vault_doc(binding="b1 ")
    reply = await env.call(method, "/credential-vault", body=doc)
    assert reply.status == 400, reply.text
    assert field in reply.text and "space" in reply.text
    assert (await env.call("GET", "/credential-vault")).status == 404


async def test_a_patch_naming_an_item_with_spaces_at_its_ends_is_400(active: Env) -> None:
    env = active
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 201
    for patch in (
        {"credentials": {"add": [{"name": "extra ", "source": {"value": "extra-value"}}]}},
        {"credentials": {"delete": [" tok"]}},
        {"bindings": {"replace": [{**vault_doc()["bindings"][0], "auth": {"type": "bearer", "credential": "tok "}}]}},
    ):
        reply = await env.call("PATCH", "/credential-vault", body=patch)
        assert reply.status == 400 and "space" in reply.text, (patch, reply.text)
    state = (await env.call("GET", "/credential-vault")).json()
    assert state["revision"] == 1 and [c["name"] for c in state["credentials"]] == ["tok"]


async def test_a_cached_push_naming_an_item_with_spaces_is_never_applied(env: Env) -> None:
    """A push cached for a uid not registered yet goes through the same validation on replay."""
    assert (await env.call("PUT", "/credential-vault", body=vault_doc(cred="tok "))).status == 202
    await env.ok(set_binding())
    assert (await env.call("GET", "/credential-vault")).status == 404
