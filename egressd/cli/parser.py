"""The argument parser of egressctl, built from the declarative command tree
(:class:`~egressd.cli.command.Command`).

Usage errors become one ``egressctl: <reason>`` line (exit 2); the global options ``--addr``,
``--json`` and ``--timeout`` are accepted before or after any command.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any, NoReturn

from egressd.cli.client import DEFAULT_ADDR, EXIT_USAGE, CliError
from egressd.cli.command import PROG, Command

__all__ = ["ADDR_ENV", "DEFAULT_TIMEOUT"]

ADDR_ENV = "EGRESSCTL_ADDR"
DEFAULT_TIMEOUT = 10.0


class _Parser(argparse.ArgumentParser):
    """Usage errors become one ``egressctl: <reason>`` line (exit 2) instead of usage + message."""

    def error(self, message: str) -> NoReturn:
        where = self.prog.removeprefix(PROG).strip()
        raise CliError(f"{where}: {message}" if where else message, EXIT_USAGE)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= 2**64 - 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in [0, 2^64-1]")
    return value


def _add_global_options(parser: argparse.ArgumentParser, *, with_defaults: bool) -> None:
    """Global options. Sub-commands repeat them with suppressed defaults so they may follow the command."""

    def default(value: Any) -> Any:
        return value if with_defaults else argparse.SUPPRESS

    env_addr = os.environ.get(ADDR_ENV, "").strip()
    parser.add_argument(
        "--addr",
        metavar="HOST:PORT",
        default=default(env_addr or DEFAULT_ADDR),
        help=f"daemon HTTP address (default ${ADDR_ENV} or {DEFAULT_ADDR})",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=default(False),
        help="machine-readable JSON output",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="SECONDS",
        default=default(DEFAULT_TIMEOUT),
        help=f"per-request timeout in seconds (default {DEFAULT_TIMEOUT:g})",
    )


def _add_commands(
    parser: argparse.ArgumentParser, commands: Sequence[Command], *, dest: str, title: str
) -> None:
    sub = parser.add_subparsers(dest=dest, title=title, metavar="COMMAND", required=True)
    for cmd in commands:
        child = sub.add_parser(
            cmd.name,
            aliases=list(cmd.aliases),
            help=cmd.help,
            description=cmd.description or cmd.help,
            epilog=cmd.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_global_options(child, with_defaults=False)
        if cmd.configure is not None:
            cmd.configure(child)
        if cmd.children:
            _add_commands(child, cmd.children, dest=f"{dest}_{cmd.name}", title="commands")
        elif cmd.run is not None:
            child.set_defaults(_handler=cmd.run)
