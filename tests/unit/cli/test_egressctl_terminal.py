"""docs/reference/behaviour.md §20.3: nothing a tenant, a sandbox or an upstream names reaches the operator's
terminal raw. A stub daemon answers with names full of escape sequences (the vault item a
tenant pushed, a subject id, denied DNS names, an error text quoting them); every line egressctl
prints, on stdout and stderr, human and JSON, must be free of control characters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.cli.test_egressctl_vault import Stub, ctl, stub  # noqa: F401  (stub: a fixture)

EVIL = "tok\x1b]0;owned\x07\x1b[2J"  # sets the window title, then clears the screen
C1 = "csi\x9b31m"  # the 8-bit CSI
BIDI = "abc\u202edcba"  # right-to-left override: reorders what follows on screen
DEL = "del\x7f"


def raw_controls(text: str) -> list[str]:
    """Every character a terminal would act on, newlines between lines excepted."""
    return [ch for ch in text if ch != "\n" and (not ch.isprintable())]


STATE = {
    "revision": 3,
    "credentials": [{"name": EVIL, "sourceType": "inline", "revision": 3}],
    "bindings": [
        {
            "name": BIDI,
            "revision": 3,
            "match": {"hosts": ["api.x.io"], "paths": ["/v1/" + C1], "methods": ["GET"], "schemes": ["https"]},
            "auth": {"type": "bearer"},
        }
    ],
}

SUBJECTS = {
    "unattributedDroppedPackets": 0,
    "subjects": [
        {
            "uid": EVIL,
            "subject": "s-" + EVIL,
            "state": "active",
            "sourceIp": "10.0.0.5",
            "gateway": "10.0.0.1",
            "policy": {"defaultAction": "deny", "rules": 1},
            "droppedPackets": 3,
            "recentDenials": [{"name": "exfil\x1b[8m.evil.test"}, {"name": "sni" + C1}],
        }
    ],
}


@pytest.mark.parametrize("json_output", [False, True])
def test_vault_get_never_prints_a_tenant_name_raw(
    capsys: pytest.CaptureFixture[str], stub: Stub, json_output: bool  # noqa: F811
) -> None:
    stub.reply(200, STATE)
    code, out, err = ctl(capsys, stub, *(["--json"] if json_output else []), "vault", "get", "--uid", "u1")
    assert code == 0, err
    assert raw_controls(out + err) == []
    if json_output:
        assert json.loads(out)["body"]["credentials"][0]["name"] == EVIL
    else:
        assert "tok\\x1b]0;owned\\x07\\x1b[2J" in out


@pytest.mark.parametrize("command", [["subjects"], ["--json", "subjects"], ["watch", "--count", "1"]])
def test_subject_ids_and_denied_names_are_escaped(
    capsys: pytest.CaptureFixture[str], stub: Stub, command: list[str]  # noqa: F811
) -> None:
    stub.reply(200, SUBJECTS)
    code, out, err = ctl(capsys, stub, *command)
    assert code == 0, err
    assert raw_controls(out + err) == []
    assert EVIL not in out


def test_an_error_text_quoting_a_name_is_escaped(
    capsys: pytest.CaptureFixture[str], stub: Stub, tmp_path: Path  # noqa: F811
) -> None:
    body = tmp_path / "vault.json"
    body.write_text(json.dumps({"credentials": [], "bindings": []}))
    stub.reply(400, {"error": f"credentials[0].name: not printable (got {EVIL!s})"})
    code, out, err = ctl(capsys, stub, "vault", "put", "--uid", "u1", "--file", str(body))
    assert stub.seen, "the request was sent"
    assert code != 0
    assert raw_controls(out + err) == []
    stub.reply(500, "plain text \x1b[31mboom\x9b")
    code, out, err = ctl(capsys, stub, "vault", "get", "--uid", "u1")
    assert code != 0
    assert raw_controls(out + err) == []
