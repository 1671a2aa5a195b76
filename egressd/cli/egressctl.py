"""egressctl: operator / dispatcher CLI over the egressd HTTP surface (docs/reference/http-api.md).

Commands (global options ``--addr``, ``--json``, ``--timeout`` go before or after the command)::

    egressctl status
    egressctl subjects
    egressctl watch [--interval SECONDS] [--count N]
    egressctl send set-binding --uid U --ip IP [--gateway GW] [--host-veth V]
    egressctl send set-binding --uid U --host-uid N             (a host-uid sandbox)
                               [--runtime-instance-id R] [--attachment-id A] [--spec-generation N]
                               [--policy JSON | --policy-file PATH|- | --input-file PATH|- | --null]
    egressctl send hook {runtime-ready|data-plane-ready|sandbox.*} --uid U [--runtime-instance-id R]
                        [--attachment-id A]
    egressctl send remove --uid U [--runtime-instance-id R] [--attachment-id A]
    egressctl send raw --file PATH|-
    egressctl vault seal --uid U --policy-file P [--vault-file V --key-file K [--kid KID]] [--out FILE]
    egressctl vault put|post|patch --uid U [--path SUB] --file BODY.json|- [--generation N] [--suffix-only]
    egressctl vault get|delete --uid U [--path SUB] [--generation N] [--suffix-only]
    egressctl explain SANDBOX-IP|uid:N NAME-OR-IP
    egressctl ca

Output: human text by default (aligned tables, ``key  value`` blocks); with ``--json`` exactly one
JSON document on stdout. ``send`` and the vault requests always print the answer (status and
body); every other failure prints nothing on stdout.

Exit codes (:data:`EXIT_CODES`): 0 success; 1 the daemon answered but not with success (non-2xx,
not ready, MITM disabled, unexpected reply); 2 usage error or bad local input (nothing was sent);
3 the daemon could not be reached (refused, timeout, broken HTTP). Every non-zero exit writes
exactly one line ``egressctl: <reason>`` on stderr, never a traceback.

Extension point: the command tree is declarative. Each :class:`~egressd.cli.command.Command`
names its arguments (``configure``), its handler (``run``) and optional sub-commands
(``children``). Top-level commands live in :data:`COMMANDS`; a new one is a ``Command`` appended
there (or passed to :func:`register`) whose handler takes a :class:`~egressd.cli.command.Context`
(lazy :class:`~egressd.cli.client.DaemonClient`, ``--json`` flag, output helpers) and returns the
exit code. Handlers raise :class:`~egressd.cli.client.CliError` for one-line failures, or print an
answer and return ``ctx.fail(reason)``; with ``--json`` they print exactly one document.

Layout: this module is the tree (:data:`COMMANDS`) and the entry point (:func:`main`, the
``egressctl`` script); the framework is :mod:`egressd.cli.command`, the argument parser
:mod:`egressd.cli.parser`, and the commands :mod:`egressd.cli.commands` (one module per command
group: ``status``, ``subjects``, ``watch``, ``explain``, ``send``, ``vault``, ``ca``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

from egressd.cli.client import EXIT_FAILURE, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, CliError, one_line
from egressd.cli.command import PROG, Command, Context, Handler
from egressd.cli.commands.ca import CA
from egressd.cli.commands.explain import EXPLAIN
from egressd.cli.commands.send import SEND
from egressd.cli.commands.status import STATUS
from egressd.cli.commands.subjects import SUBJECTS
from egressd.cli.commands.suggest import SUGGEST
from egressd.cli.commands.vault import VAULT
from egressd.cli.commands.watch import WATCH
from egressd.cli.parser import _add_commands, _add_global_options, _Parser
from egressd.terminal import visible

__all__ = ["COMMANDS", "EXIT_CODES", "build_parser", "main", "register"]

#: The documented exit codes (README and ``egressctl --help``, which the reference page is generated from).
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_FAILURE: "the daemon answered but not with success (non-2xx, not ready, MITM disabled)",
    EXIT_USAGE: "usage error or bad local input (nothing was sent)",
    EXIT_UNREACHABLE: "the daemon could not be reached (refused, timeout, broken HTTP)",
}


def build_parser(commands: Sequence[Command] | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Operator and dispatcher CLI for the egressd HTTP API.",
        epilog="exit codes: " + "; ".join(f"{code} {text}" for code, text in EXIT_CODES.items()),
    )
    _add_global_options(parser, with_defaults=True)
    _add_commands(parser, COMMANDS if commands is None else commands, dest="command", title="commands")
    return parser


#: Top-level commands, in help order. Further commands are appended via :func:`register`.
COMMANDS: list[Command] = [STATUS, SUBJECTS, WATCH, EXPLAIN, SUGGEST, SEND, VAULT, CA]


def register(command: Command) -> None:
    """Add a top-level command (names must be unique)."""
    taken = {name for c in COMMANDS for name in (c.name, *c.aliases)}
    if command.name in taken or taken.intersection(command.aliases):
        raise ValueError(f"command {command.name!r} is already registered")
    COMMANDS.append(command)


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help
            if exc.code is None:
                return EXIT_OK
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        handler: Handler | None = getattr(args, "_handler", None)
        if handler is None:  # a group without a runnable leaf; argparse normally refuses first
            raise CliError("no command given (see egressctl --help)")
        ctx = Context(addr=args.addr, timeout=args.timeout, json_output=args.json)
        return handler(ctx, args)
    except CliError as exc:
        print(visible(f"{PROG}: {exc.reason}"), file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. `| head`): silence the interpreter's final flush.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except Exception as exc:  # never a traceback
        print(f"{PROG}: internal error: {one_line(f'{type(exc).__name__}: {exc}')}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
