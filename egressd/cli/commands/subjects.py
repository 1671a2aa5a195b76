"""``egressctl subjects``: the registered subjects as a table; and the ``GET /v1/subjects`` read
that ``status`` and ``watch`` share.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from typing import Any

from egressd.cli.client import EXIT_FAILURE, EXIT_OK, CliError
from egressd.cli.command import Command, Context, _expect_ok
from egressd.cli.render import _cell, table
from egressd.cli.watch import denials_cell

__all__ = ["SUBJECTS", "SUBJECTS_PATH", "cmd_subjects"]

SUBJECTS_PATH = "/v1/subjects"


_STATE_ORDER = ("active", "denying")


def _fetch_subjects_doc(ctx: Context) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The subjects and the document's other top-level fields (e.g. the unattributed drops)."""
    resp = ctx.client.get(SUBJECTS_PATH)
    _expect_ok(resp, "GET", SUBJECTS_PATH)
    payload = resp.json()
    subjects = payload.get("subjects") if isinstance(payload, dict) else None
    if not isinstance(subjects, list) or not all(isinstance(s, dict) for s in subjects):
        raise CliError(f"GET {SUBJECTS_PATH}: unexpected payload (no subjects list)", EXIT_FAILURE)
    assert isinstance(payload, dict)
    return subjects, {k: v for k, v in payload.items() if k != "subjects"}


def _fetch_subjects(ctx: Context) -> list[dict[str, Any]]:
    return _fetch_subjects_doc(ctx)[0]


def _reports_drops(extra: dict[str, Any]) -> bool:
    """A daemon that counts refusals (docs/reference/behaviour.md §15) says so with this key, even with no subject."""
    return "unattributedDroppedPackets" in extra


def _total_dropped(subjects: Sequence[dict[str, Any]]) -> int:
    return sum(
        s["droppedPackets"]
        for s in subjects
        if isinstance(s.get("droppedPackets"), int) and not isinstance(s.get("droppedPackets"), bool)
    )


def _policy_cell(policy: Any) -> str:
    if not isinstance(policy, dict):
        return "-"
    # No blanks inside a cell: each row stays one whitespace-separated field per column (awk, cut).
    rules = policy.get("rules")
    count = str(rules) if isinstance(rules, int) else "?"
    return f"default={_cell(policy.get('defaultAction'))},rules={count}"


def _state_counter(subjects: Sequence[dict[str, Any]]) -> dict[str, int]:
    counts = Counter(str(s.get("state", "?")) for s in subjects)
    order = [s for s in _STATE_ORDER if s in counts] + sorted(s for s in counts if s not in _STATE_ORDER)
    return {state: counts[state] for state in order}


def _state_counts(subjects: Sequence[dict[str, Any]]) -> str:
    counts = _state_counter(subjects)
    detail = ", ".join(f"{state} {n}" for state, n in counts.items())
    return f"{len(subjects)} ({detail})" if detail else "0"


def cmd_subjects(ctx: Context, args: argparse.Namespace) -> int:
    subjects, extra = _fetch_subjects_doc(ctx)
    if ctx.json_output:
        ctx.emit_json(subjects)
        return EXIT_OK
    headers: tuple[str, ...] = (
        "SUBJECT",
        "STATE",
        "SOURCE-IP",
        "GATEWAY",
        "POLICY",
        "PENDING",
        "VAULT-REV",
        "LEASES",
    )
    drops = _reports_drops(extra)
    if drops:
        headers += ("DROPPED", "RECENT-DENIALS")
    rows = [
        (
            _cell(s.get("subject")),
            _cell("revoking" if s.get("revoking") else s.get("state")),
            _cell(s.get("sourceIp") if s.get("hostUid") is None else f"uid:{s.get('hostUid')}"),
            _cell(s.get("gateway")),
            _policy_cell(s.get("policy")) + (",audit" if s.get("auditMode") else ""),
            "yes" if s.get("pending") else "no",
            _cell(s.get("vaultRevision")),
            _cell(s.get("leases")),
            *((_cell(s.get("droppedPackets")), denials_cell(s.get("recentDenials"))) if drops else ()),
        )
        for s in subjects
    ]
    ctx.lines(table(headers, rows))
    return EXIT_OK


SUBJECTS = Command("subjects", "list registered subjects", run=cmd_subjects)
