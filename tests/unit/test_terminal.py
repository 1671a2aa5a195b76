"""egressd.terminal (docs/reference/behaviour.md §20.3): control characters made visible, nothing else changed."""

from __future__ import annotations

import json

import pytest

from egressd.terminal import json_line, visible

EVIL = "tok\x1b]0;owned\x07\x1b[2J"
C1 = "csi\x9b31m"
BIDI = "abc\u202edcba"
DEL = "del\x7f"


def raw_controls(text: str) -> list[str]:
    return [ch for ch in text if not ch.isprintable()]


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        (EVIL, "tok\\x1b]0;owned\\x07\\x1b[2J"),
        (C1, "csi\\x9b31m"),
        (BIDI, "abc\\u202edcba"),
        (DEL, "del\\x7f"),
        ("a\nb\tc\rd\x00", "a\\nb\\tc\\rd\\x00"),
        ("zero\u200bwidth", "zero\\u200bwidth"),
        ("déjà vu ünï 名前", "déjà vu ünï 名前"),  # printable text is left alone
    ],
)
def test_visible_escapes_every_control_and_nothing_else(raw: str, shown: str) -> None:
    assert visible(raw) == shown
    assert visible(shown) == shown  # escaping twice changes nothing more
    assert raw_controls(visible(raw)) == []


def test_json_lines_escape_del_too() -> None:
    line = json_line({"name": EVIL + DEL + C1})
    assert raw_controls(line) == []
    assert json.loads(line) == {"name": EVIL + DEL + C1}  # still the same document


