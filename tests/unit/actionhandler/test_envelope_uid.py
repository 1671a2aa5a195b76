"""Host-uid attachments in the action envelope (docs/reference/behaviour.md §17): ``attachment.process.uid``."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from egressd.actionhandler.envelope import (
    API_VERSION,
    EnvelopeError,
    ProcessAttachment,
    SetBinding,
    parse_action,
)
from egressd.subject.hostuid import DEFAULT_UID_RANGE, UidRange, host_uid_problem

Doc = dict[str, Any]


def uid_binding(process: object, input_: object = '{"defaultAction":"deny"}') -> Doc:
    return {
        "apiVersion": API_VERSION,
        "operation": "SET_BINDING",
        "sandbox": {"uid": "u-1"},
        "revision": {"specGeneration": 1, "runtimeInstanceId": "r1", "attachmentId": "a1"},
        "attachment": {"process": process},
        "binding": {"input": input_},
    }


def enc(doc: Doc) -> bytes:
    return json.dumps(doc).encode()


def test_process_uid_keys_a_host_uid_subject() -> None:
    action = parse_action(enc(uid_binding({"uid": 100001})))
    assert isinstance(action, SetBinding)
    assert action.process == ProcessAttachment(uid=100001)
    assert action.attachment is None


def test_unknown_process_keys_are_ignored() -> None:
    action = parse_action(enc(uid_binding({"uid": 100001, "gid": 5, "pid": 9})))
    assert isinstance(action, SetBinding)
    assert action.process == ProcessAttachment(uid=100001)


@pytest.mark.parametrize("uid", [DEFAULT_UID_RANGE.first, DEFAULT_UID_RANGE.last])
def test_range_bounds_are_inclusive(uid: int) -> None:
    action = parse_action(enc(uid_binding({"uid": uid})))
    assert isinstance(action, SetBinding) and action.process == ProcessAttachment(uid)


@pytest.mark.parametrize(
    ("uid", "reason"),
    [
        (99999, "outside EGRESSD_UID_RANGE"),
        (165536, "outside EGRESSD_UID_RANGE"),
        (0, "must be in 1.."),
        (-1, "must be in 1.."),
        (2**32 - 1, "must be in 1.."),
        (2**64, "must be in 1.."),
        ("100001", "must be an integer"),
        (100001.0, "must be an integer"),
        (1e5, "must be an integer"),
        (True, "must be an integer"),
        ([100001], "must be an integer"),
        ({"n": 1}, "must be an integer"),
    ],
)
def test_invalid_uid_is_400(uid: object, reason: str) -> None:
    with pytest.raises(EnvelopeError, match=re.escape("attachment.process.uid")) as err:
        parse_action(enc(uid_binding({"uid": uid})))
    assert reason in str(err.value)


def test_missing_uid_with_a_policy_is_400() -> None:
    with pytest.raises(EnvelopeError, match=re.escape("attachment.process.uid is required")):
        parse_action(enc(uid_binding({})))


def test_missing_uid_with_null_input_is_no_attachment() -> None:
    action = parse_action(enc(uid_binding({}, input_=None)))
    assert isinstance(action, SetBinding)
    assert action.process is None and action.attachment is None


def test_null_input_keeps_a_present_uid_and_still_validates_it() -> None:
    action = parse_action(enc(uid_binding({"uid": 100002}, input_=None)))
    assert isinstance(action, SetBinding) and action.process == ProcessAttachment(100002)
    with pytest.raises(EnvelopeError, match="outside"):
        parse_action(enc(uid_binding({"uid": 5}, input_=None)))


def test_process_must_be_an_object() -> None:
    with pytest.raises(EnvelopeError, match=re.escape("attachment.process must be an object")):
        parse_action(enc(uid_binding(100001)))


def test_null_process_is_absent() -> None:
    # The network attachment is then required, as for any SET_BINDING with a policy.
    with pytest.raises(EnvelopeError, match=re.escape("attachment.network.ip is required")):
        parse_action(enc(uid_binding(None)))


@pytest.mark.parametrize("network", [{"ip": "10.0.0.5", "hostVeth": "v"}, {}])
def test_process_and_network_together_are_400(network: Doc) -> None:
    doc = uid_binding({"uid": 100001})
    doc["attachment"]["network"] = network
    with pytest.raises(EnvelopeError, match="mutually exclusive"):
        parse_action(enc(doc))


def test_null_network_beside_a_process_is_absent() -> None:
    doc = uid_binding({"uid": 100001})
    doc["attachment"]["network"] = None
    action = parse_action(enc(doc))
    assert isinstance(action, SetBinding) and action.process == ProcessAttachment(100001)


def test_configured_range_and_own_uid() -> None:
    narrow = UidRange(200, 299)
    assert isinstance(parse_action(enc(uid_binding({"uid": 250})), uid_range=narrow), SetBinding)
    with pytest.raises(EnvelopeError, match="outside EGRESSD_UID_RANGE 200-299"):
        parse_action(enc(uid_binding({"uid": 100001})), uid_range=narrow)
    with pytest.raises(EnvelopeError, match="egressd's own uid"):
        parse_action(enc(uid_binding({"uid": 250})), uid_range=narrow, own_uid=250)


def test_check_order_fence_after_process() -> None:
    doc = uid_binding({"uid": 1})
    del doc["revision"]
    with pytest.raises(EnvelopeError, match=re.escape("attachment.process.uid")):
        parse_action(enc(doc))


def test_repr_names_the_process_but_never_the_input() -> None:
    action = parse_action(enc(uid_binding({"uid": 100001}, input_='{"secret":"x"}')))
    text = repr(action)
    assert "ProcessAttachment(uid=100001)" in text
    assert "secret" not in text


def test_host_uid_problem() -> None:
    assert host_uid_problem(100001, DEFAULT_UID_RANGE, None) is None
    assert host_uid_problem(100001, DEFAULT_UID_RANGE, 0) is None
    assert host_uid_problem(100001, DEFAULT_UID_RANGE, 100001) is not None
    assert 100001 in DEFAULT_UID_RANGE and 1 not in DEFAULT_UID_RANGE
    assert "100001" not in DEFAULT_UID_RANGE
    assert str(DEFAULT_UID_RANGE) == "100000-165535"
