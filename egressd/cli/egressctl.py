"""egressctl: operator / dispatcher CLI over the egressd HTTP surface (docs/protocol.md).

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

Extension point: the command tree is declarative. Each :class:`Command` names its arguments
(``configure``), its handler (``run``) and optional sub-commands (``children``). Top-level
commands live in :data:`COMMANDS`; a new one is a ``Command`` appended there (or passed to
:func:`register`) whose handler takes a :class:`Context` (lazy
:class:`~egressd.cli.client.DaemonClient`, ``--json`` flag, output helpers) and returns the exit
code. Handlers raise :class:`~egressd.cli.client.CliError` for one-line failures, or print an
answer and return ``ctx.fail(reason)``; with ``--json`` they print exactly one document.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

from egressd.cli.ca import CA_PATH, FINGERPRINT_HEADER, certificate_der, fingerprint, normalise_fingerprint
from egressd.cli.client import (
    DEFAULT_ADDR,
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliError,
    DaemonClient,
    Response,
    one_line,
)
from egressd.cli.envelopes import (
    binding_envelope,
    default_gateway,
    hook_envelope,
    parse_ip,
    remove_envelope,
)
from egressd.cli.render import flatten, key_values, redact_secrets, table
from egressd.cli.vault import (
    PATH_CHOICES,
    VAULT_METHODS,
    kid_from_key_file,
    parse_json_file,
    parse_key_file,
    sealed_binding_input,
    vault_headers,
    vault_path,
)
from egressd.cli.watch import Snapshot, denials_cell, run_watch
from egressd.terminal import json_line, visible

__all__ = ["COMMANDS", "EXIT_CODES", "Command", "Context", "build_parser", "main", "register"]

PROG = "egressctl"
ADDR_ENV = "EGRESSCTL_ADDR"
DEFAULT_TIMEOUT = 10.0

HEALTH_PATH = "/healthz"
STATUS_PATH = "/_fastlet/v1/actions/status"
ACTIONS_PATH = "/_fastlet/v1/actions"
SUBJECTS_PATH = "/v1/subjects"

DEFAULT_RUNTIME_INSTANCE_ID = "r1"
DEFAULT_ATTACHMENT_ID = "a1"
DEFAULT_SPEC_GENERATION = 1
DENY_ALL_POLICY = "{}"

_STATE_ORDER = ("active", "denying")

#: The documented exit codes (README, docs/operations.md, ``egressctl --help``).
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_FAILURE: "the daemon answered but not with success (non-2xx, not ready, MITM disabled)",
    EXIT_USAGE: "usage error or bad local input (nothing was sent)",
    EXIT_UNREACHABLE: "the daemon could not be reached (refused, timeout, broken HTTP)",
}


# --------------------------------------------------------------------------- framework


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

    # Every line goes through egressd.terminal.visible (docs/behaviour.md §20.3): names a tenant,
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


def build_parser(commands: Sequence[Command] | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Operator and dispatcher CLI for the egressd HTTP API.",
        epilog="exit codes: " + "; ".join(f"{code} {text}" for code, text in EXIT_CODES.items()),
    )
    _add_global_options(parser, with_defaults=True)
    _add_commands(parser, COMMANDS if commands is None else commands, dest="command", title="commands")
    return parser


# --------------------------------------------------------------------------- helpers


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


def _encode(doc: dict[str, Any]) -> bytes:
    # ensure_ascii: anything odd in argv (lone surrogates) is escaped, and the daemon judges it.
    return json.dumps(doc, separators=(",", ":")).encode("ascii")


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
    """A daemon that counts refusals (docs/behaviour.md §15) says so with this key, even with no subject."""
    return "unattributedDroppedPackets" in extra


def _total_dropped(subjects: Sequence[dict[str, Any]]) -> int:
    return sum(
        s["droppedPackets"]
        for s in subjects
        if isinstance(s.get("droppedPackets"), int) and not isinstance(s.get("droppedPackets"), bool)
    )


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    return one_line(str(value), limit=80)


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


# --------------------------------------------------------------------------- status


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


# --------------------------------------------------------------------------- subjects


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


# --------------------------------------------------------------------------- watch


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


# --------------------------------------------------------------------------- send


def _post_action(ctx: Context, body: bytes) -> int:
    resp = ctx.client.post_json(ACTIONS_PATH, body)
    # Only 200 is success for an action (§1); the Fastlet treats anything else as a refusal.
    return _report(ctx, resp, "POST", ACTIONS_PATH, success=resp.ok)


def _add_identity(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--uid", required=True, help="sandbox UID (subject s-<uid>)")
    parser.add_argument(
        "--runtime-instance-id",
        default=DEFAULT_RUNTIME_INSTANCE_ID,
        metavar="R",
        help=f"fence: revision.runtimeInstanceId (default {DEFAULT_RUNTIME_INSTANCE_ID!r})",
    )
    parser.add_argument(
        "--attachment-id",
        default=DEFAULT_ATTACHMENT_ID,
        metavar="A",
        help=f"fence: revision.attachmentId (default {DEFAULT_ATTACHMENT_ID!r})",
    )


def _configure_set_binding(parser: argparse.ArgumentParser) -> None:
    _add_identity(parser)
    parser.add_argument(
        "--ip", help="attachment.network.ip, the sandbox source address (required unless --null)"
    )
    parser.add_argument(
        "--gateway",
        help="attachment.network.gateway (default for IPv4: the .1 address of the ip's /24; required for IPv6)",
    )
    parser.add_argument("--host-veth", metavar="V", help="attachment.network.hostVeth (default veth-<uid>)")
    parser.add_argument(
        "--host-uid",
        type=_non_negative_int,
        metavar="N",
        help="attachment.process.uid: a host-uid sandbox (docs/behaviour.md §17), instead of --ip",
    )
    parser.add_argument(
        "--spec-generation",
        type=_non_negative_int,
        default=DEFAULT_SPEC_GENERATION,
        metavar="N",
        help=f"revision.specGeneration (default {DEFAULT_SPEC_GENERATION})",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--policy", metavar="JSON", help="binding.input string, sent verbatim")
    source.add_argument("--policy-file", metavar="PATH", help="read binding.input from PATH ('-' = stdin)")
    source.add_argument(
        "--input-file",
        metavar="PATH",
        help="read binding.input from PATH ('-' = stdin), e.g. a wrapper written by 'vault seal --out'",
    )
    source.add_argument(
        "--null", action="store_true", help="send binding.input null (binding removed; --ip optional)"
    )


def cmd_send_set_binding(ctx: Context, args: argparse.Namespace) -> int:
    null: bool = args.null
    host_uid: int | None = args.host_uid
    if host_uid is not None and args.ip is not None:
        raise CliError("send set-binding: --ip and --host-uid are mutually exclusive")
    ip = parse_ip(args.ip) if args.ip is not None else None
    if ip is None and host_uid is None and not null:
        raise CliError("send set-binding: --ip is required (or --host-uid; unless --null)")
    gateway = parse_ip(args.gateway, what="--gateway") if args.gateway is not None else None
    if gateway is None and ip is not None:
        gateway = default_gateway(ip)
    if host_uid is not None and gateway is not None:
        raise CliError("send set-binding: --gateway belongs to --ip (a host-uid sandbox has none)")

    binding_input: str | None
    if null:
        binding_input = None
    elif args.policy is not None:
        binding_input = args.policy
    elif args.policy_file is not None:
        binding_input = _read_utf8(args.policy_file, what="--policy-file")
    elif args.input_file is not None:
        binding_input = _read_utf8(args.input_file, what="--input-file")
    else:
        ctx.note(
            "no --policy, --policy-file, --input-file or --null given; "
            f"sending the deny-all policy {DENY_ALL_POLICY}"
        )
        binding_input = DENY_ALL_POLICY

    doc = binding_envelope(
        uid=args.uid,
        runtime_instance_id=args.runtime_instance_id,
        attachment_id=args.attachment_id,
        spec_generation=args.spec_generation,
        binding_input=binding_input,
        ip=ip,
        gateway=gateway,
        host_veth=args.host_veth if args.host_veth is not None else f"veth-{args.uid}",
        host_uid=host_uid,
    )
    return _post_action(ctx, _encode(doc))


def _configure_hook(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name",
        metavar="NAME",
        help="runtime-ready, data-plane-ready, or the full sandbox.runtime-ready / sandbox.data-plane-ready",
    )
    _add_identity(parser)


def cmd_send_hook(ctx: Context, args: argparse.Namespace) -> int:
    doc = hook_envelope(
        uid=args.uid,
        hook=args.name,
        runtime_instance_id=args.runtime_instance_id,
        attachment_id=args.attachment_id,
    )
    return _post_action(ctx, _encode(doc))


def cmd_send_remove(ctx: Context, args: argparse.Namespace) -> int:
    doc = remove_envelope(
        uid=args.uid, runtime_instance_id=args.runtime_instance_id, attachment_id=args.attachment_id
    )
    return _post_action(ctx, _encode(doc))


def _configure_raw(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--file", required=True, metavar="PATH", help="envelope to POST as-is ('-' = stdin)")


def cmd_send_raw(ctx: Context, args: argparse.Namespace) -> int:
    return _post_action(ctx, _read_input(args.file, what="--file"))


# --------------------------------------------------------------------------- vault


def _configure_vault_seal(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--uid", required=True, help="sandbox UID the vault is sealed to (the AEAD's AAD)")
    parser.add_argument(
        "--policy-file", required=True, metavar="PATH", help="network policy JSON (§5) ('-' = stdin)"
    )
    parser.add_argument(
        "--vault-file",
        metavar="PATH",
        help="vault plaintext JSON, the create shape (§6) ('-' = stdin); without it no vault is sealed",
    )
    parser.add_argument(
        "--key-file",
        metavar="PATH",
        help="32 raw bytes or base64 of 32 bytes, as in EGRESSD_VAULT_KEYS_DIR (required with --vault-file)",
    )
    parser.add_argument(
        "--kid", help="key id written into the vault object (default: <kid> of a key file named <kid>.key)"
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="write the binding input to FILE (no trailing newline) instead of stdout",
    )


def cmd_vault_seal(ctx: Context, args: argparse.Namespace) -> int:
    files = {"--policy-file": args.policy_file, "--vault-file": args.vault_file, "--key-file": args.key_file}
    stdin_users = [flag for flag, path in files.items() if path == "-"]
    if len(stdin_users) > 1:
        raise CliError(f"vault seal: only one of {', '.join(stdin_users)} can read stdin")
    if args.vault_file is not None and args.key_file is None:
        raise CliError("vault seal: --key-file is required with --vault-file")

    policy = parse_json_file(_read_input(args.policy_file, what="--policy-file"), what="--policy-file")
    plaintext: bytes | None = None
    key: bytes | None = None
    kid: str | None = args.kid
    if args.vault_file is not None:
        value = parse_json_file(_read_input(args.vault_file, what="--vault-file"), what="--vault-file")
        # Sealed in a canonical compact form: the same content always gives the same plaintext.
        plaintext = json.dumps(value, separators=(",", ":")).encode("ascii")
        key = parse_key_file(_read_input(args.key_file, what="--key-file"))
        if kid is None:
            kid = kid_from_key_file(args.key_file)
        if kid is None:
            raise CliError("vault seal: --kid is required (the key file is not named <kid>.key)")

    text = sealed_binding_input(uid=args.uid, policy=policy, vault_plaintext=plaintext, kid=kid, key=key)
    if args.out is not None and args.out != "-":
        try:
            Path(args.out).write_text(text, encoding="ascii")
        except OSError as exc:
            raise CliError(f"--out: cannot write {args.out}: {exc.strerror or exc}") from None
        if ctx.json_output:
            ctx.emit_json({"out": args.out, "kid": kid if plaintext is not None else None})
        return EXIT_OK
    if ctx.json_output:
        ctx.emit_json({"input": text, "kid": kid if plaintext is not None else None})
    else:
        ctx.out(text)
    return EXIT_OK


def _configure_vault_request(parser: argparse.ArgumentParser, *, with_body: bool) -> None:
    parser.add_argument(
        "--uid", required=True, help="sandbox UID (path id, or X-Fast-Sandbox-Uid with --suffix-only)"
    )
    parser.add_argument(
        "--path",
        metavar="SUB",
        help=f"sub-resource under /credential-vault: {PATH_CHOICES} (default: the vault itself)",
    )
    if with_body:
        parser.add_argument(
            "--file", required=True, metavar="BODY", help="request body, sent verbatim ('-' = stdin)"
        )
    parser.add_argument(
        "--generation",
        type=_non_negative_int,
        metavar="N",
        help="send X-Fast-Sandbox-Generation: N (pending pushes older than the registering specGeneration are dropped)",
    )
    parser.add_argument(
        "--suffix-only",
        action="store_true",
        help="use the path suffix /credential-vault[...] and name the sandbox in X-Fast-Sandbox-Uid",
    )


def cmd_vault_request(ctx: Context, args: argparse.Namespace) -> int:
    method = VAULT_METHODS[args.vault_method]
    path = vault_path(args.uid, args.path, suffix_only=args.suffix_only)
    headers = vault_headers(args.uid, args.generation, suffix_only=args.suffix_only)
    file: str | None = getattr(args, "file", None)
    body = _read_input(file, what="--file") if file is not None else None
    resp = ctx.client.request(method, path, body, headers=headers)
    payload = resp.payload()
    if method == "GET" and resp.success and isinstance(payload, dict | list):
        # The daemon returns metadata only; secret-bearing keys are masked regardless.
        payload = redact_secrets(payload)
        if ctx.json_output:
            ctx.emit_json({"code": resp.status, "body": payload})
        else:
            ctx.lines(key_values(flatten(payload)))
        return EXIT_OK
    return _report(ctx, resp, method, path, success=resp.success)


def _vault_request_command(name: str, help_text: str, *, with_body: bool) -> Command:
    def configure(parser: argparse.ArgumentParser) -> None:
        _configure_vault_request(parser, with_body=with_body)
        parser.set_defaults(vault_method=name)

    return Command(
        name,
        help_text,
        run=cmd_vault_request,
        configure=configure,
        epilog=(
            f"{VAULT_METHODS[name]} /v1/sandboxfleets/<uid>/egress/credential-vault[/SUB] "
            "(or /credential-vault[/SUB] + X-Fast-Sandbox-Uid with --suffix-only).\n"
            "Prints '<code> <reason>' and the body (GET success: the metadata as 'key  value' lines); "
            '--json prints {"code": N, "body": ...}. Exit 0 on 2xx, 1 on any other status.'
        ),
    )


# --------------------------------------------------------------------------- explain


def _configure_explain(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "sandbox_ip",
        metavar="SANDBOX-IP",
        help="the sandbox's source IP address, or uid:N for a host-uid sandbox",
    )
    parser.add_argument(
        "target", metavar="NAME-OR-IP", help="a destination name (DNS layer) or address (IP layer)"
    )


def cmd_explain(ctx: Context, args: argparse.Namespace) -> int:
    source: str = args.sandbox_ip
    key = "hostUid" if source.startswith("uid:") else "ip"
    query = urllib.parse.urlencode({key: source.removeprefix("uid:"), "target": args.target})
    path = f"/v1/explain?{query}"
    resp = ctx.client.get(path)
    if resp.status == 400:
        raise CliError(f"explain: {resp.summary()}", EXIT_USAGE)
    _expect_ok(resp, "GET", "/v1/explain")
    doc = resp.json()
    if ctx.json_output:
        ctx.emit_json(doc)
        return EXIT_OK
    if not isinstance(doc, dict):
        raise CliError("GET /v1/explain: unexpected payload (not an object)", EXIT_FAILURE)
    rule = doc.get("rule")
    verdict = str(doc.get("decision", "?")).upper()
    if doc.get("wouldDeny"):
        verdict = "WOULD-DENY (audit mode: passes, logged and counted)"
    ctx.lines(
        key_values(
            [
                ("verdict", verdict),
                ("source", _cell(_explained_source(doc, args.sandbox_ip))),
                ("subject", f"{doc.get('subject', '-')} ({doc.get('state')})"),
                ("target", _cell(doc.get("target", args.target))),
                ("layer", _cell(doc.get("layer"))),
                (
                    "rule",
                    f"{rule.get('action')} {rule.get('target')}" if isinstance(rule, dict) else "-",
                ),
                ("kernel", _kernel_cell(doc)),
                ("why", _cell(doc.get("reason"))),
            ]
        )
    )
    return EXIT_OK


def _explained_source(doc: dict[str, Any], asked: str) -> object:
    if doc.get("hostUid") is not None:
        return f"uid:{doc['hostUid']}"
    return doc.get("sourceIp", asked)


def _kernel_cell(doc: dict[str, Any]) -> str:
    """What the kernel holds for the target: read from the kernel itself (``kernelView``) when
    the daemon could dump the sets, else derived from the decision."""
    view = doc.get("kernelView")
    if isinstance(view, dict) and view.get("available"):
        if not view.get("dispatched"):
            return "source not in the dispatch map: dropped"
        sets = [s for s in view.get("sets", []) if isinstance(s, dict)]
        if not sets:
            return "in none of the subject's sets: unmarked, dropped"
        parts = []
        for item in sets:
            text = f"{item.get('set')} has {item.get('element')}"
            if isinstance(item.get("expiresInS"), int):
                text += f" ({item['expiresInS']} s left)"
            parts.append(text)
        return "; ".join(parts)
    layer, where = doc.get("layer"), doc.get("set")
    if layer == "dispatch":
        return "source not in dispatch map (unknown or denying): dropped"
    if layer == "dns":
        return "answers are added to the dyn set as leases" if doc.get("decision") == "allow" else "-"
    if layer == "ip":
        return f"{where} set" if where else "in no set: unmarked, dropped"
    return "-"


# --------------------------------------------------------------------------- ca


def cmd_ca(ctx: Context, args: argparse.Namespace) -> int:
    resp = ctx.client.get(CA_PATH)
    if resp.status == 404:
        # 404 is the daemon's way of saying the MITM is off: a refusal, not a missing route.
        raise CliError(f"GET {CA_PATH}: {resp.summary()} (MITM CA not available)", EXIT_FAILURE)
    _expect_ok(resp, "GET", CA_PATH)
    pem = resp.text()
    fp = fingerprint(certificate_der(pem))
    announced = resp.header(FINGERPRINT_HEADER)
    if announced is not None and normalise_fingerprint(announced) != fp:
        # Someone bakes this into images: a certificate that does not match what the daemon
        # says it serves is not printed at all.
        raise CliError(
            f"GET {CA_PATH}: certificate SHA-256 {fp} does not match {FINGERPRINT_HEADER} {announced}",
            EXIT_FAILURE,
        )
    if ctx.json_output:
        ctx.emit_json({"fingerprint": fp, "pem": pem})
    else:
        # The PEM text as served (redirect to a file and it is the certificate file), only
        # ever with its control characters made visible (a certificate has none).
        sys.stdout.write("".join(visible(line) + "\n" for line in pem.splitlines()))
    return EXIT_OK


# --------------------------------------------------------------------------- registry

STATUS = Command(
    "status",
    "daemon readiness, health and subject counts",
    run=cmd_status,
    epilog="exit 0 when ready, 1 when the daemon answers but is not ready, 3 when it cannot be reached",
)

SUBJECTS = Command("subjects", "list registered subjects", run=cmd_subjects)

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

EXPLAIN = Command(
    "explain",
    "would this sandbox reach this destination, and why",
    run=cmd_explain,
    configure=_configure_explain,
)

SEND = Command(
    "send",
    "act as a Fastlet dispatcher: POST one action envelope",
    description=(
        "Build and POST one sandbox.fast.io/actions/v1 envelope to " + ACTIONS_PATH + ".\n"
        'Prints \'<code> <reason>\' and the body ({"code": N, "body": ...} with --json);\n'
        "exit 0 on 200, 1 on any other status (plus one 'egressctl: ...' line on stderr)."
    ),
    children=(
        Command(
            "set-binding",
            "SET_BINDING: register / update a subject and its policy",
            run=cmd_send_set_binding,
            configure=_configure_set_binding,
            epilog=(
                "Without --policy, --policy-file, --input-file or --null the deny-all policy {} is sent\n"
                "(a note goes to stderr). --input-file is --policy-file under another name, for wrappers.\n"
                "The default gateway is the .1 address of the ip's /24 (IPv4 only)."
            ),
        ),
        Command(
            "hook",
            "LIFECYCLE_HOOK: runtime-ready or data-plane-ready",
            run=cmd_send_hook,
            configure=_configure_hook,
        ),
        Command(
            "remove", "REMOVE_BINDING: unregister a subject", run=cmd_send_remove, configure=_add_identity
        ),
        Command("raw", "POST an envelope file as-is (debugging)", run=cmd_send_raw, configure=_configure_raw),
    ),
)

VAULT = Command(
    "vault",
    "act as the proxy route on the per-sandbox credential vault; seal a vault into a binding input",
    description=(
        "Credential vault of a fleet sandbox (docs/behaviour.md §4/§6) and the sealed vault of the binding input (§11).\n"
        "put/post/patch/get/delete send one request to /v1/sandboxfleets/<uid>/egress/credential-vault[...].\n"
        'seal prints the binding.input string {"osbEgressInput":1,"policy":...,"vault":...} for\n'
        "'send set-binding --input-file'."
    ),
    children=(
        Command(
            "seal",
            "build a binding input wrapper with an AES-256-GCM sealed vault",
            run=cmd_vault_seal,
            configure=_configure_vault_seal,
            epilog=(
                "The vault is sealed to --uid (AAD): it only opens in the SET_BINDING of that sandbox.\n"
                "Without --vault-file the wrapper has no vault key (vault removed, policy kept)."
            ),
        ),
        _vault_request_command("put", "PUT: create or replace the vault (complete revision)", with_body=True),
        _vault_request_command("post", "POST: create the vault (409 if it exists)", with_body=True),
        _vault_request_command("patch", "PATCH: apply a mutation to the vault", with_body=True),
        _vault_request_command("get", "GET: vault state or a sub-resource (metadata only)", with_body=False),
        _vault_request_command("delete", "DELETE: remove the vault", with_body=False),
    ),
)

CA = Command(
    "ca",
    "print the MITM CA certificate (PEM) to bake into sandbox images",
    run=cmd_ca,
    epilog=(
        f"GET {CA_PATH}. Prints the PEM as served; --json prints "
        '{"fingerprint": "<sha256 of the DER, lowercase hex>", "pem": "..."}.\n'
        "Exit 1 when the MITM is disabled (404) or the certificate does not match the daemon's "
        f"{FINGERPRINT_HEADER} header."
    ),
)

#: Top-level commands, in help order. Further commands are appended via :func:`register`.
COMMANDS: list[Command] = [STATUS, SUBJECTS, WATCH, EXPLAIN, SEND, VAULT, CA]


def register(command: Command) -> None:
    """Add a top-level command (names must be unique)."""
    taken = {name for c in COMMANDS for name in (c.name, *c.aliases)}
    if command.name in taken or taken.intersection(command.aliases):
        raise ValueError(f"command {command.name!r} is already registered")
    COMMANDS.append(command)


# --------------------------------------------------------------------------- entry point


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
