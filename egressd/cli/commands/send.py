"""``egressctl send ...``: act as a Fastlet dispatcher, POST one action envelope (docs/reference/actions-protocol.md §1).

The envelopes are built by :mod:`egressd.cli.envelopes`; this module reads the arguments and
files, posts, and prints the answer.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from egressd.cli.client import CliError
from egressd.cli.command import Command, Context, _read_input, _read_utf8, _report
from egressd.cli.envelopes import binding_envelope, default_gateway, hook_envelope, parse_ip, remove_envelope
from egressd.cli.parser import _non_negative_int

__all__ = [
    "ACTIONS_PATH",
    "DEFAULT_ATTACHMENT_ID",
    "DEFAULT_RUNTIME_INSTANCE_ID",
    "DEFAULT_SPEC_GENERATION",
    "DENY_ALL_POLICY",
    "SEND",
    "cmd_send_hook",
    "cmd_send_raw",
    "cmd_send_remove",
    "cmd_send_set_binding",
]

ACTIONS_PATH = "/_fastlet/v1/actions"
DEFAULT_RUNTIME_INSTANCE_ID = "r1"
DEFAULT_ATTACHMENT_ID = "a1"
DEFAULT_SPEC_GENERATION = 1
DENY_ALL_POLICY = "{}"


def _encode(doc: dict[str, Any]) -> bytes:
    # ensure_ascii: anything odd in argv (lone surrogates) is escaped, and the daemon judges it.
    return json.dumps(doc, separators=(",", ":")).encode("ascii")


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
        help="attachment.process.uid: a host-uid sandbox (docs/reference/behaviour.md §17), instead of --ip",
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
