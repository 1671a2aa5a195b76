"""The real OpenSandbox Python SDK (PyPI ``opensandbox``, its EgressAdapter) against the sidecar
HTTP app served on a loopback port, on a fake kernel.

In process so that the "MITM ready" prerequisite of vault writes (§6) can be asserted: the
transparent MITM is not part of this build yet. The same SDK calls against a real egressd
subprocess in a real namespace (where vault writes answer 412) are in
tests/kernel/test_sidecar_compat.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from opensandbox.adapters.egress_adapter import EgressAdapter
from opensandbox.config import ConnectionConfig
from opensandbox.exceptions import SandboxApiException, SandboxException
from opensandbox.models.sandboxes import NetworkRule, SandboxEndpoint

from egressd.metrics import EgressMetrics
from egressd.policy import DENY_ALL, parse_policy
from egressd.sidecar.engine import SidecarEngine
from egressd.sidecar.http import AUTH_HEADER, SidecarHTTP, VaultPrerequisites
from egressd.sidecarnft.ruleset import SidecarTable
from tests.unit.fakekernel import FakeTx

TOKEN = "sdk-test-token"
SECRET = "zz-SDK-PLANTED-SECRET-zz"


async def _adapter(
    aiohttp_server: Any, tmp_path: Path, *, ready: bool, token: str = TOKEN
) -> tuple[EgressAdapter, SidecarHTTP]:
    engine = SidecarEngine(
        SidecarTable(table="T"),
        FakeTx(yield_each_call=False),
        parse_policy('{"egress":[{"action":"allow","target":"api.example.com"}]}'),
        persist_path=tmp_path / "policy.json",
    )
    await engine.install()
    http = SidecarHTTP(
        engine,
        EgressMetrics(),
        token=TOKEN,
        max_rules=4096,
        prerequisites=VaultPrerequisites(
            token_set=True,
            mitm_transparent=True,
            ssl_insecure=False,
            mode="dns+nft",
            mitm_ready=lambda: ready,
        ),
    )
    server = await aiohttp_server(http.app())
    endpoint = SandboxEndpoint(endpoint=f"127.0.0.1:{server.port}", headers={AUTH_HEADER: token})
    return EgressAdapter(ConnectionConfig(protocol="http"), endpoint), http


async def test_sdk_policy_get_patch_delete(aiohttp_server: Any, tmp_path: Path) -> None:
    egress, http = await _adapter(aiohttp_server, tmp_path, ready=True)
    policy = await egress.get_policy()
    assert policy.default_action == "deny"
    # The SDK's model leaves ``egress`` optional (mypy cannot see the daemon always sends it).
    assert [(r.action, r.target) for r in policy.egress] == [("allow", "api.example.com")]  # type: ignore[union-attr]
    await egress.patch_rules(
        [NetworkRule(action="allow", target="pypi.org"), NetworkRule(action="deny", target="api.example.com")]
    )
    policy = await egress.get_policy()
    assert [(r.action, r.target) for r in policy.egress] == [  # type: ignore[union-attr]
        ("allow", "pypi.org"),
        ("deny", "api.example.com"),
    ]
    await egress.delete_rules(["API.example.com", "not-there.org"])
    policy = await egress.get_policy()
    assert [(r.action, r.target) for r in policy.egress] == [("allow", "pypi.org")]  # type: ignore[union-attr]
    # Replace is not part of the SDK: docs/reference/http-api.md's POST /policy through the SDK's own client.
    resp = await egress._httpx_client.post("/policy", json={"defaultAction": "allow", "egress": []})
    assert resp.status_code == 200 and resp.json()["mode"] == "allow_all"
    assert (await egress.get_policy()).default_action == "allow"
    resp = await egress._httpx_client.post("/policy", content=b"")
    assert resp.json()["reason"] == "policy reset to default deny-all"
    assert http.engine.user == DENY_ALL
    # Errors surface as SandboxApiException with the HTTP status.
    with pytest.raises(SandboxException) as info:
        await egress.patch_rules([NetworkRule(action="allow", target="bad*name.com")])
    assert getattr(info.value, "status_code", None) == 400


async def test_sdk_vault_lifecycle(aiohttp_server: Any, tmp_path: Path) -> None:
    egress, _ = await _adapter(aiohttp_server, tmp_path, ready=True)
    state = await egress.create(
        credentials=[{"name": "openai", "source": {"type": "inline", "value": SECRET}}],
        bindings=[
            {
                "name": "openai-api",
                "match": {"hosts": ["api.example.com"], "paths": ["/v1/*"]},
                "auth": {"type": "bearer", "credential": "openai"},
            }
        ],
    )
    assert state.revision == 1
    got = await egress.get()
    assert got.revision == 1 and [c.name for c in got.credentials] == ["openai"]
    assert SECRET not in got.model_dump_json()
    creds = await egress.list_credentials()
    assert [(c.name, c.revision) for c in creds] == [("openai", 1)]
    assert (await egress.get_credential("openai")).name == "openai"
    bindings = await egress.list_bindings()
    assert [b.name for b in bindings] == ["openai-api"]
    assert (await egress.get_binding("openai-api")).revision == 1
    patched = await egress.patch(
        expected_revision=1,
        credentials={"add": [{"name": "k2", "source": {"type": "inline", "value": SECRET + "2"}}]},
        bindings={
            "add": [
                {
                    "name": "k2-api",
                    "match": {"hosts": ["api.example.com"], "paths": ["/v2/*"]},
                    "auth": {"type": "apiKey", "name": "x-api-key", "credential": "k2"},
                }
            ]
        },
    )
    assert patched.revision == 2
    with pytest.raises(SandboxApiException) as conflict:
        await egress.patch(expected_revision=1, credentials={"delete": ["k2"]})
    assert conflict.value.status_code == 409
    await egress.delete()
    with pytest.raises(SandboxApiException) as missing:
        await egress.get()
    assert missing.value.status_code == 404


async def test_sdk_surfaces_412_and_401(aiohttp_server: Any, tmp_path: Path) -> None:
    egress, _ = await _adapter(aiohttp_server, tmp_path, ready=False)
    with pytest.raises(SandboxApiException) as info:
        await egress.create(credentials=[], bindings=[])
    assert info.value.status_code == 412
    with pytest.raises(SandboxApiException) as info:
        await egress.patch(credentials={"delete": ["x"]})
    assert info.value.status_code == 412
    wrong, _ = await _adapter(aiohttp_server, tmp_path, ready=True, token="wrong")
    with pytest.raises(SandboxException) as denied:
        await wrong.get_policy()
    assert getattr(denied.value, "status_code", None) == 401
