"""Action envelope parsing: docs/reference/actions-protocol.md §1 and the vectors of §1.1."""

from __future__ import annotations

import copy
import ipaddress
import json
from typing import Any

import pytest

from egressd.actionhandler.envelope import (
    API_VERSION,
    MAX_BODY_BYTES,
    Attachment,
    EnvelopeError,
    HookName,
    LifecycleHook,
    RemoveBinding,
    SetBinding,
    parse_action,
)
from egressd.subject.model import Fence

Doc = dict[str, Any]

NETWORK: Doc = {"ip": "10.0.0.5", "gateway": "10.0.0.1", "hostVeth": "v"}


def m() -> Doc:
    return {
        "apiVersion": API_VERSION,
        "operation": "SET_BINDING",
        "sandbox": {"uid": "u"},
        "revision": {"runtimeInstanceId": "r", "attachmentId": "a"},
    }


def mn(input_: object = "{}") -> Doc:
    doc = m()
    doc["attachment"] = {"network": dict(NETWORK)}
    doc["binding"] = {"input": input_}
    return doc


def b() -> Doc:
    return {
        "apiVersion": API_VERSION,
        "operation": "SET_BINDING",
        "invocationId": "i1",
        "sandbox": {"uid": "u-1", "name": "sb", "namespace": "ns"},
        "revision": {
            "specGeneration": 1,
            "runtimeInstanceId": "r1",
            "attachmentId": "a1",
            "routeGeneration": 1,
        },
        "attachment": {
            "network": {
                "ip": "10.0.0.5",
                "gateway": "10.0.0.1",
                "privateCidr": "10.0.0.0/24",
                "hostVeth": "veth0",
            }
        },
        "binding": {"input": '{"defaultAction":"deny"}'},
    }


def h(name: object) -> Doc:
    doc = b()
    doc["operation"] = "LIFECYCLE_HOOK"
    del doc["binding"]
    del doc["attachment"]
    doc["hook"] = {"name": name, "sequence": 1}
    return doc


def r() -> Doc:
    return {
        "apiVersion": API_VERSION,
        "operation": "REMOVE_BINDING",
        "sandbox": {"uid": "u-1"},
        "revision": {"specGeneration": 1, "runtimeInstanceId": "r1", "attachmentId": "a1"},
    }


def with_(doc: Doc, path: str, value: object) -> Doc:
    """Copy of ``doc`` with the dotted ``path`` set to ``value``."""
    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    node[last] = value
    return out


def without(doc: Doc, path: str) -> Doc:
    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    del node[last]
    return out


def enc(doc: Doc) -> bytes:
    return json.dumps(doc).encode()


def reason(body: bytes) -> str:
    with pytest.raises(EnvelopeError) as info:
        parse_action(body)
    text = str(info.value)
    assert "\n" not in text
    assert not text.startswith("invalid action envelope")
    return text


# --------------------------------------------------------------------------- §1.1 400 vectors

REJECTED: list[tuple[str, bytes, str]] = [
    ("1", enc(with_(mn(), "apiVersion", "v1")), "apiVersion"),
    ("2", enc(with_(m(), "operation", "EXPLODE")), "operation"),
    ("3", enc(without(m(), "sandbox")), "uid"),
    ("4", enc(m()), "binding"),
    ("5", enc(mn(42)), "input"),
    ("6", enc(with_(m(), "binding", {"input": "{}"})), "attachment"),
    ("7", enc(with_(m(), "operation", "LIFECYCLE_HOOK")), "hook"),
    (
        "8",
        enc(with_(with_(m(), "operation", "LIFECYCLE_HOOK"), "hook", {"name": "sandbox.before-delete"})),
        "hook",
    ),
    ("9", enc(without(mn(), "revision")), "revision.runtimeInstanceId"),
    ("10", b"{", "JSON"),
    ("11", enc(with_(b(), "apiVersion", "sandbox.fast.io/actions/v2")), "apiVersion"),
    ("12", enc(with_(b(), "attachment.network.hostVeth", "")), "hostVeth"),
    ("13", enc(without(b(), "revision.runtimeInstanceId")), "runtimeInstanceId"),
    ("14", enc(with_(b(), "revision.attachmentId", "")), "attachmentId"),
    ("15", enc(with_(b(), "sandbox.uid", "")), "uid"),
    ("16", enc(with_(b(), "operation", "set_binding")), "operation"),
    ("17", enc(with_(b(), "binding", {})), "binding.input"),
    ("18", enc(with_(b(), "binding", None)), "binding"),
    ("19", enc(with_(b(), "binding.input", {"defaultAction": "deny"})), "binding.input"),
    ("20", enc(with_(b(), "attachment.network.ip", "not-an-ip")), "attachment.network.ip"),
    ("21", enc(without(b(), "attachment.network.ip")), "attachment.network.ip"),
    ("22", enc(h("")), "hook"),
    ("23", enc(without(r(), "revision")), "revision.runtimeInstanceId"),
    ("24", enc(with_(b(), "revision.specGeneration", -1)), "specGeneration"),
    ("32", b'{"pad":"' + b"x" * (MAX_BODY_BYTES + 1 - len(b'{"pad":""}')) + b'"}', "body"),
]


@pytest.mark.parametrize(("vector", "body", "field"), REJECTED, ids=[v[0] for v in REJECTED])
def test_rejected_vectors(vector: str, body: bytes, field: str) -> None:
    if vector == "32":
        assert len(body) == MAX_BODY_BYTES + 1
    assert field in reason(body)


def test_vector_8_reports_unknown_hook_name() -> None:
    doc = with_(with_(m(), "operation", "LIFECYCLE_HOOK"), "hook", {"name": "sandbox.before-delete"})
    text = reason(enc(doc))
    assert "unknown hook" in text
    assert "sandbox.before-delete" in text


# --------------------------------------------------------------------------- §1.1 accepted vectors

FENCE_1 = Fence(runtime_instance_id="r1", attachment_id="a1")
ATTACHMENT_B = Attachment(
    ip=ipaddress.IPv4Address("10.0.0.5"),
    host_veth="veth0",
    gateway=ipaddress.IPv4Address("10.0.0.1"),
    private_cidr=ipaddress.IPv4Network("10.0.0.0/24"),
)


def test_vector_25_full_set_binding() -> None:
    action = parse_action(enc(b()))
    assert action == SetBinding(
        uid="u-1",
        fence=FENCE_1,
        spec_generation=1,
        attachment=ATTACHMENT_B,
        input='{"defaultAction":"deny"}',
    )


@pytest.mark.parametrize("with_attachment", [True, False])
def test_vector_26_null_input(with_attachment: bool) -> None:
    doc = with_(b(), "binding.input", None)
    if not with_attachment:
        doc = without(doc, "attachment")
    action = parse_action(enc(doc))
    assert isinstance(action, SetBinding)
    assert action.input is None
    assert action.attachment == (ATTACHMENT_B if with_attachment else None)
    assert action.fence == FENCE_1


@pytest.mark.parametrize("text", ["", "null"])
def test_vector_27_empty_and_null_strings_are_ordinary(text: str) -> None:
    action = parse_action(enc(with_(b(), "binding.input", text)))
    assert isinstance(action, SetBinding)
    assert action.input == text
    assert action.attachment == ATTACHMENT_B


@pytest.mark.parametrize("text", ["not-json", "yaml:\n- a"])
def test_vector_28_policy_text_is_opaque_here(text: str) -> None:
    action = parse_action(enc(with_(b(), "binding.input", text)))
    assert isinstance(action, SetBinding)
    assert action.input == text


def test_vector_29_unknown_keys_ignored() -> None:
    assert parse_action(enc(with_(b(), "foo", 1))) == parse_action(enc(b()))


def test_vector_30_remove_binding() -> None:
    assert parse_action(enc(r())) == RemoveBinding(uid="u-1", fence=FENCE_1)


def test_vector_31_runtime_ready_hook() -> None:
    action = parse_action(enc(h("sandbox.runtime-ready")))
    assert action == LifecycleHook(uid="u-1", fence=FENCE_1, hook=HookName.RUNTIME_READY)


def test_data_plane_ready_hook_ignores_unused_blocks() -> None:
    doc = h("sandbox.data-plane-ready")
    doc["attachment"] = "garbage"
    doc["binding"] = 42
    action = parse_action(enc(doc))
    assert action == LifecycleHook(uid="u-1", fence=FENCE_1, hook=HookName.DATA_PLANE_READY)


def test_remove_binding_ignores_unused_blocks() -> None:
    doc = with_(r(), "attachment", {"network": {"ip": "not-an-ip"}})
    doc["hook"] = {"name": "bogus"}
    assert parse_action(enc(doc)) == RemoveBinding(uid="u-1", fence=FENCE_1)


# --------------------------------------------------------------------------- check order


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (without(with_(b(), "apiVersion", "x"), "sandbox"), "apiVersion"),
        (with_(without(b(), "sandbox.uid"), "operation", "EXPLODE"), "uid"),
        (without(with_(b(), "binding", None), "revision"), "binding"),
        (without(without(b(), "attachment"), "revision"), "attachment"),
        (without(h("nope"), "revision"), "hook"),
        (without(with_(b(), "revision.specGeneration", -1), "revision.attachmentId"), "specGeneration"),
        (with_(without(b(), "operation"), "binding", 7), "operation"),
    ],
)
def test_check_order(doc: Doc, field: str) -> None:
    assert field in reason(enc(doc))


# --------------------------------------------------------------------------- JSON layer


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"[]",
        b'"x"',
        b"null",
        b"42",
        b"\xff\xfe{}",
        b"\xef\xbb\xbf" + enc(b()),
        enc(b()) + b" trailing",
        b'{"apiVersion": NaN}',
        b"[" * 200_000 + b"]" * 200_000,
    ],
)
def test_non_object_or_bad_json(body: bytes) -> None:
    assert "JSON" in reason(body)


def test_invalid_utf8_inside_string() -> None:
    body = enc(b()).replace(b'"u-1"', b'"u-\xc3"')
    assert "JSON" in reason(body)


def test_max_body_is_accepted() -> None:
    raw = enc(b())
    body = raw[:-1] + b" " * (MAX_BODY_BYTES - len(raw)) + b"}"
    assert len(body) == MAX_BODY_BYTES
    assert isinstance(parse_action(body), SetBinding)


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (without(b(), "operation") | {"Operation": "SET_BINDING"}, "operation"),
        (without(b(), "apiVersion") | {"APIVersion": API_VERSION}, "apiVersion"),
        (without(b(), "sandbox") | {"Sandbox": {"uid": "u-1"}}, "uid"),
        (with_(b(), "sandbox", {"UID": "u-1"}), "uid"),
        (with_(b(), "binding", {"Input": "{}"}), "binding.input"),
        (with_(b(), "revision", {"runtimeinstanceid": "r1", "attachmentId": "a1"}), "runtimeInstanceId"),
        (with_(h("SANDBOX.RUNTIME-READY"), "operation", "LIFECYCLE_HOOK"), "hook"),
    ],
)
def test_keys_and_values_are_case_sensitive(doc: Doc, field: str) -> None:
    assert field in reason(enc(doc))


# --------------------------------------------------------------------------- field types


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (with_(b(), "sandbox", "u-1"), "sandbox"),
        (with_(b(), "sandbox", ["u-1"]), "sandbox"),
        (with_(b(), "sandbox.uid", 1), "sandbox.uid"),
        (with_(b(), "revision", "r1"), "revision"),
        (with_(r(), "revision", []), "revision"),
        (with_(b(), "revision.runtimeInstanceId", 1), "revision.runtimeInstanceId"),
        (with_(b(), "revision.attachmentId", None), "revision.attachmentId"),
        (with_(b(), "operation", 1), "operation"),
        (with_(b(), "operation", ""), "operation"),
        (with_(b(), "apiVersion", None), "apiVersion"),
        (with_(b(), "binding", "x"), "binding"),
        (with_(b(), "binding.input", True), "binding.input"),
        (with_(b(), "binding.input", 1.5), "binding.input"),
        (with_(b(), "binding.input", ["a"]), "binding.input"),
        (with_(b(), "attachment", "x"), "attachment"),
        (with_(b(), "attachment.network", 1), "attachment.network"),
        (with_(b(), "attachment.network.ip", 167772165), "attachment.network.ip"),
        (with_(b(), "attachment.network.ip", ""), "attachment.network.ip"),
        (with_(b(), "attachment.network.ip", " 10.0.0.5"), "attachment.network.ip"),
        (with_(b(), "attachment.network.ip", "010.0.0.5"), "attachment.network.ip"),
        (with_(b(), "attachment.network.ip", "fe80::1%eth0"), "attachment.network.ip"),
        (with_(b(), "attachment.network.hostVeth", 3), "attachment.network.hostVeth"),
        (without(b(), "attachment.network.hostVeth"), "attachment.network.hostVeth"),
        (with_(b(), "attachment.network.gateway", "garbage"), "attachment.network.gateway"),
        (with_(b(), "attachment.network.gateway", 1), "attachment.network.gateway"),
        (with_(b(), "attachment.network.privateCidr", "10.0.0.0/33"), "attachment.network.privateCidr"),
        (with_(b(), "attachment.network.privateCidr", "10.0.0.0"), "attachment.network.privateCidr"),
        (with_(b(), "attachment.network.privateCidr", "nope"), "attachment.network.privateCidr"),
        (with_(h("x"), "hook", "sandbox.runtime-ready"), "hook"),
        (with_(h("x"), "hook", {}), "hook.name"),
        (h(1), "hook.name"),
    ],
)
def test_wrong_types_and_unparseable_values(doc: Doc, field: str) -> None:
    assert field in reason(enc(doc))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("attachment.network.ip", "not-an-ip"),
        ("attachment.network.gateway", "garbage"),
        ("attachment.network.privateCidr", "nope"),
        ("attachment.network.hostVeth", 7),
        ("attachment", 1),
    ],
)
def test_null_input_still_validates_present_fields(path: str, value: object) -> None:
    doc = with_(with_(b(), "binding.input", None), path, value)
    assert path.split(".")[-1] in reason(enc(doc))


def test_null_input_without_ip_has_no_attachment() -> None:
    doc = with_(b(), "binding.input", None)
    doc = with_(doc, "attachment.network", {"ip": "", "gateway": "10.0.0.1", "hostVeth": "v"})
    action = parse_action(enc(doc))
    assert isinstance(action, SetBinding)
    assert action.attachment is None


def test_null_input_without_host_veth_keeps_attachment() -> None:
    doc = without(with_(b(), "binding.input", None), "attachment.network.hostVeth")
    action = parse_action(enc(doc))
    assert isinstance(action, SetBinding)
    assert action.attachment is not None
    assert action.attachment.host_veth == ""
    assert action.attachment.ip == ipaddress.IPv4Address("10.0.0.5")


@pytest.mark.parametrize("gateway", ["", None])
def test_gateway_and_cidr_optional(gateway: str | None) -> None:
    doc = with_(b(), "attachment.network.gateway", gateway)
    doc = without(doc, "attachment.network.privateCidr")
    action = parse_action(enc(doc))
    assert isinstance(action, SetBinding)
    assert action.attachment is not None
    assert action.attachment.gateway is None
    assert action.attachment.private_cidr is None


def test_private_cidr_host_bits_allowed() -> None:
    action = parse_action(enc(with_(b(), "attachment.network.privateCidr", "10.0.0.7/24")))
    assert isinstance(action, SetBinding)
    assert action.attachment is not None
    assert action.attachment.private_cidr == ipaddress.IPv4Network("10.0.0.0/24")


# --------------------------------------------------------------------------- addresses


def test_ipv4_mapped_addresses_are_unmapped() -> None:
    doc = with_(b(), "attachment.network.ip", "::ffff:10.0.0.5")
    doc = with_(doc, "attachment.network.gateway", "::ffff:10.0.0.1")
    action = parse_action(enc(doc))
    assert isinstance(action, SetBinding)
    assert action.attachment == ATTACHMENT_B


def test_ipv6_attachment() -> None:
    doc = with_(b(), "attachment.network", {"ip": "fd00::5", "gateway": "fd00::1", "hostVeth": "veth0"})
    doc = with_(doc, "attachment.network.privateCidr", "fd00::/64")
    action = parse_action(enc(doc))
    assert isinstance(action, SetBinding)
    assert action.attachment == Attachment(
        ip=ipaddress.IPv6Address("fd00::5"),
        host_veth="veth0",
        gateway=ipaddress.IPv6Address("fd00::1"),
        private_cidr=ipaddress.IPv6Network("fd00::/64"),
    )


# --------------------------------------------------------------------------- specGeneration


@pytest.mark.parametrize("value", [True, False, 1.0, 1.5, -1, 2**64, "1", [1], {"v": 1}])
def test_spec_generation_rejected(value: object) -> None:
    assert "specGeneration" in reason(enc(with_(b(), "revision.specGeneration", value)))


def test_spec_generation_exponent_literal_rejected() -> None:
    body = enc(b()).replace(b'"specGeneration": 1', b'"specGeneration": 1e0')
    assert b"1e0" in body
    assert "specGeneration" in reason(body)


@pytest.mark.parametrize(("value", "expected"), [(0, 0), (2**64 - 1, 2**64 - 1), (None, 0)])
def test_spec_generation_accepted(value: int | None, expected: int) -> None:
    action = parse_action(enc(with_(b(), "revision.specGeneration", value)))
    assert isinstance(action, SetBinding)
    assert action.spec_generation == expected


def test_spec_generation_defaults_to_zero() -> None:
    action = parse_action(enc(without(b(), "revision.specGeneration")))
    assert isinstance(action, SetBinding)
    assert action.spec_generation == 0


# --------------------------------------------------------------------------- uid


@pytest.mark.parametrize("uid", ["x" * 129, "a/b", "a\\b", "a\x00b"])
def test_bad_uid_rejected(uid: str) -> None:
    assert "sandbox.uid" in reason(enc(with_(b(), "sandbox.uid", uid)))


def test_uid_of_128_chars_accepted() -> None:
    action = parse_action(enc(with_(b(), "sandbox.uid", "x" * 128)))
    assert action.uid == "x" * 128


def test_lone_surrogate_uid_rejected() -> None:
    body = enc(b()).replace(b'"u-1"', b'"u-\\ud800"')
    assert "sandbox.uid" in reason(body)


# --------------------------------------------------------------------------- secrecy / line safety

SECRET = "sk-very-secret-token-0123456789"


def test_repr_hides_binding_input() -> None:
    action = parse_action(enc(with_(b(), "binding.input", SECRET)))
    assert isinstance(action, SetBinding)
    assert action.input == SECRET
    assert SECRET not in repr(action)
    assert SECRET not in str(action)
    assert "u-1" in repr(action)


@pytest.mark.parametrize(
    "doc",
    [
        with_(b(), "binding.input", {"token": SECRET}),
        with_(b(), "binding", {"input": [SECRET]}),
        without(with_(b(), "binding.input", SECRET), "attachment"),
        without(with_(b(), "binding.input", SECRET), "revision"),
    ],
)
def test_reasons_never_echo_binding_input(doc: Doc) -> None:
    assert SECRET not in reason(enc(doc))


def test_echoed_values_are_escaped_and_truncated() -> None:
    text = reason(enc(with_(b(), "operation", "EVIL\nline\u2028" + "x" * 500)))
    assert "\n" not in text and "\u2028" not in text
    assert len(text) < 200
    assert "operation" in text
