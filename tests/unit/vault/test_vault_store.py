"""§6 credential vault store: the operation table, revisions, atomic PATCH, tags, snapshots."""

from __future__ import annotations

import base64
import copy
import itertools
import json
import re
from typing import Any

import pytest

from egressd.policy import NetworkPolicy, parse_policy_obj
from egressd.vault.parse import parse_create
from egressd.vault.snapshot import VaultSnapshot
from egressd.vault.store import Vault, VaultStore
from egressd.vault.types import VaultError

SECRET = "s3cr3t VALUE/never&echo"
SECRET2 = "second-secret-ZZZ"
PLACEHOLDER = "__PLACEHOLDER_TOKEN__"

POLICY = parse_policy_obj(
    {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": "api.example.com"},
            {"action": "allow", "target": "*.svc.example.com"},
            {"action": "allow", "target": "other.example.com"},
        ],
    }
)


def cred(name: str, value: str = SECRET) -> dict[str, Any]:
    return {"name": name, "source": {"type": "inline", "value": value}}


def binding(
    name: str, hosts: list[str] | None = None, auth: dict[str, Any] | None = None, **match: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "match": {"hosts": hosts or ["api.example.com"], **match},
        "auth": auth or {"type": "bearer", "credential": "tok"},
    }


def create_body() -> dict[str, Any]:
    return {
        "credentials": [cred("tok"), cred("key", SECRET2)],
        "bindings": [
            binding("zeta", ["api.example.com"]),
            binding(
                "alpha",
                ["*.svc.example.com"],
                {
                    "type": "apiKey",
                    "name": "x-api-key",
                    "credential": "key",
                    "substitutions": [
                        {"credential": "tok", "placeholder": PLACEHOLDER, "in": ["query", "body"]}
                    ],
                },
            ),
        ],
    }


def counter_ids() -> Any:
    n = itertools.count()
    return lambda: f"inc{next(n)}"


@pytest.fixture
def store() -> VaultStore:
    return VaultStore(new_incarnation=counter_ids())


def created(store: VaultStore) -> VaultStore:
    status, _ = store.post(create_body(), POLICY)
    assert status == 201
    return store


def assert_no_secret(*things: object) -> None:
    for thing in things:
        text = json.dumps(thing) if isinstance(thing, dict | list) else repr(thing)
        for secret in (SECRET, SECRET2):
            assert secret not in text
            assert secret not in str(thing)


def snapshot_of(store: VaultStore) -> VaultSnapshot:
    snap = store.snapshot()
    assert snap is not None
    return snap


# ---------------------------------------------------------------------------------------------
# POST


def test_post_absent_creates_revision_1(store: VaultStore) -> None:
    status, state = store.post(create_body(), POLICY)
    assert status == 201
    assert state == {
        "revision": 1,
        "credentials": [
            {"name": "key", "sourceType": "inline", "revision": 1},
            {"name": "tok", "sourceType": "inline", "revision": 1},
        ],
        "bindings": [
            {
                "name": "alpha",
                "revision": 1,
                "match": {
                    "schemes": ["https"],
                    "hosts": ["*.svc.example.com"],
                    "methods": ["GET", "POST", "PUT", "PATCH", "DELETE"],
                    "paths": ["/*"],
                },
                "auth": {"type": "apiKey", "name": "X-Api-Key"},
            },
            {
                "name": "zeta",
                "revision": 1,
                "match": {
                    "schemes": ["https"],
                    "hosts": ["api.example.com"],
                    "methods": ["GET", "POST", "PUT", "PATCH", "DELETE"],
                    "paths": ["/*"],
                },
                "auth": {"type": "bearer"},
            },
        ],
    }
    assert_no_secret(state)
    assert PLACEHOLDER not in json.dumps(state)
    assert store.get() == (200, state)
    assert store.tag == "inc0-1"


def test_post_exists_409(store: VaultStore) -> None:
    created(store)
    before = store.get()
    status, err = store.post(create_body(), POLICY)
    assert status == 409 and err is not None and "already exists" in err["error"]
    # 409 even for an invalid body
    assert store.post({"junk": 1}, POLICY)[0] == 409
    assert store.get() == before


def test_post_invalid_400_nothing_stored(store: VaultStore) -> None:
    body = create_body()
    body["bindings"][0]["match"]["hosts"] = ["*"]
    status, err = store.post(body, POLICY)
    assert status == 400 and err is not None
    assert err["error"].startswith("bindings[0].match.hosts[0]: ")
    assert_no_secret(err)
    assert store.get()[0] == 404 and store.vault is None and store.snapshot() is None


def test_post_missing_bindings_key_400(store: VaultStore) -> None:
    assert store.post({"credentials": [cred("tok")]}, POLICY)[0] == 400
    assert store.post({"bindings": []}, POLICY)[0] == 400
    assert store.post(None, POLICY)[0] == 400
    assert not store.exists


def test_bindings_need_a_policy(store: VaultStore) -> None:
    status, err = store.post(create_body(), None)
    assert status == 400 and err is not None and "policy" in err["error"]
    # credentials alone need none
    assert store.post({"credentials": [cred("tok")], "bindings": []}, None)[0] == 201


def test_uncovered_host_400(store: VaultStore) -> None:
    body = create_body()
    body["bindings"][0]["match"]["hosts"] = ["api.example.com", "nope.example.com"]
    status, err = store.post(body, POLICY)
    assert status == 400 and err is not None
    assert err["error"].startswith("bindings['zeta'].match.hosts[1]: ")
    allow_all = parse_policy_obj({"defaultAction": "allow"})
    assert store.post(create_body(), allow_all)[0] == 400


# ---------------------------------------------------------------------------------------------
# PUT


def test_put_absent_creates(store: VaultStore) -> None:
    status, state = store.put(create_body(), POLICY)
    assert status == 201 and state is not None and state["revision"] == 1
    assert {c["revision"] for c in state["credentials"]} == {1}


def test_put_identical_keeps_revision(store: VaultStore) -> None:
    store.put(create_body(), POLICY)
    tag = store.tag
    snap = store.snapshot()
    same = create_body()
    # equivalent after normalisation: reordered items, case, trailing dot, defaults spelled out
    same["credentials"].reverse()
    same["bindings"].reverse()
    same["bindings"][1]["match"] = {
        "hosts": ["API.example.com."],
        "schemes": ["HTTPS"],
        "methods": ["get", "post", "put", "patch", "delete"],
        "paths": ["/*"],
        "ports": [443],
    }
    status, state = store.put(same, POLICY)
    assert status == 200 and state is not None and state["revision"] == 1
    assert store.tag == tag
    assert store.snapshot() is snap


def test_put_changed_bumps_and_all_credentials_get_it(store: VaultStore) -> None:
    created(store)
    store.patch({"credentials": {"add": [cred("extra", "e")]}}, POLICY)  # rev 2; tok/key stay 1
    body = create_body()
    body["credentials"][0]["source"]["value"] = "rotated"  # tok changes; key unchanged
    status, state = store.put(body, POLICY)
    assert status == 200 and state is not None
    assert state["revision"] == 3
    assert [(c["name"], c["revision"]) for c in state["credentials"]] == [("key", 3), ("tok", 3)]
    assert {b["revision"] for b in state["bindings"]} == {3}
    assert store.tag == "inc0-3"


def test_put_invalid_leaves_state(store: VaultStore) -> None:
    created(store)
    before, tag = store.get(), store.tag
    body = create_body()
    body["bindings"][1]["auth"]["name"] = "Content-Type"
    status, err = store.put(body, POLICY)
    assert status == 400 and err is not None
    assert err["error"].startswith("bindings[1].auth.name: ")
    assert store.get() == before and store.tag == tag


def test_put_value_change_only_is_a_change(store: VaultStore) -> None:
    created(store)
    body = create_body()
    body["credentials"][1]["source"]["value"] = "new-key-value"
    status, state = store.put(body, POLICY)
    assert status == 200 and state is not None and state["revision"] == 2
    assert_no_secret(state)
    assert "new-key-value" not in json.dumps(state)


# ---------------------------------------------------------------------------------------------
# PATCH


def test_patch_absent_404(store: VaultStore) -> None:
    status, err = store.patch({"expectedRevision": 1}, POLICY)
    assert status == 404 and err is not None
    assert store.patch({"junk": True}, POLICY)[0] == 404


def test_patch_expected_revision_checked_first(store: VaultStore) -> None:
    created(store)
    status, err = store.patch(
        {"expectedRevision": 7, "credentials": {"delete": ["missing"]}, "junk": 1}, POLICY
    )
    assert status == 409 and err is not None and "7" in err["error"] and "1" in err["error"]
    assert store.revision == 1
    # a matching revision proceeds; a non-integer one is a 400
    assert store.patch({"expectedRevision": 1}, POLICY)[0] == 200
    assert store.patch({"expectedRevision": "2"}, POLICY)[0] == 400


def test_patch_revisions(store: VaultStore) -> None:
    created(store)
    status, state = store.patch(
        {
            "expectedRevision": 1,
            "credentials": {"add": [cred("new", "n")], "replace": [cred("key", "rotated")]},
        },
        POLICY,
    )
    assert status == 200 and state is not None
    assert state["revision"] == 2
    assert [(c["name"], c["revision"]) for c in state["credentials"]] == [("key", 2), ("new", 2), ("tok", 1)]
    assert {b["revision"] for b in state["bindings"]} == {2}  # bindings report the vault revision
    status, state = store.patch({"credentials": {"replace": [cred("tok", "t2")]}}, POLICY)
    assert state is not None
    assert [(c["name"], c["revision"]) for c in state["credentials"]] == [("key", 2), ("new", 2), ("tok", 3)]
    vault = store.vault
    assert vault is not None
    assert vault.bindings["zeta"].revision == 1 and vault.credentials["tok"].revision == 3


def test_patch_empty_bumps_revision(store: VaultStore) -> None:
    created(store)
    status, state = store.patch({}, POLICY)
    assert status == 200 and state is not None and state["revision"] == 2
    assert store.tag == "inc0-2"


def test_patch_order_deletes_replaces_adds(store: VaultStore) -> None:
    created(store)
    # delete a binding and the credential only it used, add a binding in the same request
    status, state = store.patch(
        {
            "credentials": {"delete": ["key"]},
            "bindings": {
                "delete": ["alpha"],
                "add": [binding("beta", ["*.svc.example.com"], paths=["/v2/*"])],
                "replace": [binding("zeta", ["api.example.com", "other.example.com"], methods=["GET"])],
            },
        },
        POLICY,
    )
    assert status == 200 and state is not None
    assert [c["name"] for c in state["credentials"]] == ["tok"]
    assert [b["name"] for b in state["bindings"]] == ["beta", "zeta"]
    assert state["bindings"][1]["match"]["hosts"] == ["api.example.com", "other.example.com"]
    assert state["bindings"][1]["match"]["methods"] == ["GET"]
    # a binding can move onto a host freed by a delete in the same PATCH
    status, _ = store.patch(
        {"bindings": {"delete": ["beta"], "add": [binding("gamma", ["*.svc.example.com"])]}},
        POLICY,
    )
    assert status == 200


@pytest.mark.parametrize(
    ("mutation", "needle"),
    [
        ({"credentials": {"delete": ["tok"]}}, "bindings['alpha'].auth.substitutions[0].credential"),
        ({"credentials": {"delete": ["nope"]}}, "credentials.delete[0]: credential 'nope' does not exist"),
        (
            {"credentials": {"replace": [cred("nope")]}},
            "credentials.replace[0].name: credential 'nope' does not exist",
        ),
        ({"credentials": {"add": [cred("tok")]}}, "credentials.add[0].name: credential 'tok' already exists"),
        ({"credentials": {"add": [cred("a"), cred("a")]}}, "credentials.add[1]"),
        ({"credentials": {"add": [cred("a")], "delete": ["a"]}}, "credentials.add[0]"),
        ({"bindings": {"delete": ["nope"]}}, "bindings.delete[0]: binding 'nope' does not exist"),
        (
            {"bindings": {"replace": [binding("nope")]}},
            "bindings.replace[0].name: binding 'nope' does not exist",
        ),
        ({"bindings": {"add": [binding("zeta")]}}, "bindings.add[0].name: binding 'zeta' already exists"),
        ({"bindings": {"add": [binding("dup", paths=["/v1/*"])]}}, "'dup' and 'zeta' are ambiguous"),
        ({"bindings": {"add": [binding("far", ["far.example.org"])]}}, "bindings['far'].match.hosts[0]"),
        ({"bindings": {"add": [binding("bad", ["*"])]}}, "bindings.add[0].match.hosts[0]"),
        ({"bindings": {"add": [binding("x", auth={"type": "bearer", "credential": "ghost"})]}}, "'ghost'"),
        ({"credentials": {"add": [cred("blank", "")]}}, "credentials.add[0].source.value: must not be empty"),
        ({"credentials": {"delete": [" "]}}, "credentials.delete[0]: must not be blank"),
        ({"unknown": 1}, "unknown field 'unknown'"),
        ([], "must be an object"),
        (
            {
                "credentials": {"replace": [cred("tok", "fine")], "add": [cred("ok", "fine")]},
                "bindings": {"add": [binding("late", ["nope.example.net"])]},
            },
            "bindings['late'].match.hosts[0]",
        ),
    ],
)
def test_patch_failure_is_atomic(store: VaultStore, mutation: Any, needle: str) -> None:
    created(store)
    before, tag, snap, vault = store.get(), store.tag, store.snapshot(), store.vault
    status, err = store.patch(mutation, POLICY)
    assert status == 400 and err is not None
    assert needle in err["error"], err["error"]
    assert_no_secret(err)
    assert store.get() == before
    assert store.tag == tag and store.vault is vault and store.snapshot() is snap


def test_patch_credential_value_with_crlf_refused(store: VaultStore) -> None:
    created(store)
    status, err = store.patch({"credentials": {"replace": [cred("key", "a\r\nX-Evil: 1")]}}, POLICY)
    assert status == 400 and err is not None and "CR, LF or NUL" in err["error"]
    assert "X-Evil" not in err["error"]


def test_patch_without_policy_refused_when_bindings_remain(store: VaultStore) -> None:
    created(store)
    assert store.patch({}, None)[0] == 400
    status, state = store.patch({"bindings": {"delete": ["alpha", "zeta"]}}, None)
    assert status == 200 and state is not None and state["bindings"] == []


# ---------------------------------------------------------------------------------------------
# DELETE and recreate


def test_delete(store: VaultStore) -> None:
    assert store.delete()[0] == 404
    created(store)
    store.patch({}, POLICY)
    old_tag = store.tag
    assert store.delete() == (204, None)
    assert store.get()[0] == 404 and store.snapshot() is None and store.tag is None
    assert store.delete()[0] == 404
    status, state = store.post(create_body(), POLICY)
    assert status == 201 and state is not None and state["revision"] == 1
    assert store.tag != old_tag and store.tag == "inc1-1"


def test_recreate_changes_tag_even_with_a_stuck_id_generator() -> None:
    store = VaultStore(new_incarnation=lambda: "same")
    created(store)
    first = store.tag
    store.delete()
    created(store)
    assert store.tag != first and store.revision == 1


def test_default_incarnation_is_random_hex() -> None:
    a, b = VaultStore(), VaultStore()
    created(a)
    created(b)
    assert a.tag is not None and b.tag is not None
    assert re.fullmatch(r"[0-9a-f]{16}-1", a.tag)
    assert a.tag != b.tag


def test_clear() -> None:
    store = created(VaultStore(new_incarnation=counter_ids()))
    store.clear()
    assert not store.exists and store.get()[0] == 404
    store.clear()  # idempotent
    assert store.put(create_body(), POLICY)[0] == 201 and store.tag == "inc1-1"


# ---------------------------------------------------------------------------------------------
# Reads


def test_reads_absent(store: VaultStore) -> None:
    for status, body in (
        store.get(),
        store.credentials(),
        store.credential("tok"),
        store.bindings(),
        store.binding("zeta"),
    ):
        assert status == 404 and body is not None and "error" in body


def test_reads(store: VaultStore) -> None:
    created(store)
    store.patch({"credentials": {"replace": [cred("key", "k2")]}}, POLICY)
    assert store.credentials() == (
        200,
        {
            "revision": 2,
            "credentials": [
                {"name": "key", "sourceType": "inline", "revision": 2},
                {"name": "tok", "sourceType": "inline", "revision": 1},
            ],
        },
    )
    assert store.credential("tok") == (200, {"name": "tok", "sourceType": "inline", "revision": 1})
    status, body = store.credential("nope")
    assert status == 404 and body is not None and "'nope'" in body["error"]
    status, body = store.bindings()
    assert status == 200 and body is not None
    assert body["revision"] == 2 and [b["name"] for b in body["bindings"]] == ["alpha", "zeta"]
    status, body = store.binding("zeta")
    assert status == 200 and body == {
        "name": "zeta",
        "revision": 2,
        "match": {
            "schemes": ["https"],
            "hosts": ["api.example.com"],
            "methods": ["GET", "POST", "PUT", "PATCH", "DELETE"],
            "paths": ["/*"],
        },
        "auth": {"type": "bearer"},
    }
    assert store.binding("nope")[0] == 404
    assert_no_secret(store.get()[1], store.credentials()[1], store.bindings()[1], store.binding("alpha")[1])


def test_state_is_a_copy(store: VaultStore) -> None:
    created(store)
    _, state = store.get()
    assert state is not None
    state["bindings"][0]["match"]["hosts"].append("evil.example.com")
    state["credentials"].clear()
    _, again = store.get()
    assert again is not None and len(again["credentials"]) == 2
    assert again["bindings"][0]["match"]["hosts"] == ["*.svc.example.com"]


# ---------------------------------------------------------------------------------------------
# Snapshot


def test_snapshot_headers_and_substitutions(store: VaultStore) -> None:
    body = {
        "credentials": [cred("tok"), cred("key", SECRET2), cred("b64", "dXNlcjpwYXNz")],
        "bindings": [
            binding("bearer", ["api.example.com"], paths=["/v1/*"]),
            binding("basic", ["api.example.com"], {"type": "basic", "credential": "b64"}, paths=["/v2/*"]),
            binding(
                "apikey", ["a.svc.example.com"], {"type": "apiKey", "name": "x-api-key", "credential": "key"}
            ),
            binding(
                "custom",
                ["b.svc.example.com"],
                {
                    "type": "customHeaders",
                    "headers": [
                        {"name": "x-one", "credential": "tok"},
                        {"name": "X-Two", "credential": "key"},
                    ],
                },
            ),
            binding(
                "pass",
                ["other.example.com"],
                {
                    "type": "passthrough",
                    "substitutions": [
                        {"credential": "tok", "placeholder": PLACEHOLDER, "in": ["path", "body"]}
                    ],
                },
            ),
        ],
    }
    assert store.post(body, POLICY)[0] == 201
    snap = snapshot_of(store)
    assert snap.tag == "inc0-1" and snap.revision == 1 and snap.incarnation == "inc0"
    wire = snap.to_json()
    by = {b["name"]: b for b in wire["bindings"]}
    assert [b["name"] for b in wire["bindings"]] == ["apikey", "basic", "bearer", "custom", "pass"]
    assert by["bearer"]["headers"] == [{"name": "Authorization", "value": f"Bearer {SECRET}"}]
    assert by["basic"]["headers"] == [{"name": "Authorization", "value": "Basic dXNlcjpwYXNz"}]
    assert by["apikey"]["headers"] == [{"name": "X-Api-Key", "value": SECRET2}]
    assert by["custom"]["headers"] == [
        {"name": "X-One", "value": SECRET},
        {"name": "X-Two", "value": SECRET2},
    ]
    assert by["pass"]["headers"] == []
    assert by["pass"]["substitutions"] == [
        {"placeholder": PLACEHOLDER, "value": SECRET, "in": ["path", "body"]}
    ]
    assert by["bearer"]["substitutions"] == []
    assert by["bearer"]["match"]["paths"] == ["/v1/*"]
    redactions = set(wire["redactions"])
    assert {
        SECRET,
        SECRET2,
        "dXNlcjpwYXNz",
        f"Bearer {SECRET}",
        "Basic dXNlcjpwYXNz",
        PLACEHOLDER,
        "s3cr3t%20VALUE%2Fnever%26echo",
        "s3cr3t+VALUE%2Fnever%26echo",
    } <= redactions
    assert wire["redactions"] == sorted(wire["redactions"], key=lambda r: (-len(r), r))
    json.dumps(wire)  # serialisable
    # nothing readable leaks through repr/str
    assert_no_secret(snap, snap.bindings, store, store.vault)
    assert "dXNlcjpwYXNz" not in repr(snap) and PLACEHOLDER not in repr(snap)


@pytest.mark.parametrize(
    ("pair", "extra", "absent"),
    [
        ("user:pass", {"user:pass", "user%3Apass"}, {"pass", "user"}),  # short password: the pair only
        ("bot:s3cr3t/pa55word", {"bot:s3cr3t/pa55word", "s3cr3t/pa55word", "s3cr3t%2Fpa55word"}, {"bot"}),
        ("no-colon", set(), {"no-colon"}),
    ],
)
def test_snapshot_redacts_what_a_basic_credential_decodes_to(
    store: VaultStore, pair: str, extra: set[str], absent: set[str]
) -> None:
    """An upstream may echo what it decoded from ``Basic <base64(user:password)>``."""
    value = base64.b64encode(pair.encode()).decode()
    body = {
        "credentials": [cred("b", value)],
        "bindings": [binding("basic", ["api.example.com"], {"type": "basic", "credential": "b"})],
    }
    assert store.post(body, POLICY)[0] == 201
    redactions = set(snapshot_of(store).redactions)
    assert {value, f"Basic {value}"} | extra <= redactions
    assert not absent & redactions


def test_snapshot_json_escaped_redaction(store: VaultStore) -> None:
    value = 'quote"and\\back\u00e9'
    body = {
        "credentials": [cred("tok", value)],
        "bindings": [
            binding(
                "pass",
                ["api.example.com"],
                {
                    "type": "passthrough",
                    "substitutions": [{"credential": "tok", "placeholder": "P", "in": ["body"]}],
                },
            )
        ],
    }
    assert store.post(body, POLICY)[0] == 201
    redactions = snapshot_of(store).redactions
    assert 'quote\\"and\\\\back\\u00e9' in redactions
    assert 'quote\\"and\\\\back\u00e9' in redactions


def test_snapshot_cached_until_mutation(store: VaultStore) -> None:
    assert store.snapshot() is None
    created(store)
    first = store.snapshot()
    assert first is not None and store.snapshot() is first
    store.patch({"credentials": {"replace": [cred("tok", "rotated")]}}, POLICY)
    second = snapshot_of(store)
    assert second is not first and second.tag == "inc0-2"
    assert "rotated" in second.redactions and SECRET not in second.redactions
    headers = {b.name: b.headers for b in second.bindings}
    assert headers["zeta"][0].value == "Bearer rotated"
    # the old snapshot is immutable and unchanged
    assert first.tag == "inc0-1" and SECRET in first.redactions


def test_snapshot_is_immutable(store: VaultStore) -> None:
    created(store)
    snap = snapshot_of(store)
    with pytest.raises(AttributeError):
        snap.revision = 9  # type: ignore[misc]
    vault = store.vault
    assert isinstance(vault, Vault)
    with pytest.raises(TypeError):
        vault.credentials["x"] = vault.credentials["tok"]  # type: ignore[index]


# ---------------------------------------------------------------------------------------------
# Helpers for the fleet / sidecar


def test_check_policy(store: VaultStore) -> None:
    store.check_policy(None)  # no vault
    created(store)
    store.check_policy(POLICY)
    narrower = parse_policy_obj({"egress": [{"action": "allow", "target": "api.example.com"}]})
    with pytest.raises(VaultError) as info:
        store.check_policy(narrower)
    assert info.value.status == 400 and "'*.svc.example.com'" in str(info.value)
    with pytest.raises(VaultError):
        store.check_policy(None)


def test_check_content_and_put_content(store: VaultStore) -> None:
    content = parse_create(create_body())
    store.check_content(content, POLICY)
    with pytest.raises(VaultError):
        store.check_content(content, None)
    assert not store.exists
    assert store.put_content(content, POLICY)[0] == 201
    assert store.put_content(content, POLICY) == (200, store.get()[1])
    assert store.revision == 1


def test_ignore_hosts_store() -> None:
    store = VaultStore(ignore_hosts=[re.compile(r"^api\.example\.com")])
    status, err = store.post(create_body(), POLICY)
    assert status == 400 and err is not None and "ignore_hosts" in err["error"]


def test_policy_variants(store: VaultStore) -> None:
    pol: NetworkPolicy = parse_policy_obj(
        {
            "defaultAction": "allow",
            "egress": [
                {"action": "allow", "target": "*.example.com"},
            ],
        }
    )
    assert store.post(create_body(), pol)[0] == 201


def test_planted_secret_never_in_any_output(store: VaultStore) -> None:
    """Run every operation, successful or not, and look for the values everywhere but the
    snapshot's wire form."""
    outputs: list[object] = []
    body = create_body()
    outputs += [store.post(body, POLICY), store.post(body, POLICY), store.put(body, POLICY)]
    broken = copy.deepcopy(body)
    broken["bindings"][0]["auth"] = {"type": "bearer", "credential": "tok", "value": SECRET}
    outputs += [store.put(broken, POLICY)]
    outputs += [
        store.patch({"credentials": {"replace": [cred("tok", SECRET + "x")]}}, POLICY),
        store.patch({"credentials": {"add": [cred("tok", SECRET)]}}, POLICY),
        store.patch({"expectedRevision": 99, "credentials": {"add": [cred("z", SECRET)]}}, POLICY),
        store.get(),
        store.credentials(),
        store.bindings(),
        store.credential("tok"),
        store.binding("alpha"),
    ]
    outputs += [store, store.vault, store.snapshot(), store.vault and store.vault.credentials]
    assert_no_secret(*outputs)
    for out in outputs:
        if isinstance(out, tuple) and out[1] is not None:
            assert SECRET not in json.dumps(out[1])


# ---------------------------------------------------------------------------------------------
# 14.7: the caps hold for what a mutation adds on top of what is there


def test_patch_cannot_grow_a_vault_past_the_caps() -> None:
    from egressd.vault.types import VaultLimits

    store = VaultStore(limits=VaultLimits(credentials=3, bindings=2))
    status, _ = store.post(create_body(), POLICY)
    assert status == 201
    before = store.get()
    # Two credentials are there; each list alone is within the cap, the sum is not.
    status, out = store.patch({"credentials": {"add": [cred("extra1"), cred("extra2")]}}, POLICY)
    assert status == 400 and out is not None
    assert out["error"] == "credentials: 4 credentials exceed the limit of 3 (EGRESSD_VAULT_MAX_CREDENTIALS)"
    assert SECRET not in json.dumps(out)
    assert store.get() == before
    status, out = store.patch({"bindings": {"add": [binding("third", ["other.example.com"])]}}, POLICY)
    assert status == 400 and out is not None and "3 bindings exceed the limit of 2" in out["error"]
    assert store.get() == before
    status, _ = store.patch({"credentials": {"add": [cred("extra1")]}}, POLICY)
    assert status == 200


def test_put_over_the_caps_is_refused_whole() -> None:
    from egressd.vault.types import VaultLimits

    store = VaultStore(limits=VaultLimits(credentials=1))
    status, out = store.put(create_body(), POLICY)
    assert status == 400 and out is not None and "EGRESSD_VAULT_MAX_CREDENTIALS" in out["error"]
    assert not store.exists
