"""``egressctl status``: daemon readiness, health, MITM workers and subject counts."""

from __future__ import annotations

import argparse
from typing import Any

from egressd.cli.client import EXIT_FAILURE, EXIT_OK, CliError, one_line
from egressd.cli.command import Command, Context, _expect_ok
from egressd.cli.commands.subjects import (
    _fetch_subjects_doc,
    _reports_drops,
    _state_counter,
    _state_counts,
    _total_dropped,
)
from egressd.cli.render import _cell, key_values

__all__ = ["HEALTH_PATH", "STATUS", "STATUS_PATH", "cmd_status"]

HEALTH_PATH = "/healthz"
STATUS_PATH = "/_fastlet/v1/actions/status"


def _subjects_summary(subjects: list[dict[str, Any]], extra: dict[str, Any], drops: bool) -> dict[str, Any]:
    """``egressctl status --json``'s subjects object; the refusal counts when the daemon has them."""
    out: dict[str, Any] = {"total": len(subjects), "byState": _state_counter(subjects)}
    if drops:
        out["droppedPackets"] = _total_dropped(subjects)
        out["unattributedDroppedPackets"] = extra.get("unattributedDroppedPackets")
    return out


def _dropped_line(subjects: list[dict[str, Any]], extra: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (
            "dropped",
            f"{_total_dropped(subjects)} packets by subjects, "
            f"{_cell(extra.get('unattributedDroppedPackets'))} unattributed",
        )
    ]


def _worker_lines(workers: object) -> list[tuple[str, str]]:
    """One line per MITM worker (EGRESSD_MITM_WORKERS): pid, port, readiness, starts."""
    if not isinstance(workers, list):
        return []
    return [
        (
            f"mitm-worker {_cell(w.get('worker'))}",
            f"pid {_cell(w.get('pid'))} port {_cell(w.get('port'))} "
            f"{'ready' if w.get('ready') is True else 'NOT READY'} starts {_cell(w.get('starts'))}",
        )
        for w in workers
        if isinstance(w, dict)
    ]


def _name_check(value: object) -> str:
    """SNI/Host checked on the wire (docs/reference/behaviour.md §18): ``on``, ``off``, or unknown
    (a daemon that does not say)."""
    if value is True:
        return "on (TLS SNI and HTTP Host admitted only for names that may reach the address)"
    if value is False:
        return "off (address-level admission)"
    return "unknown"


def cmd_status(ctx: Context, args: argparse.Namespace) -> int:
    resp = ctx.client.get(STATUS_PATH)
    _expect_ok(resp, "GET", STATUS_PATH)
    status = resp.json()
    if not isinstance(status, dict):
        raise CliError(f"GET {STATUS_PATH}: unexpected payload (not an object)", EXIT_FAILURE)
    ready = status.get("ready") is True

    health = ctx.client.get(HEALTH_PATH)
    healthy = health.status == 200
    health_text = one_line(health.text()) or health.reason

    # Subject counts are a convenience: a failure there does not fail the readiness check.
    subjects: list[dict[str, Any]] | None
    subjects_error: str | None = None
    extra: dict[str, Any] = {}
    try:
        subjects, extra = _fetch_subjects_doc(ctx)
    except CliError as exc:
        subjects, subjects_error = None, exc.reason
    drops = subjects is not None and _reports_drops(extra)

    if ctx.json_output:
        ctx.emit_json(
            {
                "status": status,
                "healthy": healthy,
                "health": health_text,
                "subjects": None if subjects is None else _subjects_summary(subjects, extra, drops),
            }
        )
    else:
        fp = status.get("mitmCaFingerprint")
        ctx.lines(
            key_values(
                [
                    ("instance", _cell(status.get("instanceId"))),
                    ("ready", "yes" if ready else "no"),
                    ("health", health_text if healthy else f"{health.status} {health_text}"),
                    ("mitm-ca", _cell(fp) if fp else "disabled"),
                    ("name-check", _name_check(status.get("nameCheck"))),
                    *_worker_lines(status.get("mitmWorkers")),
                    (
                        "subjects",
                        _state_counts(subjects)
                        if subjects is not None
                        else f"unavailable ({subjects_error})",
                    ),
                    *(_dropped_line(subjects or [], extra) if drops else []),
                ]
            )
        )
    if ready:
        return EXIT_OK
    return ctx.fail(f"daemon not ready: {health_text if not healthy else 'status says ready=false'}")


STATUS = Command(
    "status",
    "daemon readiness, health and subject counts",
    run=cmd_status,
    epilog="exit 0 when ready, 1 when the daemon answers but is not ready, 3 when it cannot be reached",
)
