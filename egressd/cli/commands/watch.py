"""``egressctl watch``: the command; the frame and the loop are :mod:`egressd.cli.watch`."""

from __future__ import annotations

import argparse
import sys
import time

from egressd.cli.client import EXIT_OK, CliError
from egressd.cli.command import Command, Context
from egressd.cli.commands.subjects import SUBJECTS_PATH, _fetch_subjects_doc
from egressd.cli.parser import _non_negative_int, _positive_float
from egressd.cli.watch import Snapshot, run_watch

__all__ = ["WATCH", "cmd_watch"]


def _configure_watch(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--interval",
        type=_positive_float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between refreshes (default 2)",
    )
    parser.add_argument(
        "--count",
        type=_non_negative_int,
        metavar="N",
        help="stop after N refreshes (default: until Ctrl-C)",
    )


def cmd_watch(ctx: Context, args: argparse.Namespace) -> int:
    # The first read must work (exit 3 / 1 like any command); later failures are shown in
    # the frame and the watch goes on.
    first: list[Snapshot] = []
    subjects, extra = _fetch_subjects_doc(ctx)
    first.append(Snapshot(subjects, extra.get("unattributedDroppedPackets")))

    def fetch() -> Snapshot:
        if first:
            return first.pop()
        try:
            subjects, extra = _fetch_subjects_doc(ctx)
        except CliError as exc:
            return Snapshot(error=exc.reason)
        return Snapshot(subjects, extra.get("unattributedDroppedPackets"))

    def emit_json() -> Snapshot:
        snap = fetch()
        if snap.error is not None:
            ctx.emit_json({"error": snap.error})
        else:
            ctx.emit_json({"subjects": list(snap.subjects), "unattributedDroppedPackets": snap.unattributed})
        return snap

    count: int | None = args.count
    try:
        if ctx.json_output:
            # One document per refresh (JSON lines): the raw /v1/subjects answers.
            index = 0
            while count is None or index < count:
                index += 1
                emit_json()
                sys.stdout.flush()
                if count is None or index < count:
                    time.sleep(args.interval)
            return EXIT_OK

        def out(text: str) -> None:  # run_watch made every line visible (CLEAR is its own)
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

        run_watch(
            fetch,
            out,
            addr=ctx.addr,
            interval=args.interval,
            count=count,
            tty=sys.stdout.isatty(),
        )
    except KeyboardInterrupt:
        return EXIT_OK  # the normal way to end a watch
    return EXIT_OK


WATCH = Command(
    "watch",
    "live table of subjects, their refused packets and recent DNS denials",
    run=cmd_watch,
    configure=_configure_watch,
    epilog=(
        f"GET {SUBJECTS_PATH} every --interval seconds. On a terminal each refresh replaces the\n"
        "screen; into a pipe refreshes follow each other. NEW is the packets refused since the\n"
        "previous refresh. --json prints one /v1/subjects document per refresh (JSON lines).\n"
        "Exit 0 after --count refreshes or on Ctrl-C; 1/3 when the first read fails."
    ),
)
