"""Sidecar initial policy (§13) and the atomic persisted copy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from egressd.policy import DENY_ALL, Verdict, parse_policy
from egressd.sidecar.persist import InitialPolicyError, choose_initial, read_text, serialise, write_atomic

ALLOW_A = '{"defaultAction":"deny","egress":[{"action":"allow","target":"a.test"}]}'
ALLOW_B = '{"defaultAction":"deny","egress":[{"action":"allow","target":"b.test"}]}'


def test_file_wins_when_valid() -> None:
    got = choose_initial(ALLOW_A, None, ALLOW_B)
    assert (got.source, got.warning) == ("file", None)
    assert got.policy.egress[0].target == "a.test"


@pytest.mark.parametrize("text", ["", "  \n", "{not json", '{"defaultAction":"maybe"}', "[1]"])
def test_empty_or_invalid_file_warns_and_falls_back_to_rules(text: str) -> None:
    got = choose_initial(text, None, ALLOW_B)
    assert got.source == "rules"
    assert got.warning is not None and "falling back" in got.warning
    assert got.policy.egress[0].target == "b.test"


def test_unreadable_file_warns_and_falls_back_to_deny_all() -> None:
    got = choose_initial(None, "Permission denied", None)
    assert (got.policy, got.source) == (DENY_ALL, "default")
    assert got.warning is not None and "Permission denied" in got.warning


def test_absent_file_and_no_rules_is_deny_all_without_warning() -> None:
    assert choose_initial(None, None, None).policy == DENY_ALL
    assert choose_initial(None, None, "  ").warning is None


def test_invalid_rules_is_a_startup_error() -> None:
    with pytest.raises(InitialPolicyError, match="OPENSANDBOX_EGRESS_RULES"):
        choose_initial(None, None, '{"egress":[{"action":"foo","target":"x"}]}')


def test_read_text(tmp_path: Path) -> None:
    assert read_text(None) == (None, None)
    assert read_text(tmp_path / "missing.json") == (None, None)
    (tmp_path / "bad").write_bytes(b"\xff\xfe{")
    assert read_text(tmp_path / "bad") == (None, "not valid UTF-8")
    (tmp_path / "ok").write_text(ALLOW_A)
    assert read_text(tmp_path / "ok") == (ALLOW_A, None)
    assert read_text(tmp_path)[1] is not None  # a directory: unreadable, not a crash


def test_write_atomic_round_trips_and_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "policy.json"
    policy = parse_policy('{"defaultAction":"allow","egress":[{"action":"deny","target":"1.2.3.4"}]}')
    write_atomic(target, serialise(policy))
    write_atomic(target, serialise(policy))
    assert parse_policy(target.read_text()) == policy
    assert parse_policy(target.read_text()).default_action is Verdict.ALLOW
    assert os.listdir(tmp_path) == ["policy.json"]


def test_write_atomic_failure_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "policy.json"
    target.write_text(ALLOW_A)

    def boom(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_atomic(target, serialise(DENY_ALL))
    assert target.read_text() == ALLOW_A
    assert os.listdir(tmp_path) == ["policy.json"]
