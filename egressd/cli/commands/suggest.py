"""``egressctl suggest UID``: a policy that would have admitted the subject's recent denials
(docs/reference/behaviour.md §19), printed as one JSON object usable as a SET_BINDING input.
Read-only: ``GET /v1/subjects/{uid}/suggestion``; nothing changes until the operator applies it."""

from __future__ import annotations

import argparse
from urllib.parse import quote

from egressd.cli.client import EXIT_OK
from egressd.cli.command import Command, Context, _expect_ok

__all__ = ["SUGGEST", "cmd_suggest", "suggestion_path"]


def suggestion_path(uid: str) -> str:
    return f"/v1/subjects/{quote(uid, safe='')}/suggestion"


def cmd_suggest(ctx: Context, args: argparse.Namespace) -> int:
    path = suggestion_path(args.uid)
    resp = ctx.client.get(path)
    _expect_ok(resp, "GET", path)
    ctx.emit_json(resp.json())
    return EXIT_OK


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("uid", metavar="UID", help="the subject's uid (as in egressctl subjects)")


SUGGEST = Command(
    "suggest",
    "a policy that would have admitted the subject's recent denials (JSON, a SET_BINDING input)",
    run=cmd_suggest,
    configure=_configure,
    description=(
        "Prints the subject's current policy with allow rules added in front that would have "
        "admitted its recent denials (DNS names, SNI/Host, ports, methods and paths), taken from "
        "a bounded per-subject ring. It changes nothing: apply it through SET_BINDING. Fleet "
        "profile (the sidecar has no per-subject API)."
    ),
    epilog="exit 0 with the policy on stdout, 1 when the daemon has no active subject with that uid",
)
