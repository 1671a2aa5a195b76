"""Console-format log lines (docs/reference/behaviour.md §20.3): what sandboxes, tenants and upstreams name
never reaches the operator's terminal with its control characters."""

from __future__ import annotations

import logging

import pytest
import structlog

from egressd.logsetup import configure

EVIL = "exfil\x1b]0;owned\x07\x1b[2J\x9b31m\u202e.test"


def raw_controls(text: str) -> list[str]:
    return [ch for ch in text if ch != "\n" and not ch.isprintable()]


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_log_fields_reach_the_terminal_escaped(capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    saved = structlog.get_config()
    try:
        configure(fmt, logging.INFO)
        log = structlog.get_logger("t")
        log.info(f"[dns] denied query (question={EVIL})", question=EVIL, sni=EVIL, path="/x\r\nforged: line")
        try:
            raise ValueError(EVIL)
        except ValueError:
            log.exception("mitm.error")
        err = capsys.readouterr().err
    finally:
        structlog.configure(**saved)
    assert raw_controls(err) == []
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "forged" in lines[0] and not any(ln.startswith("forged") for ln in lines), "no forged line"
    if fmt == "console":
        assert "\\x1b]0;owned" in err
        assert any(ln.startswith("Traceback") for ln in lines), "a traceback keeps its line breaks"
