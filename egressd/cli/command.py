"""The command framework of egressctl: the command tree's nodes, what a handler gets, and the
helpers every handler shares.

Each :class:`Command` names its arguments (``configure``), its handler (``run``) and optional
sub-commands (``children``); the handler takes a :class:`Context` (lazy
:class:`~egressd.cli.client.DaemonClient`, ``--json`` flag, output helpers) and returns the exit
code. The commands themselves live in :mod:`egressd.cli.commands`, the argument parser in
:mod:`egressd.cli.parser`, the tree and the entry point in :mod:`egressd.cli.egressctl`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from egressd.cli.client import EXIT_FAILURE, EXIT_OK, CliError, DaemonClient, Response, one_line
from egressd.terminal import json_line, visible

__all__ = ["PROG", "Command", "Context", "Handler"]

PROG = "egressctl"


@dataclass
class Context:
    """What a command handler gets besides its parsed arguments."""

    addr: str
    timeout: float
    json_output: bool

    @cached_property
    def client(self) -> DaemonClient:
        # Lazy: commands that never talk to the daemon are not failed by a bad --addr.
        return DaemonClient(self.addr, self.timeout)

    # Every line goes through egressd.terminal.visible (docs/reference/behaviour.md §20.3): names a tenant,
    # a sandbox or an upstream chose never reach the terminal with their control characters.
    def out(self, line: str = "") -> None:
        print(visible(line), file=sys.stdout)

    def note(self, message: str) -> None:
        print(visible(f"{PROG}: note: {message}"), file=sys.stderr)

    def emit_json(self, obj: Any) -> None:
        print(json_line(obj), file=sys.stdout)

    def lines(self, lines: Sequence[str]) -> None:
        for line in lines:
            self.out(line)

    def fail(self, reason: str, code: int = EXIT_FAILURE) -> int:
        """The one stderr line of a failure whose result was already printed; returns ``code``."""
        print(f"{PROG}: {one_line(reason)}", file=sys.stderr)  # one_line escapes
        return code


Handler = Callable[[Context, argparse.Namespace], int]


@dataclass(frozen=True)
class Command:
    """One node of the command tree: a runnable leaf (``run``) or a group (``children``)."""

    name: str
    help: str
    run: Handler | None = None
    configure: Callable[[argparse.ArgumentParser], None] | None = None
    children: tuple[Command, ...] = ()
    description: str | None = None
    epilog: str | None = None
    aliases: tuple[str, ...] = field(default=())


def _read_input(path: str, *, what: str) -> bytes:
    """Bytes of ``path``, or of stdin for ``-``; unreadable -> CliError (exit 2)."""
    try:
        if path == "-":
            buffer = getattr(sys.stdin, "buffer", None)
            if buffer is not None:
                data: bytes = buffer.read()
                return data
            return sys.stdin.read().encode("utf-8")
        return Path(path).read_bytes()
    except OSError as exc:
        name = "stdin" if path == "-" else path
        raise CliError(f"{what}: cannot read {name}: {exc.strerror or exc}") from None


def _read_utf8(path: str, *, what: str) -> str:
    raw = _read_input(path, what=what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        name = "stdin" if path == "-" else path
        raise CliError(f"{what}: {name} is not valid UTF-8") from None


def _expect_ok(resp: Response, method: str, path: str) -> None:
    if resp.status != 200:
        raise CliError(f"{method} {path}: {resp.summary()}", EXIT_FAILURE)


def _response_lines(resp: Response) -> list[str]:
    """Human form of an answer: ``<code> <reason phrase>``, then the body (compact JSON or text)."""
    lines = [f"{resp.status} {resp.reason or ('OK' if resp.success else 'error')}"]
    if resp.body.strip():
        payload = resp.payload()
        body = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
        lines.append(one_line(body, limit=4000))
    return lines


def _report(ctx: Context, resp: Response, method: str, path: str, *, success: bool) -> int:
    """Print an answer (``send``, vault requests) and turn a refusal into exit 1 + one stderr line."""
    if ctx.json_output:
        ctx.emit_json({"code": resp.status, "body": resp.payload()})
    else:
        ctx.lines(_response_lines(resp))
    if success:
        return EXIT_OK
    return ctx.fail(f"{method} {path}: {resp.summary()}")
