"""``egressctl vault ...``: requests on the per-sandbox credential vault, and ``vault seal``.

The requests and the sealed binding input are built by :mod:`egressd.cli.vault` (pure); this
module reads the files, talks to the daemon and prints the answer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from egressd.cli.client import EXIT_OK, CliError
from egressd.cli.command import Command, Context, _read_input, _report
from egressd.cli.parser import _non_negative_int
from egressd.cli.render import flatten, key_values, redact_secrets
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

__all__ = ["VAULT", "cmd_vault_request", "cmd_vault_seal"]


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


VAULT = Command(
    "vault",
    "act as the proxy route on the per-sandbox credential vault; seal a vault into a binding input",
    description=(
        "Credential vault of a fleet sandbox (docs/reference/behaviour.md §4/§6) and the sealed vault of the binding input (§11).\n"
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
