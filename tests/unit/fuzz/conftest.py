"""Reports how many cases each fuzz target ran (and writes them to
``$EGRESSD_FUZZ_COUNTS`` as JSON when set, for the campaign's bookkeeping)."""

from __future__ import annotations

import json
import os

import pytest

from tests.unit.fuzz.support import COUNTS, PROFILE


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not COUNTS:
        return
    terminalreporter.section(f"fuzz cases (profile {PROFILE})")
    for target, n in sorted(COUNTS.items()):
        terminalreporter.write_line(f"{target:<14} {n:>10}")
    terminalreporter.write_line(f"{'total':<14} {sum(COUNTS.values()):>10}")
    out = os.environ.get("EGRESSD_FUZZ_COUNTS")
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump({"profile": PROFILE, "counts": dict(COUNTS)}, fh, indent=1, sort_keys=True)
