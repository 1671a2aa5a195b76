"""``egressctl explain``: would this sandbox reach this destination, and why (``GET /v1/explain``)."""

from __future__ import annotations

import argparse
import urllib.parse
from typing import Any

from egressd.cli.client import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, CliError
from egressd.cli.command import Command, Context, _expect_ok
from egressd.cli.render import _cell, key_values

__all__ = ["EXPLAIN", "cmd_explain"]


def _configure_explain(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "sandbox_ip",
        metavar="SANDBOX-IP",
        help="the sandbox's source IP address, or uid:N for a host-uid sandbox",
    )
    parser.add_argument(
        "target",
        metavar="NAME-OR-IP[:PORT]",
        help="a destination name (DNS layer) or address (IP layer), with a TCP port: name:443, "
        "10.0.0.1:80, [2001:db8::1]:443",
    )


def split_port(target: str) -> tuple[str, int | None]:
    """``name:443`` / ``1.2.3.4:80`` / ``[v6]:443`` -> (target, port); a bare IPv6 address or a
    name without a port -> (target, None). A port outside 1..65535 is a usage error."""
    text = target.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise CliError(f"explain: {target!r}: missing ']'", EXIT_USAGE)
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise CliError(f"explain: {target!r}: expected [address]:port", EXIT_USAGE)
        return host, _port(target, rest[1:])
    host, sep, tail = text.rpartition(":")
    if not sep or ":" in host:  # no port, or a bare IPv6 address
        return text, None
    return host, _port(target, tail)


def _port(target: str, text: str) -> int:
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 65535:
        raise CliError(f"explain: {target!r}: the port must be 1..65535", EXIT_USAGE)
    return int(text)


def cmd_explain(ctx: Context, args: argparse.Namespace) -> int:
    source: str = args.sandbox_ip
    key = "hostUid" if source.startswith("uid:") else "ip"
    target, port = split_port(args.target)
    params: dict[str, str] = {key: source.removeprefix("uid:"), "target": target}
    if port is not None:
        params["port"] = str(port)
    query = urllib.parse.urlencode(params)
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
                ("port", f"tcp {port}" if port is not None else "any"),
                ("layer", _cell(doc.get("layer"))),
                (
                    "rule",
                    f"{rule.get('action')} {rule.get('target')}" if isinstance(rule, dict) else "-",
                ),
                ("kernel", _kernel_cell(doc)),
                ("why", _cell(doc.get("reason"))),
                ("name-check", _name_check_cell(doc.get("nameCheck"))),
            ]
        )
    )
    return EXIT_OK


def _name_check_cell(check: object) -> str:
    """What the MITM's name check admits for the target (docs/reference/behaviour.md §18)."""
    if not isinstance(check, dict):
        return "-"
    text = str(check.get("outcome", "-"))
    names = check.get("names")
    if isinstance(names, list) and names:
        text += f" ({', '.join(str(n) for n in names)})"
    return text


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


EXPLAIN = Command(
    "explain",
    "would this sandbox reach this destination, and why",
    run=cmd_explain,
    configure=_configure_explain,
)
