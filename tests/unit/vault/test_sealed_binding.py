"""Sealed vault in the binding input (docs/reference/behaviour.md §11, §3, §6) through the real fleet app.

Real AES-256-GCM keys in a temporary EGRESSD_VAULT_KEYS_DIR, wrappers built with
``egressd.vault.sealed.seal``, envelopes POSTed to /_fastlet/v1/actions. The harness (fake
kernel, fake clock, recorded transcript, captured logs) is the one of test_proxy_route.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from egressd.actionhandler.inputs import InputError, VaultAction, parse_binding_input
from egressd.policy import AlwaysRules, Verdict
from egressd.policy.always import parse_always_text
from egressd.vault.keys import KeyStore
from egressd.vault.sealed import build_wrapper, seal
from tests.unit.fleet.test_proxy_route import (
    POLICY,
    POLICY_TEXT,
    SECRET,
    Env,
    FakeClock,
    assert_exception_clean,
    assert_no_secret,
    hook,
    make_env,
    remove,
    set_binding,
    vault_doc,
)

K1 = bytes(range(32))
K2 = bytes(range(100, 132))
K3 = bytes(range(200, 232))
IP = ipaddress.ip_address("10.0.0.5")


def write_key(directory: Path, kid: str, key: bytes, *, as_base64: bool = False) -> None:
    data = base64.b64encode(key) + b"\n" if as_base64 else key
    (directory / f"{kid}.key").write_bytes(data)


@pytest.fixture
def logs() -> Iterator[list[Any]]:
    with capture_logs() as captured:
        yield captured


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    d.mkdir()
    write_key(d, "k1", K1)
    write_key(d, "k2", K2, as_base64=True)
    (d / "README").write_text("not a key\n")
    return d


def sealed(
    doc: object, uid: str = "u-1", *, kid: str = "k1", key: bytes = K1, raw: bytes | None = None
) -> dict[str, Any]:
    plaintext = raw if raw is not None else json.dumps(doc).encode()
    return seal(plaintext, uid, kid, key)


def wrapper(
    doc: object = None,
    uid: str = "u-1",
    *,
    policy: object = POLICY,
    vault: dict[str, Any] | None = None,
    **kw: Any,
) -> str:
    """The binding input string: ``policy`` + a vault sealed for ``uid`` (``doc`` None: no vault)."""
    if vault is None and doc is not None:
        vault = sealed(doc, uid, **kw)
    return json.dumps(build_wrapper(policy, vault))


@pytest.fixture
async def env(aiohttp_client: Any, keys_dir: Path, logs: list[dict[str, Any]]) -> AsyncIterator[Env]:
    e = await make_env(aiohttp_client, keys_dir=keys_dir)
    yield e
    assert_no_secret(e, logs)


async def activate_sealed(env: Env, value: str = SECRET, uid: str = "u-1") -> str:
    """SET_BINDING with a sealed vault + data-plane-ready; returns the vault tag."""
    await env.ok(set_binding(uid, wrapper(vault_doc(value), uid)))
    await env.ok(hook(uid))
    store = env.control.vaults[uid]
    assert store.tag is not None
    return store.tag


def policy_of(env: Env, uid: str = "u-1") -> Any:
    entry = env.control.registry.get(uid)
    assert entry is not None
    return entry.policy.to_json() if entry.policy is not None else None


# =========================================================================== happy path


async def test_sealed_vault_activates_at_data_plane_ready(env: Env) -> None:
    doc = set_binding(input=wrapper(vault_doc()))
    reply = await env.act(doc)
    assert reply.status == 200
    assert reply.json() == {}
    assert env.state() == "denying"
    # Pending, not visible: nothing injected, the proxy route sees no vault yet.
    assert env.control.vault_for_ip(IP) is None
    assert "u-1" not in env.control.vaults
    assert (await env.call("GET", "/credential-vault")).status == 404
    assert (await env.call("GET", "/policy")).json()["status"] == "denying"

    await env.ok(hook())
    assert env.state() == "active"
    got = await env.call("GET", "/credential-vault")
    assert got.status == 200
    assert got.json()["revision"] == 1
    assert got.json()["credentials"] == [{"name": "tok", "sourceType": "inline", "revision": 1}]
    snap = env.control.vault_for_ip(IP)
    assert snap is not None
    assert snap.revision == 1
    assert snap.bindings[0].headers[0].value == f"Bearer {SECRET}"
    tag = snap.tag

    # The identical SET_BINDING replayed (Fastlet restart): revision and tag unchanged.
    await env.ok(doc)
    assert env.control.vaults["u-1"].revision == 1
    assert env.control.vaults["u-1"].tag == tag
    # Same plaintext sealed again (fresh nonce, other kid): still identical content.
    await env.ok(set_binding(input=wrapper(vault_doc(), kid="k2", key=K2)))
    assert env.control.vaults["u-1"].revision == 1
    assert env.control.vaults["u-1"].tag == tag
    # Changed plaintext: revision 2 in place.
    await env.ok(set_binding(input=wrapper(vault_doc("rotated-value"))))
    assert env.state() == "active"
    assert (await env.call("GET", "/credential-vault")).json()["revision"] == 2
    snap = env.control.vault_for_ip(IP)
    assert snap is not None and snap.revision == 2 and snap.tag != tag
    assert snap.bindings[0].headers[0].value == "Bearer rotated-value"


async def test_replayed_set_binding_while_denying_activates_revision_one(env: Env) -> None:
    doc = set_binding(input=wrapper(vault_doc()))
    await env.ok(doc)
    await env.ok(doc)
    await env.ok(set_binding(input=wrapper(vault_doc("latest"))))  # latest wins while pending
    await env.ok(hook())
    store = env.control.vaults["u-1"]
    assert store.revision == 1
    assert store.vault is not None and store.vault.credentials["tok"].value == "latest"


async def test_retried_data_plane_ready_keeps_the_vault(env: Env) -> None:
    tag = await activate_sealed(env)
    await env.ok(hook())
    assert env.control.vaults["u-1"].tag == tag


async def test_activation_failure_keeps_the_pending_vault_for_the_retry(env: Env) -> None:
    await env.ok(set_binding(input=wrapper(vault_doc())))
    env.tx.fail(op="static_apply", kinds=("script", "batch"))
    assert (await env.act(hook())).status == 500
    assert env.state() == "denying"
    assert "u-1" not in env.control.vaults
    assert env.control.vault_for_ip(IP) is None
    await env.ok(hook())
    assert env.control.vaults["u-1"].revision == 1


async def test_in_place_apply_failure_keeps_the_old_vault(env: Env) -> None:
    tag = await activate_sealed(env)
    env.tx.fail(op="static_apply", kinds=("script", "batch"))
    # The IP rule: the change is a kernel swap, which the kernel refuses (a swap rewrites only
    # the sets that change; a name alone changes none of them).
    more = [{"action": "allow", "target": "x.example.com"}, {"action": "allow", "target": "203.0.113.9"}]
    other = dict(POLICY, egress=[*POLICY["egress"], *more])
    reply = await env.act(set_binding(input=wrapper(vault_doc("new-value"), policy=other), gen=2))
    assert reply.status == 500
    assert policy_of(env) == POLICY
    assert env.control.vaults["u-1"].tag == tag
    await env.ok(set_binding(input=wrapper(vault_doc("new-value"), policy=other), gen=2))
    assert policy_of(env) == other
    assert env.control.vaults["u-1"].revision == 2


@pytest.mark.parametrize("form", ["null", "absent"])
async def test_wrapper_without_vault_removes_only_the_vault(env: Env, form: str) -> None:
    await activate_sealed(env)
    new_policy = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "other.example.com"}]}
    doc: dict[str, Any] = {"osbEgressInput": 1, "policy": new_policy}
    if form == "null":
        doc["vault"] = None
    mark = env.tx.mark()
    await env.ok(set_binding(input=json.dumps(doc), gen=2))
    assert env.state() == "active"
    assert policy_of(env) == new_policy
    assert env.tx.applied_since(mark, "static_apply")
    assert "u-1" not in env.control.vaults
    assert env.control.vault_for_ip(IP) is None
    assert (await env.call("GET", "/credential-vault")).status == 404
    assert (await env.call("GET", "/policy")).json()["policy"] == new_policy


async def test_wrapper_without_vault_while_denying_activates_no_vault(env: Env) -> None:
    await env.ok(set_binding(input=wrapper(vault_doc())))
    await env.ok(set_binding(input=wrapper(None)))
    await env.ok(hook())
    assert "u-1" not in env.control.vaults
    assert policy_of(env) == POLICY


async def test_bare_policy_string_leaves_an_active_vault_untouched(env: Env) -> None:
    tag = await activate_sealed(env)
    changed = dict(POLICY, egress=[*POLICY["egress"], {"action": "allow", "target": "x.example.com"}])
    await env.ok(set_binding(input=json.dumps(changed), gen=2))
    assert policy_of(env) == changed
    assert env.control.vaults["u-1"].tag == tag
    snap = env.control.vault_for_ip(IP)
    assert snap is not None and snap.revision == 1


async def test_bare_policy_string_while_denying_keeps_the_pending_sealed_vault(env: Env) -> None:
    await env.ok(set_binding(input=wrapper(vault_doc())))
    changed = dict(POLICY, egress=[*POLICY["egress"], {"action": "allow", "target": "x.example.com"}])
    await env.ok(set_binding(input=json.dumps(changed), gen=2))
    await env.ok(hook())
    assert policy_of(env) == changed
    snap = env.control.vault_for_ip(IP)
    assert snap is not None and snap.revision == 1


async def test_bare_policy_string_keeps_a_pushed_vault(env: Env) -> None:
    await env.register()
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 201
    await env.ok(set_binding(gen=2))
    assert env.control.vaults["u-1"].revision == 1
    # A sealed vault then replaces the pushed one in place (different content -> +1).
    await env.ok(set_binding(input=wrapper(vault_doc("sealed-value")), gen=3))
    assert env.control.vaults["u-1"].revision == 2


async def test_envelope_input_null_removes_policy_and_vault(env: Env) -> None:
    tag = await activate_sealed(env)
    await env.ok(set_binding(input=None))
    assert env.state() == "denying"
    assert "u-1" not in env.control.vaults
    assert env.control.vault_for_ip(IP) is None
    assert (await env.call("GET", "/credential-vault")).status == 404
    pol = (await env.call("GET", "/policy")).json()
    assert pol["status"] == "denying" and "policy" not in pol
    assert (await env.act(hook())).status == 409  # nothing pending
    new_tag = await activate_sealed(env)
    assert env.control.vaults["u-1"].revision == 1
    assert new_tag != tag


async def test_input_null_drops_a_pending_sealed_vault(env: Env) -> None:
    await env.ok(set_binding(input=wrapper(vault_doc())))
    await env.ok(set_binding(input=None))
    await env.ok(set_binding())  # bare policy: nothing sealed pending any more
    await env.ok(hook())
    assert "u-1" not in env.control.vaults


async def test_remove_and_rebind_drop_sealed_vaults(env: Env) -> None:
    await activate_sealed(env)
    await env.ok(remove())
    assert "u-1" not in env.control.vaults
    await env.register()
    assert "u-1" not in env.control.vaults

    # Pending sealed vault of the old fence is not inherited by a rebind.
    await env.ok(set_binding("u-2", wrapper(vault_doc(), "u-2"), ip="10.0.0.6"))
    await env.ok(set_binding("u-2", POLICY_TEXT, ip="10.0.0.6", rid="r2"))
    assert (await env.act(hook("u-2"))).status == 409  # stale fence
    await env.ok(hook("u-2", rid="r2"))
    assert "u-2" not in env.control.vaults

    # Rebind with a new sealed vault: it becomes revision 1 of a new incarnation.
    await env.ok(set_binding("u-3", wrapper(vault_doc(), "u-3"), ip="10.0.0.7"))
    await env.ok(hook("u-3"))
    tag = env.control.vaults["u-3"].tag
    await env.ok(set_binding("u-3", wrapper(vault_doc(), "u-3"), ip="10.0.0.7", rid="r2"))
    assert "u-3" not in env.control.vaults
    await env.ok(hook("u-3", rid="r2"))
    assert env.control.vaults["u-3"].revision == 1
    assert env.control.vaults["u-3"].tag != tag


# =========================================================================== failures


def _flip(ct: str, index: int) -> str:
    blob = bytearray(base64.b64decode(ct))
    blob[index] ^= 0x01
    return base64.b64encode(bytes(blob)).decode()


def _with(vault: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = dict(vault, **changes)
    return {k: v for k, v in out.items() if v is not _DROP}


_DROP = object()


def _case_inputs() -> dict[str, Callable[[str], str]]:
    good = vault_doc()

    def w(vault: object, *, policy: object = POLICY) -> str:
        return json.dumps({"osbEgressInput": 1, "policy": policy, "vault": vault})

    return {
        "unknown-kid": lambda uid: wrapper(good, uid, kid="k9", key=K3),
        "wrong-key-for-kid": lambda uid: wrapper(good, uid, kid="k1", key=K2),
        "aad-other-uid": lambda uid: wrapper(vault=sealed(good, "u-other")),
        "aad-case": lambda uid: wrapper(vault=sealed(good, uid.upper())),
        "corrupted-tag": lambda uid: w(_with(sealed(good, uid), ct=_flip(sealed(good, uid)["ct"], -1))),
        "corrupted-nonce": lambda uid: w(_with(sealed(good, uid), ct=_flip(sealed(good, uid)["ct"], 0))),
        "corrupted-body": lambda uid: w(_with(sealed(good, uid), ct=_flip(sealed(good, uid)["ct"], 14))),
        "bad-base64": lambda uid: w(_with(sealed(good, uid), ct="not base64!!")),
        "urlsafe-base64": lambda uid: w(
            _with(sealed(good, uid), ct=base64.urlsafe_b64encode(b"\xfb\xff" * 30).decode())
        ),
        "unpadded": lambda uid: w(
            _with(sealed(good, uid), ct=base64.b64encode(b"x" * 40).decode().rstrip("="))
        ),
        "too-short": lambda uid: w(_with(sealed(good, uid), ct=base64.b64encode(b"\0" * 27).decode())),
        "empty-ct": lambda uid: w(_with(sealed(good, uid), ct="")),
        "v2": lambda uid: w(_with(sealed(good, uid), v=2)),
        "v-true": lambda uid: w(_with(sealed(good, uid), v=True)),
        "alg": lambda uid: w(_with(sealed(good, uid), alg="A128GCM")),
        "bad-kid": lambda uid: w(_with(sealed(good, uid), kid="../k1")),
        "missing-ct": lambda uid: w(_with(sealed(good, uid), ct=_DROP)),
        "extra-vault-key": lambda uid: w(_with(sealed(good, uid), iv="x")),
        "vault-string": lambda uid: w("sealed"),
        "vault-array": lambda uid: w([sealed(good, uid)]),
        "marker-2": lambda uid: json.dumps(
            {"osbEgressInput": 2, "policy": POLICY, "vault": sealed(good, uid)}
        ),
        "marker-true": lambda uid: json.dumps({"osbEgressInput": True, "policy": POLICY}),
        "marker-string": lambda uid: json.dumps({"osbEgressInput": "1", "policy": POLICY}),
        "unknown-wrapper-key": lambda uid: json.dumps(
            {"osbEgressInput": 1, "policy": POLICY, "vault": sealed(good, uid), "extra": 1}
        ),
        "missing-policy": lambda uid: json.dumps({"osbEgressInput": 1, "vault": sealed(good, uid)}),
        "invalid-policy": lambda uid: w(sealed(good, uid), policy={"defaultAction": "sometimes"}),
        "policy-not-object": lambda uid: w(sealed(good, uid), policy=[1]),
        "plaintext-not-json": lambda uid: wrapper(vault=sealed(None, uid, raw=SECRET.encode())),
        "plaintext-not-utf8": lambda uid: wrapper(vault=sealed(None, uid, raw=b"\xff" + SECRET.encode())),
        "plaintext-not-create-shape": lambda uid: wrapper({"credentials": [], "value": SECRET}, uid),
        "plaintext-empty-value": lambda uid: wrapper(vault_doc(""), uid),
        "plaintext-uncovered-host": lambda uid: wrapper(vault_doc(host="other.example.com"), uid),
        # docs/reference/behaviour.md §20.3: names are kept exactly as sent; spaces at the ends are refused.
        "plaintext-name-with-spaces": lambda uid: wrapper(vault_doc(cred=" tok "), uid),
        "plaintext-name-not-printable": lambda uid: wrapper(vault_doc(binding="b1\x1b[2J"), uid),
        "plaintext-covered-only-by-default-allow": lambda uid: wrapper(
            vault_doc(), uid, policy={"defaultAction": "allow"}
        ),
        "plaintext-dangling-credential": lambda uid: wrapper(
            {
                "credentials": [{"name": "a", "source": {"value": SECRET}}],
                "bindings": [
                    {
                        "name": "b",
                        "match": {"hosts": ["api.example.com"]},
                        "auth": {"type": "bearer", "credential": "zz"},
                    }
                ],
            },
            uid,
        ),
    }


CASES = _case_inputs()


@pytest.mark.parametrize("case", sorted(CASES))
async def test_bad_wrapper_for_absent_subject_is_400_and_registers_nothing(env: Env, case: str) -> None:
    assert (await env.call("PUT", "/credential-vault", body=vault_doc())).status == 202
    mark = env.tx.mark()
    reply = await env.act(set_binding(input=CASES[case]("u-1")))
    assert reply.status == 400, reply.text
    assert reply.text.startswith("invalid binding input")
    assert env.state() == "absent"
    assert env.tx.applied_since(mark) == []
    assert "u-1" not in env.control.vaults
    assert env.control.credentials.pending_pushes.count() == 1  # cached pushes neither replayed nor dropped
    assert (await env.call("GET", "/policy")).status == 404


@pytest.mark.parametrize("case", sorted(CASES))
async def test_bad_wrapper_for_active_subject_changes_nothing(env: Env, case: str) -> None:
    tag = await activate_sealed(env)
    before_policy = policy_of(env)
    mark = env.tx.mark()
    reply = await env.act(set_binding(input=CASES[case]("u-1"), gen=9))
    assert reply.status == 400, reply.text
    assert env.tx.applied_since(mark) == []
    assert env.state() == "active"
    assert policy_of(env) == before_policy
    assert env.control.registry.get("u-1").spec_generation == 1  # type: ignore[union-attr]
    assert env.control.vaults["u-1"].tag == tag
    snap = env.control.vault_for_ip(IP)
    assert snap is not None and snap.tag == tag


@pytest.mark.parametrize(
    "case", ["unknown-kid", "aad-other-uid", "invalid-policy", "plaintext-uncovered-host"]
)
async def test_bad_wrapper_while_denying_keeps_the_pending_vault(env: Env, case: str) -> None:
    await env.ok(set_binding(input=wrapper(vault_doc())))
    reply = await env.act(set_binding(input=CASES[case]("u-1")))
    assert reply.status == 400
    await env.ok(hook())
    assert policy_of(env) == POLICY
    assert env.control.vaults["u-1"].revision == 1


async def test_no_key_directory_means_every_vault_is_an_unknown_kid(
    aiohttp_client: Any, logs: list[dict[str, Any]]
) -> None:
    env = await make_env(aiohttp_client, keys=KeyStore(None))
    reply = await env.act(set_binding(input=wrapper(vault_doc())))
    assert reply.status == 400
    assert "unknown kid" in reply.text
    assert env.state() == "absent"
    await env.ok(set_binding(input=wrapper(None)))  # a wrapper without vault needs no key
    await env.ok(hook())
    assert policy_of(env) == POLICY
    assert_no_secret(env, logs)


# =========================================================================== keys


async def test_rotation_every_present_key_decrypts(env: Env) -> None:
    await env.ok(set_binding(input=wrapper(vault_doc("one"), kid="k1", key=K1)))
    await env.ok(hook())
    assert env.control.vaults["u-1"].revision == 1
    await env.ok(set_binding(input=wrapper(vault_doc("two"), kid="k2", key=K2)))  # base64 key file
    assert env.control.vaults["u-1"].revision == 2
    await env.ok(set_binding(input=wrapper(vault_doc("three"), kid="k1", key=K1)))
    assert env.control.vaults["u-1"].revision == 3


async def test_key_added_after_start_is_found_by_rescan(
    aiohttp_client: Any, keys_dir: Path, logs: list[dict[str, Any]]
) -> None:
    env = await make_env(aiohttp_client, keys=KeyStore(keys_dir, rescan_interval=0))
    write_key(keys_dir, "k3", K3, as_base64=True)
    await env.ok(set_binding(input=wrapper(vault_doc(), kid="k3", key=K3)))
    await env.ok(hook())
    assert env.control.vaults["u-1"].revision == 1
    assert_no_secret(env, logs)


async def test_rescan_is_rate_limited_by_the_clock(
    aiohttp_client: Any, keys_dir: Path, logs: list[dict[str, Any]]
) -> None:
    clock = FakeClock(0.0)
    keys = KeyStore(keys_dir, rescan_interval=1.0, clock=clock)
    env = await make_env(aiohttp_client, keys=keys)
    write_key(keys_dir, "k3", K3)
    doc = set_binding(input=wrapper(vault_doc(), kid="k3", key=K3))
    reply = await env.act(doc)
    assert reply.status == 400  # last scan < 1 s ago: not rescanned
    assert env.state() == "absent"
    clock.advance(1.0)
    await env.ok(doc)
    await env.ok(hook())
    assert env.control.vaults["u-1"].revision == 1
    # The old keys still decrypt after the rescan.
    await env.ok(set_binding(input=wrapper(vault_doc("v2"), kid="k1", key=K1)))
    assert env.control.vaults["u-1"].revision == 2
    assert_no_secret(env, logs)


async def test_broken_key_file_added_later_is_ignored(
    aiohttp_client: Any, keys_dir: Path, logs: list[dict[str, Any]]
) -> None:
    keys = KeyStore(keys_dir, rescan_interval=0)
    env = await make_env(aiohttp_client, keys=keys)
    (keys_dir / "k3.key").write_bytes(b"short")
    reply = await env.act(set_binding(input=wrapper(vault_doc(), kid="k3", key=K3)))
    assert reply.status == 400  # never 500
    assert "unknown kid" in reply.text
    assert set(keys.ignored) == {"k3"}
    await env.ok(set_binding(input=wrapper(vault_doc(), kid="k1", key=K1)))
    assert_no_secret(env, logs)


async def test_removed_and_retired_keys_are_refused_like_an_unknown_kid(
    aiohttp_client: Any, keys_dir: Path, logs: list[dict[str, Any]]
) -> None:
    clock = FakeClock(0.0)
    keys = KeyStore(keys_dir, rescan_interval=1.0, clock=clock)
    env = await make_env(aiohttp_client, keys=keys)
    await env.ok(set_binding(input=wrapper(vault_doc("one"), kid="k1", key=K1)))
    await env.ok(hook())
    # k1.key removed: within one rescan interval SET_BINDING with it is a 400, state untouched.
    (keys_dir / "k1.key").unlink()
    clock.advance(1.0)
    reply = await env.act(set_binding(input=wrapper(vault_doc("two"), kid="k1", key=K1)))
    assert (reply.status, "unknown kid 'k1'" in reply.text) == (400, True), reply.text
    assert env.control.vaults["u-1"].revision == 1
    await env.ok(set_binding(input=wrapper(vault_doc("two"), kid="k2", key=K2)))
    assert env.control.vaults["u-1"].revision == 2
    # Four newer keys: k2 is beyond newest + 3 and answers exactly as a kid never seen.
    t = (keys_dir / "k2.key").stat().st_mtime_ns
    for i in range(3, 7):
        write_key(keys_dir, f"k{i}", bytes([i]) * 32)
        os.utime(keys_dir / f"k{i}.key", ns=(t + i * 10**9, t + i * 10**9))
    clock.advance(1.0)
    retired = await env.act(set_binding(input=wrapper(vault_doc("three"), kid="k2", key=K2)))
    never = await env.act(set_binding(input=wrapper(vault_doc("three"), kid="k9", key=K2)))
    assert retired.status == never.status == 400
    assert retired.text == never.text.replace("k9", "k2")
    assert env.control.vaults["u-1"].revision == 2
    await env.ok(set_binding(input=wrapper(vault_doc("three"), kid="k6", key=bytes([6]) * 32)))
    assert env.control.vaults["u-1"].revision == 3
    assert_no_secret(env, logs)


# =========================================================================== validation order


async def test_invalid_policy_is_reported_before_a_bad_vault(env: Env) -> None:
    bad_vault = {"v": 1, "kid": "k9", "alg": "A256GCM", "ct": "!!"}
    doc = {"osbEgressInput": 1, "policy": {"defaultAction": "sometimes"}, "vault": bad_vault}
    reply = await env.act(set_binding(input=json.dumps(doc)))
    assert reply.status == 400
    assert "invalid policy" in reply.text
    assert "kid" not in reply.text and "base64" not in reply.text


async def test_wrapper_shape_is_reported_before_the_policy(env: Env) -> None:
    doc = {"osbEgressInput": 1, "policy": {"defaultAction": "sometimes"}, "extra": True}
    reply = await env.act(set_binding(input=json.dumps(doc)))
    assert reply.status == 400
    assert "wrapper key" in reply.text


async def test_aead_failure_is_reported_before_vault_validation(env: Env) -> None:
    uncovered = sealed(vault_doc(host="other.example.com"), "u-other")
    reply = await env.act(set_binding(input=wrapper(vault=uncovered)))
    assert reply.status == 400
    assert "cannot be opened" in reply.text
    assert "covered" not in reply.text


async def test_vault_validation_uses_wrapper_policy_plus_always_rules(
    aiohttp_client: Any, keys_dir: Path, logs: list[dict[str, Any]]
) -> None:
    always = AlwaysRules(
        deny=parse_always_text("blocked.example.net\n", "deny.always", Verdict.DENY),
        allow=parse_always_text("always.example.net\n", "allow.always", Verdict.ALLOW),
    )
    env = await make_env(aiohttp_client, keys_dir=keys_dir, always=always)
    deny_all = {"defaultAction": "deny"}
    await env.ok(set_binding(input=wrapper(vault_doc(host="always.example.net"), policy=deny_all)))
    allow_blocked = {
        "defaultAction": "deny",
        "egress": [{"action": "allow", "target": "blocked.example.net"}],
    }
    reply = await env.act(
        set_binding(input=wrapper(vault_doc(host="blocked.example.net"), policy=allow_blocked))
    )
    assert reply.status == 400
    await env.ok(hook())
    assert env.control.vaults["u-1"].revision == 1
    # Validated against the wrapper's policy, not the current one.
    old_only = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "other.example.com"}]}
    reply = await env.act(set_binding(input=wrapper(vault_doc(host="api.example.com"), policy=old_only)))
    assert reply.status == 400
    assert_no_secret(env, logs)


# =========================================================================== secrets


async def test_sealed_secrets_never_leak(env: Env, logs: list[dict[str, Any]]) -> None:
    structlog.get_logger("egressd.test").info("capture.check")
    inputs: list[str] = [wrapper(vault_doc())]
    await env.ok(set_binding(input=inputs[0]))
    await env.ok(hook())
    for case in sorted(CASES):
        text = CASES[case]("u-1")
        inputs.append(text)
        assert (await env.act(set_binding(input=text))).status == 400
    inputs.append(wrapper(vault_doc(SECRET + "-2")))
    await env.ok(set_binding(input=inputs[-1]))
    for suffix in ("/credential-vault", "/credential-vault/credentials/tok", "/credential-vault/bindings/b1"):
        assert (await env.call("GET", suffix)).status == 200
    assert (await env.call("GET", "/credential-vault/_active?clientIp=10.0.0.5")).status == 404
    metrics = await env.metrics_text()
    assert SECRET not in metrics
    await env.ok(set_binding(input=None))
    await env.ok(remove())
    assert any(e.get("event") == "capture.check" for e in logs)
    cts = [
        json.loads(t)["vault"]["ct"]
        for t in inputs
        if isinstance(json.loads(t).get("vault"), dict) and isinstance(json.loads(t)["vault"].get("ct"), str)
    ]
    assert cts
    # Neither values, nor ciphertexts, nor the binding input reach responses or logs.
    assert_no_secret(env, logs, SECRET, *(c for c in cts if len(c) >= 16), *inputs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_input_errors_carry_no_secret(keys_dir: Path, case: str) -> None:
    keys = KeyStore(keys_dir)
    text = CASES[case]("u-1")
    with pytest.raises(InputError) as info:
        parse_binding_input(text, uid="u-1", keys=keys)
    assert_exception_clean(info.value)
    ct = (json.loads(text).get("vault") or {}) if isinstance(json.loads(text).get("vault"), dict) else {}
    if isinstance(ct.get("ct"), str) and len(ct["ct"]) >= 16:
        assert_exception_clean(info.value, ct["ct"])


def test_parsed_input_repr_hides_the_vault(keys_dir: Path) -> None:
    parsed = parse_binding_input(wrapper(vault_doc()), uid="u-1", keys=KeyStore(keys_dir))
    assert parsed.vault is VaultAction.SET
    assert SECRET not in repr(parsed) and SECRET not in str(parsed)
    assert SECRET not in repr(parsed.content)


def test_bare_policy_and_wrapper_without_vault_parse(keys_dir: Path) -> None:
    keys = KeyStore(keys_dir)
    assert parse_binding_input(POLICY_TEXT, uid="u-1", keys=keys).vault is VaultAction.KEEP
    assert parse_binding_input(wrapper(None), uid="u-1", keys=keys).vault is VaultAction.REMOVE
    with_null = json.dumps({"osbEgressInput": 1, "policy": POLICY, "vault": None})
    assert parse_binding_input(with_null, uid="u-1", keys=keys).vault is VaultAction.REMOVE
    # Random key material is never an accepted key for another kid.
    assert (
        parse_binding_input(wrapper(vault_doc(), kid="k2", key=K2), uid="u-1", keys=keys).content is not None
    )
    with pytest.raises(InputError):
        parse_binding_input(wrapper(vault_doc(), kid="k2", key=os.urandom(32)), uid="u-1", keys=keys)


@pytest.mark.parametrize(
    "doc",
    [
        {
            "credentials": [{"name": "k", "source": {"type": "inline", "value": "v"}}],
            "bindings": [
                {
                    "name": "b",
                    "match": {"hosts": ["https://user:hunter2-TOKEN@api.example.com/x"]},
                    "auth": {"type": "bearer", "credential": "k"},
                }
            ],
        },
        {
            "credentials": [{"name": "k", "source": {"type": "inline", "sk-live-SECRETKEY": "v"}}],
            "bindings": [],
        },
    ],
    ids=["url-with-userinfo", "secret-as-key"],
)
def test_sealed_vault_errors_never_quote_the_plaintext(keys_dir: Path, doc: dict[str, Any]) -> None:
    with pytest.raises(InputError) as info:
        parse_binding_input(wrapper(doc), uid="u-1", keys=KeyStore(keys_dir))
    text = str(info.value)
    assert text.startswith("vault: ") and ("hosts[0]" in text or "source" in text)
    for secret in ("hunter2-TOKEN", "sk-live-SECRETKEY", "api.example.com"):
        assert secret not in text
