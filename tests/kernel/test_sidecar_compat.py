"""Compatibility with clients none of us wrote, against a real egressd sidecar subprocess in a
sandbox namespace: the OpenSandbox Python SDK from PyPI (its EgressAdapter) and a schemathesis
run of the reference OpenAPI document (tests/compat/egress-api.yaml, deviations documented
in tests/compat/schemathesis.toml and docs/deviations.md).

Both clients run in the pod namespace and reach the sidecar at the sandbox's address, the
way a client reaches a sandbox endpoint. The transparent MITM is on (every vault prerequisite
is met), so the SDK's vault calls succeed end to end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from tests.kernel.sidecar import TOKEN, Sidecar
from tests.kernel.topology import REPO, VENV_PY, Topology, cleanup_stale

SDK_DRIVER = r"""
import asyncio, json, sys
from opensandbox.adapters.egress_adapter import EgressAdapter
from opensandbox.config import ConnectionConfig
from opensandbox.exceptions import SandboxException
from opensandbox.models.sandboxes import NetworkRule, SandboxEndpoint

ENDPOINT, TOKEN = sys.argv[1], sys.argv[2]
out = {}

def adapter(token):
    ep = SandboxEndpoint(endpoint=ENDPOINT, headers={"OPENSANDBOX-EGRESS-AUTH": token})
    return EgressAdapter(ConnectionConfig(protocol="http"), ep)

async def status_of(coro):
    try:
        await coro
        return 200
    except SandboxException as exc:
        return getattr(exc, "status_code", None) or -1

def rules(policy):
    return [[r.action, r.target] for r in policy.egress]

async def main():
    eg = adapter(TOKEN)
    p = await eg.get_policy()
    out["initial"] = [p.default_action, rules(p)]
    await eg.patch_rules([NetworkRule(action="allow", target="pypi.org"),
                          NetworkRule(action="deny", target="evil.test")])
    out["patched"] = rules(await eg.get_policy())
    await eg.delete_rules(["EVIL.test", "absent.test"])
    out["deleted"] = rules(await eg.get_policy())
    r = await eg._httpx_client.put("/policy", json={"defaultAction": "deny", "egress": [{"action": "allow", "target": "b.test"}]})
    out["replace_status"] = r.status_code
    out["replaced"] = rules(await eg.get_policy())
    out["bad_patch"] = await status_of(eg.patch_rules([NetworkRule(action="allow", target="a*b.test")]))
    # docs/reference/behaviour.md §18: rules with ports written through the raw API; the SDK's
    # model does not carry them, but its reads and patches work and leave them as they are.
    scoped = {"action": "allow", "target": "api.x.test", "protocol": "https", "ports": [443, "8443-8444"], "name": "api"}
    r = await eg._httpx_client.put("/policy", json={"defaultAction": "deny", "egress": [scoped, {"action": "allow", "target": "b.test"}]})
    out["scoped_put"] = r.status_code
    out["scoped_sdk_read"] = rules(await eg.get_policy())
    await eg.patch_rules([NetworkRule(action="allow", target="c.test")])
    out["scoped_after_patch"] = (await eg._httpx_client.get("/policy")).json()["policy"]["egress"]
    r = await eg._httpx_client.put("/policy", json={"egress": [{"action": "allow", "target": "x.test", "ports": [0]}]})
    out["scoped_bad"] = [r.status_code, r.text]
    r = await eg._httpx_client.put("/policy", json={"defaultAction": "deny", "egress": [{"action": "allow", "target": "b.test"}]})
    out["create"] = await status_of(eg.create(
        credentials=[{"name": "k", "source": {"type": "inline", "value": "sdk-secret-value"}}],
        bindings=[{"name": "b", "match": {"hosts": ["b.test"]}, "auth": {"type": "bearer", "credential": "k"}}]))
    out["patch"] = await status_of(eg.patch(
        expected_revision=1,
        credentials={"replace": [{"name": "k", "source": {"type": "inline", "value": "sdk-secret-2"}}]}))
    out["patch_stale"] = await status_of(eg.patch(expected_revision=1, credentials={"delete": ["k"]}))
    out["patch_referenced"] = await status_of(eg.patch(expected_revision=2, credentials={"delete": ["k"]}))
    out["revision"] = (await eg.get()).revision
    out["get"] = await status_of(eg.get())
    out["list_credentials"] = await status_of(eg.list_credentials())
    out["get_credential"] = await status_of(eg.get_credential("k"))
    out["list_bindings"] = await status_of(eg.list_bindings())
    out["get_binding"] = await status_of(eg.get_binding("b"))
    out["delete"] = await status_of(eg.delete())
    out["wrong_token"] = await status_of(adapter("wrong").get_policy())
    out["wrong_token_vault"] = await status_of(adapter("wrong").list_bindings())

asyncio.run(main())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ctopo() -> Iterator[Topology]:
    cleanup_stale()
    t = Topology(prefix=f"egc{os.getpid()}", sandboxes=1).up_()
    try:
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(ctopo: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(ctopo, sb=1).with_mitm()
    sc.start()
    try:
        yield sc
    finally:
        sc.cleanup()


def test_opensandbox_sdk_drives_the_sidecar(ctopo: Topology, sidecar: Sidecar) -> None:
    driver = ctopo.workdir / "sdk_driver.py"
    driver.write_text(SDK_DRIVER)
    r = ctopo.ns(ctopo.pod, str(VENV_PY), str(driver), sidecar.endpoint, TOKEN, check=False, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["initial"] == ["deny", []]
    assert out["patched"] == [["allow", "pypi.org"], ["deny", "evil.test"]]
    assert out["deleted"] == [["allow", "pypi.org"]]
    assert (out["replace_status"], out["replaced"]) == (200, [["allow", "b.test"]])
    assert out["bad_patch"] == 400
    assert out["scoped_put"] == 200
    assert out["scoped_sdk_read"] == [["allow", "api.x.test"], ["allow", "b.test"]]
    assert out["scoped_after_patch"] == [
        {"action": "allow", "target": "c.test"},
        {"action": "allow", "target": "api.x.test", "name": "api", "protocol": "https", "ports": [443, "8443-8444"]},
        {"action": "allow", "target": "b.test"},
    ]
    assert out["scoped_bad"][0] == 400 and "egress[0].ports[0]" in out["scoped_bad"][1]
    # Vault: created, patched, read back, listed; a stale expectedRevision is 409, deleting a
    # still-referenced credential is 400 and changes nothing; delete removes it.
    assert out["create"] == 200, out
    assert (out["patch"], out["patch_stale"], out["patch_referenced"]) == (200, 409, 400), out
    assert out["revision"] == 2
    for key in ("get", "list_credentials", "get_credential", "list_bindings", "get_binding", "delete"):
        assert out[key] == 200, (key, out)
    assert (out["wrong_token"], out["wrong_token_vault"]) == (401, 401)
    assert "sdk-secret-value" not in sidecar.log_text() and "sdk-secret-2" not in sidecar.log_text()
    # The SDK's changes reached the kernel and the persisted file.
    assert json.loads(sidecar.policy_file.read_text())["egress"] == [{"action": "allow", "target": "b.test"}]
    assert sidecar.dig("b.test")[0] == "NOERROR"
    assert sidecar.dig("a.test")[0] == "NXDOMAIN"


def test_schemathesis_reference_openapi_zero_failures(ctopo: Topology, sidecar: Sidecar) -> None:
    compat = REPO / "tests" / "compat"
    r = ctopo.ns(
        ctopo.pod,
        str(REPO / ".venv" / "bin" / "schemathesis"),
        "--config-file",
        str(compat / "schemathesis.toml"),
        "run",
        str(compat / "egress-api.yaml"),
        "--url",
        f"http://{sidecar.endpoint}",
        "-H",
        f"OPENSANDBOX-EGRESS-AUTH: {TOKEN}",
        "--workers",
        "1",
        "--max-examples",
        "40",
        "--seed",
        "20261130",
        "--no-color",
        check=False,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failure" not in r.stdout.split("SUMMARY")[-1].lower(), r.stdout[-3000:]
    # After the fuzzing the sidecar still answers and still enforces.
    assert sidecar.api("GET", "/healthz") == (200, "ok")
    assert sidecar.api("GET", "/policy")[0] == 200
    assert sidecar.table_exists()
