"""Fleet HTTP surface (docs/reference/http-api.md, docs/reference/behaviour.md §1, §3, §12) over a ControlPlane on a fake kernel."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass
from typing import Any

import pytest
import structlog
from aiohttp.test_utils import TestClient
from structlog.testing import capture_logs

from egressd.actionhandler.control import ControlPlane
from egressd.actionhandler.envelope import API_VERSION, MAX_BODY_BYTES
from egressd.fleet.server import ACTIONS_PATH, STATUS_PATH, FleetHTTP
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.metrics import EgressMetrics
from tests.unit.fakekernel import FakeTx

SECRET = "zz-PLANTED-SECRET-7f3a9c-zz"


@dataclass
class Env:
    client: TestClient[Any, Any]
    control: ControlPlane
    tx: FakeTx
    http: FleetHTTP
    metrics: EgressMetrics


async def make_env(aiohttp_client: Any, *, reset: bool = True) -> Env:
    tx = FakeTx(yield_each_call=False)
    metrics = EgressMetrics()
    control = ControlPlane(FleetPlanKernel(TableConfig(table="T"), tx), metrics=metrics)
    metrics.subjects._collect = control.report.state_counts
    if reset:
        await control.reset_table()
    http = FleetHTTP(control, metrics)
    client = await aiohttp_client(http.app())
    return Env(client, control, tx, http, metrics)


@pytest.fixture
async def env(aiohttp_client: Any) -> Env:
    return await make_env(aiohttp_client)


def set_binding(
    uid: str = "u-1",
    policy: object = '{"defaultAction":"deny","egress":[{"action":"allow","target":"8.8.8.8"}]}',
    *,
    ip: str = "10.0.0.5",
    gw: str | None = "10.0.0.1",
    rid: str = "r1",
) -> dict[str, Any]:
    net: dict[str, str] = {"ip": ip, "hostVeth": "veth0"}
    if gw is not None:
        net["gateway"] = gw
    return {
        "apiVersion": API_VERSION,
        "operation": "SET_BINDING",
        "sandbox": {"uid": uid},
        "revision": {"specGeneration": 1, "runtimeInstanceId": rid, "attachmentId": "a1"},
        "attachment": {"network": net},
        "binding": {"input": policy},
    }


def hook(uid: str = "u-1", name: str = "sandbox.data-plane-ready", *, rid: str = "r1") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "operation": "LIFECYCLE_HOOK",
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": rid, "attachmentId": "a1"},
        "hook": {"name": name},
    }


def remove(uid: str = "u-1", *, rid: str = "r1") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "operation": "REMOVE_BINDING",
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": rid, "attachmentId": "a1"},
    }


async def post(env: Env, doc: object) -> tuple[int, str]:
    resp = await env.client.post(ACTIONS_PATH, data=json.dumps(doc).encode())
    return resp.status, await resp.text()


# --------------------------------------------------------------------------- actions endpoint


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
async def test_actions_other_methods_are_405_with_allow_post(env: Env, method: str) -> None:
    resp = await env.client.request(method, ACTIONS_PATH)
    assert resp.status == 405
    assert resp.headers["Allow"] == "POST"


async def test_success_is_200_with_empty_object(env: Env) -> None:
    resp = await env.client.post(ACTIONS_PATH, data=json.dumps(set_binding()).encode())
    assert resp.status == 200
    assert resp.content_type == "application/json"
    assert await resp.json() == {}
    assert (await resp.text()).strip() == "{}"


async def test_full_lifecycle_codes(env: Env) -> None:
    assert (await post(env, hook()))[0] == 409  # absent
    assert (await post(env, set_binding()))[0] == 200
    assert (await post(env, hook(name="sandbox.runtime-ready")))[0] == 200
    assert (await post(env, hook(rid="r0")))[0] == 409
    assert (await post(env, hook()))[0] == 200
    e = env.control.registry.get("u-1")
    assert e is not None
    assert e.state.value == "active"
    assert (await post(env, hook()))[0] == 200  # idempotent retry
    assert (await post(env, remove()))[0] == 200
    assert env.control.registry.get("u-1") is None
    assert (await post(env, remove()))[0] == 200


@pytest.mark.parametrize(
    "body",
    [b"{", b"[]", b"not json", json.dumps({"apiVersion": "v1"}).encode(), b""],
    ids=["truncated", "array", "garbage", "apiVersion", "empty"],
)
async def test_bad_envelope_is_400_with_prefix(env: Env, body: bytes) -> None:
    resp = await env.client.post(ACTIONS_PATH, data=body)
    assert resp.status == 400
    text = await resp.text()
    assert text.startswith("invalid action envelope: ")
    assert text.count("\n") <= 1
    assert resp.content_type == "text/plain"
    assert len(env.control.registry) == 0


async def test_bad_policy_is_400_and_nothing_registered(env: Env) -> None:
    status, text = await post(env, set_binding(policy="not-json"))
    assert status == 400
    assert text.count("\n") <= 1
    assert len(env.control.registry) == 0
    assert env.tx.applied == []


async def test_body_over_one_mib_is_413(env: Env) -> None:
    body = b" " * (MAX_BODY_BYTES + 1)
    assert len(body) == 1_048_577
    resp = await env.client.post(ACTIONS_PATH, data=body)
    assert resp.status == 413


async def test_chunked_body_over_one_mib_is_413(env: Env) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        remaining = MAX_BODY_BYTES + 1
        while remaining:
            n = min(remaining, 100_000)
            remaining -= n
            yield b" " * n

    resp = await env.client.post(ACTIONS_PATH, data=chunks())
    assert resp.status == 413


def _padded(doc: object, size: int) -> bytes:
    raw = json.dumps(doc).encode()
    body = raw + b" " * (size - len(raw))
    assert len(body) == size
    return body


async def test_exactly_one_mib_is_parsed_not_413(env: Env) -> None:
    resp = await env.client.post(ACTIONS_PATH, data=_padded(set_binding(), MAX_BODY_BYTES))
    assert resp.status == 200
    assert await resp.json() == {}
    resp = await env.client.post(
        ACTIONS_PATH, data=_padded({**set_binding(), "apiVersion": "v2"}, MAX_BODY_BYTES)
    )
    assert resp.status == 400
    assert (await resp.text()).startswith("invalid action envelope: ")


async def test_nft_failure_is_500_one_line(env: Env) -> None:
    env.tx.fail(match="add chain inet T subj_s_u_1", kinds=("script", "batch"), times=None)
    status, text = await post(env, set_binding())
    assert status == 500
    assert text.startswith("deny-first install: ")
    assert text.count("\n") == 1
    assert env.control.registry.get("u-1") is not None


async def test_missing_gateway_is_500(env: Env) -> None:
    status, text = await post(env, set_binding(gw=None))
    assert status == 500
    assert "gateway" in text


async def test_ip_of_another_sandbox_is_409(env: Env) -> None:
    assert (await post(env, set_binding("a")))[0] == 200
    status, _ = await post(env, set_binding("b"))
    assert status == 409


# --------------------------------------------------------------------------- status and health


async def test_status_shape_and_stable_instance_id(env: Env) -> None:
    first = await env.client.get(STATUS_PATH)
    assert first.status == 200
    body = await first.json()
    assert set(body) == {"apiVersion", "ready", "instanceId", "nameCheck"}
    assert body["nameCheck"] is False  # no MITM here (docs/reference/behaviour.md §18)
    assert body["apiVersion"] == API_VERSION
    assert body["ready"] is True
    assert isinstance(body["instanceId"], str)
    assert body["instanceId"]
    assert re.fullmatch(r"egress-\d+-[0-9a-f]{12}", body["instanceId"])
    for _ in range(3):
        again = await (await env.client.get(STATUS_PATH)).json()
        assert again["instanceId"] == body["instanceId"]
    assert body["instanceId"] == env.http.instance_id
    other = FleetHTTP(env.control, env.metrics)
    assert other.instance_id != env.http.instance_id
    resp = await env.client.post(STATUS_PATH)
    assert resp.status == 405


async def test_healthz_503_before_reset_and_200_after(aiohttp_client: Any) -> None:
    env = await make_env(aiohttp_client, reset=False)
    resp = await env.client.get("/healthz")
    assert resp.status == 503
    assert (await resp.text()).strip()
    status = await (await env.client.get(STATUS_PATH)).json()
    assert status["ready"] is False
    await env.control.reset_table()
    assert env.tx.resets == 1
    resp = await env.client.get("/healthz")
    assert resp.status == 200
    assert (await resp.text()).strip() == "ok"
    status = await (await env.client.get(STATUS_PATH)).json()
    assert status["ready"] is True


# --------------------------------------------------------------------------- metrics


async def test_metrics_exposition(env: Env) -> None:
    assert (await post(env, set_binding("a")))[0] == 200
    assert (await post(env, set_binding("b", ip="10.0.0.6")))[0] == 200
    assert (await post(env, hook("b")))[0] == 200
    assert (await post(env, hook("nobody")))[0] == 409
    assert (await env.client.post(ACTIONS_PATH, data=b"{")).status == 400
    resp = await env.client.get("/metrics")
    assert resp.status == 200
    assert resp.content_type == "text/plain"
    text = await resp.text()
    assert "# TYPE egressd_subjects gauge" in text
    assert 'egressd_subjects{state="denying"} 1' in text
    assert 'egressd_subjects{state="active"} 1' in text
    assert "# TYPE egressd_actions_total counter" in text
    assert 'egressd_actions_total{operation="SET_BINDING",code="200"} 2' in text
    assert 'egressd_actions_total{operation="LIFECYCLE_HOOK",code="200"} 1' in text
    assert 'egressd_actions_total{operation="LIFECYCLE_HOOK",code="409"} 1' in text
    assert re.search(r'egressd_actions_total\{operation="[^"]+",code="400"\} 1', text)
    assert "# TYPE egress_nftables_updates_total counter" in text
    assert "# TYPE egress_nftables_updates_failed_total counter" in text
    assert "# TYPE egressd_nft_transaction_duration_seconds histogram" in text
    assert (await env.client.post("/metrics")).status == 405


def test_metrics_histogram_and_counters_render() -> None:
    metrics = EgressMetrics()
    metrics.nft_updates.inc("deny_first")
    metrics.nft_failures.inc("remove")
    metrics.nft_latency.observe(0.003, "deny_first")
    text = metrics.render()
    assert 'egress_nftables_updates_total{operation="deny_first"} 1' in text
    assert 'egress_nftables_updates_failed_total{operation="remove"} 1' in text
    assert 'egressd_nft_transaction_duration_seconds_bucket{operation="deny_first",le="0.0025"} 0' in text
    assert 'egressd_nft_transaction_duration_seconds_bucket{operation="deny_first",le="0.005"} 1' in text
    assert 'egressd_nft_transaction_duration_seconds_bucket{operation="deny_first",le="+Inf"} 1' in text
    assert 'egressd_nft_transaction_duration_seconds_count{operation="deny_first"} 1' in text
    assert 'egressd_nft_transaction_duration_seconds_sum{operation="deny_first"} 0.003' in text


# --------------------------------------------------------------------------- secrets


def _policy_with_secret() -> str:
    return json.dumps(
        {"defaultAction": "deny", "egress": [{"action": "allow", "target": f"{SECRET}.example.com"}]}
    )


def _assert_no_secret(bodies: list[str], logs: list[MutableMapping[str, Any]]) -> None:
    for body in bodies:
        assert SECRET not in body
    rendered = json.dumps(logs, default=repr)
    assert SECRET not in rendered


async def _collect(env: Env, docs: list[object]) -> tuple[list[int], list[str]]:
    codes: list[int] = []
    bodies: list[str] = []
    for doc in docs:
        if isinstance(doc, bytes):
            resp = await env.client.post(ACTIONS_PATH, data=doc)
        else:
            resp = await env.client.post(ACTIONS_PATH, data=json.dumps(doc).encode())
        codes.append(resp.status)
        bodies.append(await resp.text())
    for path in ("/metrics", STATUS_PATH, "/healthz", "/v1/subjects"):
        resp = await env.client.get(path)
        bodies.append(await resp.text())
    return codes, bodies


async def test_secret_never_leaks_on_200_409_500(env: Env) -> None:
    with capture_logs() as logs:
        structlog.get_logger("egressd.test").info("capture.check")
        codes, bodies = await _collect(
            env,
            [
                set_binding("a", _policy_with_secret()),  # 200
                hook("a"),  # 200, activates the policy holding the secret
                set_binding("b", _policy_with_secret()),  # 409: ip of "a"
                set_binding("a", _policy_with_secret() + " "),  # 200 in place
            ],
        )
        env.tx.heal()
        env.tx.fail(match="subj_s_c", kinds=("script", "batch"), times=None)
        more_codes, more_bodies = await _collect(
            env,
            [
                set_binding("c", _policy_with_secret(), ip="10.0.0.9"),  # 500 deny-first
                set_binding("a", _policy_with_secret(), rid="r2"),  # ok: rebind
            ],
        )
        env.tx.heal()
        env.tx.fail(match="subj_s_a", kinds=("script", "batch"), times=None)
        last_codes, last_bodies = await _collect(
            env, [hook("a", rid="r2"), remove("a", rid="r2")]
        )  # 200 (a first policy with no IP content fills nothing: no transaction), 500
    assert any(e.get("event") == "capture.check" for e in logs)
    assert codes == [200, 200, 409, 200]
    assert more_codes == [500, 200]
    assert last_codes == [200, 500]
    assert any(e.get("code") in (409, 500) for e in logs)
    _assert_no_secret(bodies + more_bodies + last_bodies, logs)


@pytest.mark.parametrize(
    "bad_input",
    [
        '{"defaultAction":"deny","egress":[{"action":"allow","target":"' + SECRET,  # JSON syntax
        '{"osbEgressInput":1,"policy":{"egress":[{"target":"'
        + SECRET
        + '.com"}]},"vault":{"v":1,"kid":"k3","alg":"A256GCM","ct":"'
        + SECRET
        + '"}}',  # sealed vault, unknown kid
        '{"osbEgressInput":7,"policy":{"egress":[{"target":"' + SECRET + '.com"}]}}',
        "[" + json.dumps(SECRET) + "]",  # not an object
    ],
    ids=["json-syntax", "wrapper-vault", "wrapper-version", "non-object"],
)
async def test_secret_never_leaks_on_400(env: Env, bad_input: str) -> None:
    with capture_logs() as logs:
        codes, bodies = await _collect(env, [set_binding("a", bad_input)])
    assert codes == [400]
    _assert_no_secret(bodies, logs)
    assert len(env.control.registry) == 0


async def test_secret_never_leaks_on_envelope_400(env: Env) -> None:
    docs: list[object] = [
        {**set_binding(), "apiVersion": "v9"},
        set_binding(policy={"defaultAction": SECRET}),  # input of the wrong type
        {**set_binding(policy=_policy_with_secret()), "operation": "EXPLODE"},
        {**set_binding(policy=_policy_with_secret()), "revision": {}},
        json.dumps(set_binding(policy=_policy_with_secret())).encode()[:-5],  # truncated JSON
    ]
    with capture_logs() as logs:
        codes, bodies = await _collect(env, docs)
    assert codes == [400] * len(docs)
    _assert_no_secret(bodies, logs)


@pytest.mark.parametrize(
    "bad_input",
    [
        '{"egress":[{"action":"allow","target":"' + SECRET + '/x"}]}',
        '{"egress":[{"action":"allow","target":"a*' + SECRET + '.com"}]}',
        '{"egress":[{"action":"' + SECRET + '","target":"x.com"}]}',
        '{"osbEgressInput":1,"policy":{},"' + SECRET + '":1}',
    ],
    ids=["cidr-target", "wildcard-target", "rule-action", "wrapper-key"],
)
async def test_secret_in_invalid_policy_is_not_echoed(env: Env, bad_input: str) -> None:
    with capture_logs() as logs:
        codes, bodies = await _collect(env, [set_binding("a", bad_input)])
    assert codes == [400]
    _assert_no_secret(bodies, logs)


async def test_subjects_view(env: Env) -> None:
    assert (await post(env, set_binding()))[0] == 200
    body = await (await env.client.get("/v1/subjects")).json()
    assert [s["uid"] for s in body["subjects"]] == ["u-1"]
    assert body["subjects"][0]["state"] == "denying"
    assert body["subjects"][0]["pending"] is True


# --------------------------------------------------------------------------- docs/reference/behaviour.md §14.3 IDNA


@pytest.mark.parametrize("target", ["☃.example.com", "ab--é.com", "é" * 64 + ".com", "a\u200db.com"])
async def test_invalid_unicode_domain_is_400_and_nothing_registered(env: Env, target: str) -> None:
    policy = json.dumps({"egress": [{"action": "deny", "target": target}]}, ensure_ascii=False)
    resp = await env.client.post(
        ACTIONS_PATH, data=json.dumps(set_binding(policy=policy), ensure_ascii=False).encode()
    )
    text = await resp.text()
    assert resp.status == 400, text
    assert "egress[0].target" in text and "internationalised" in text and text.count("\n") <= 1
    assert len(env.control.registry) == 0
    assert env.tx.applied == []


async def test_unicode_domain_is_stored_and_judged_as_a_labels(env: Env) -> None:
    policy = {"defaultAction": "allow", "egress": [{"action": "deny", "target": "Évil.com"}]}
    for doc in (json.dumps(policy), json.dumps(policy, ensure_ascii=False)):  # escaped or raw UTF-8
        resp = await env.client.post(
            ACTIONS_PATH, data=json.dumps(set_binding(policy=doc), ensure_ascii=False).encode()
        )
        assert resp.status == 200, await resp.text()
        entry = env.control.registry.get("u-1")
        assert entry is not None and entry.pending is not None
        assert [r.target for r in entry.pending.egress] == ["xn--vil-9la.com"]
