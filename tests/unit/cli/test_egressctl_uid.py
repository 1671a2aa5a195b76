"""egressctl and host-uid sandboxes (docs/reference/behaviour.md §17): send set-binding --host-uid, subjects,
explain uid:N, against the real fleet HTTP app served in-process."""

from __future__ import annotations

import json

import pytest

from tests.unit.cli.test_egressctl import POLICY, Daemon, ctl, daemon, quiet_logs, subjects_json

__all__ = ["daemon", "quiet_logs"]  # the fixtures, reused


def test_set_binding_with_host_uid_and_subjects(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, err = ctl(
        capsys, daemon, "send", "set-binding", "--uid", "u-1", "--host-uid", "100001", "--policy", POLICY
    )
    assert (code, out, err) == (0, "200 OK\n{}\n", "")
    code, out, _ = ctl(capsys, daemon, "subjects")
    assert code == 0
    [row] = [line.split() for line in out.splitlines()[1:]]
    assert row[:4] == ["s-u-1", "denying", "uid:100001", "-"]
    [doc] = subjects_json(capsys, daemon)
    assert doc["hostUid"] == 100001 and doc["dnsPort"] == 16000 and doc["sourceIp"] is None


def test_host_uid_refusals(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, _ = ctl(
        capsys, daemon, "send", "set-binding", "--uid", "u-1", "--host-uid", "1000", "--policy", POLICY
    )
    assert code == 1 and out.startswith("400") and "outside EGRESSD_UID_RANGE" in out
    code, _, err = ctl(
        capsys, daemon, "send", "set-binding", "--uid", "u-1", "--host-uid", "100001", "--ip", "10.0.0.5"
    )
    assert code == 2 and "mutually exclusive" in err
    code, _, err = ctl(
        capsys, daemon, "send", "set-binding", "--uid", "u-1", "--host-uid", "100001", "--gateway", "10.0.0.1"
    )
    assert code == 2 and "--gateway belongs to --ip" in err


def test_explain_by_host_uid(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    ctl(capsys, daemon, "send", "set-binding", "--uid", "u-1", "--host-uid", "100001", "--policy", POLICY)
    ctl(capsys, daemon, "send", "hook", "data-plane-ready", "--uid", "u-1")
    code, out, _ = ctl(capsys, daemon, "explain", "uid:100001", "10.1.2.3")
    assert code == 0
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert fields["verdict"] == "ALLOW" and fields["source"] == "uid:100001"
    assert fields["subject"].startswith("s-u-1 (active)") and fields["kernel"] == "allow set"
    code, out, _ = ctl(capsys, daemon, "--json", "explain", "uid:100002", "10.1.2.3")
    assert json.loads(out)["state"] == "absent" and json.loads(out)["hostUid"] == 100002
    code, _, err = ctl(capsys, daemon, "explain", "uid:x", "10.1.2.3")
    assert code == 2 and err.count("\n") == 1
