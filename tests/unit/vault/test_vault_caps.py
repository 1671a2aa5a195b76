"""docs/reference/behaviour.md §14.7 caps on every path a vault body enters the fleet: proxy-route writes,
pending replays and the sealed vault of a binding input (the model and store are covered in
test_vault_model.py / test_vault_store.py, the sidecar in test_sidecar_http.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from egressd.vault.types import VaultLimits
from tests.unit.fleet.test_proxy_route import SECRET, Env, hook, make_env, set_binding, vault_doc
from tests.unit.vault.test_sealed_binding import keys_dir, wrapper

__all__ = ["keys_dir"]  # the fixture, imported for this module's tests

SMALL = VaultLimits(credentials=1, bindings=1)


def two_credentials() -> dict[str, Any]:
    doc = vault_doc()
    doc["credentials"].append({"name": "extra", "source": {"type": "inline", "value": SECRET}})
    return doc


async def small_env(aiohttp_client: Any, **kw: Any) -> Env:
    env = await make_env(aiohttp_client, **kw)
    env.control.credentials.limits = SMALL
    return env


async def test_proxy_route_writes_over_the_caps_are_400(aiohttp_client: Any) -> None:
    env = await small_env(aiohttp_client)
    await env.register()
    for method in ("PUT", "POST"):
        reply = await env.call(method, "/credential-vault", body=two_credentials())
        assert reply.status == 400, reply.text
        assert (
            reply.text.strip()
            == "credentials: 2 credentials exceed the limit of 1 (EGRESSD_VAULT_MAX_CREDENTIALS)"
        )
    assert "u-1" not in env.control.vaults
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 201
    add = {
        "bindings": {
            "add": [
                {
                    "name": "b2",
                    "match": {"hosts": ["api.example.com"], "paths": ["/x"]},
                    "auth": {"type": "bearer", "credential": "tok"},
                }
            ]
        }
    }
    reply = await env.call("PATCH", "/credential-vault", body=add)
    assert reply.status == 400 and "EGRESSD_VAULT_MAX_BINDINGS" in reply.text
    assert env.control.vaults["u-1"].revision == 1
    assert all(SECRET not in line for line in env.transcript)


async def test_a_replayed_push_over_the_caps_creates_nothing(aiohttp_client: Any) -> None:
    env = await small_env(aiohttp_client)
    assert (await env.call("PUT", "/credential-vault", body=two_credentials())).status == 202  # cached
    await env.register()  # replayed after SET_BINDING: refused like a live write
    assert "u-1" not in env.control.vaults


async def test_a_sealed_vault_over_the_caps_is_a_400_set_binding(aiohttp_client: Any, keys_dir: Path) -> None:
    env = await small_env(aiohttp_client, keys_dir=keys_dir)
    reply = await env.act(set_binding("u-1", wrapper(two_credentials())))
    assert reply.status == 400, reply.text
    assert "EGRESSD_VAULT_MAX_CREDENTIALS" in reply.text and SECRET not in reply.text
    assert env.state() == "absent"
    await env.ok(set_binding("u-1", wrapper(vault_doc())))
    await env.ok(hook("u-1"))
    assert env.control.vaults["u-1"].revision == 1
