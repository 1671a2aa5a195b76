"""Builders for the Fastlet action envelopes egressctl sends (docs/reference/actions-protocol.md §1).

Pure functions: no I/O. Local validation is limited to what egressctl itself has to
compute (addresses, to derive the default gateway); everything else is left to the
daemon so that its 400 answers can be exercised from the CLI.
"""

from __future__ import annotations

import ipaddress
import uuid
from typing import Any

from egressd.cli.client import CliError

__all__ = [
    "API_VERSION",
    "HOOK_NAMES",
    "binding_envelope",
    "default_gateway",
    "hook_envelope",
    "normalise_hook",
    "parse_ip",
    "remove_envelope",
]

# Kept literal (not imported from the daemon's parser) so the CLI states the wire contract itself.
API_VERSION = "sandbox.fast.io/actions/v1"

#: Full hook names accepted by the daemon; the short forms drop the ``sandbox.`` prefix.
HOOK_NAMES = ("sandbox.runtime-ready", "sandbox.data-plane-ready")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_ip(text: str, *, what: str = "--ip") -> IPAddress:
    try:
        ip = ipaddress.ip_address(text.strip())
    except ValueError:
        raise CliError(f"{what} {text!r} is not an IP address") from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
        raise CliError(f"{what} {text!r} must not carry a zone (%...)")
    return ip


def default_gateway(ip: IPAddress) -> IPAddress:
    """The ``.1`` address of the IPv4 ``/24`` holding ``ip`` (IPv4-mapped IPv6 counts as IPv4).

    There is no convention for IPv6 attachments, so ``--gateway`` is required there.
    """
    v4 = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else ip
    if v4 is None:
        raise CliError(f"--gateway is required for the IPv6 address {ip} (only IPv4 has a default)")
    gateway = ipaddress.IPv4Network(f"{v4}/24", strict=False).network_address + 1
    if gateway == v4:
        raise CliError(
            f"--ip {v4} is the .1 address of its /24, which would be the default gateway; pass --gateway"
        )
    return gateway


def normalise_hook(name: str) -> str:
    """``runtime-ready`` -> ``sandbox.runtime-ready``; full names pass unchanged."""
    text = name.strip()
    full = text if text.startswith("sandbox.") else f"sandbox.{text}"
    if full not in HOOK_NAMES:
        short = ", ".join(h.removeprefix("sandbox.") for h in HOOK_NAMES)
        raise CliError(
            f"unknown hook {name!r} (expected one of {short}, optionally prefixed with 'sandbox.')"
        )
    return full


def _base(operation: str, uid: str, revision: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "operation": operation,
        "invocationId": str(uuid.uuid4()),
        "sandbox": {"uid": uid},
        "revision": revision,
    }


def _fence(runtime_instance_id: str, attachment_id: str) -> dict[str, Any]:
    return {"runtimeInstanceId": runtime_instance_id, "attachmentId": attachment_id}


def binding_envelope(
    *,
    uid: str,
    runtime_instance_id: str,
    attachment_id: str,
    spec_generation: int,
    binding_input: str | None,
    ip: IPAddress | None,
    gateway: IPAddress | None,
    host_veth: str,
    host_uid: int | None = None,
) -> dict[str, Any]:
    """SET_BINDING. ``binding_input`` None is the literal JSON null (binding removed).

    ``host_uid`` makes it a host-uid sandbox (``attachment.process.uid``, docs/reference/behaviour.md §17). The
    attachment block is omitted when neither it nor ``ip`` is given (only meaningful with a
    null input).
    """
    revision = {"specGeneration": spec_generation, **_fence(runtime_instance_id, attachment_id)}
    doc = _base("SET_BINDING", uid, revision)
    if host_uid is not None:
        doc["attachment"] = {"process": {"uid": host_uid}}
    elif ip is not None:
        network: dict[str, Any] = {"ip": str(ip), "hostVeth": host_veth}
        if gateway is not None:
            network["gateway"] = str(gateway)
        doc["attachment"] = {"network": network}
    doc["binding"] = {"input": binding_input}
    return doc


def hook_envelope(*, uid: str, hook: str, runtime_instance_id: str, attachment_id: str) -> dict[str, Any]:
    doc = _base("LIFECYCLE_HOOK", uid, _fence(runtime_instance_id, attachment_id))
    doc["hook"] = {"name": normalise_hook(hook)}
    return doc


def remove_envelope(*, uid: str, runtime_instance_id: str, attachment_id: str) -> dict[str, Any]:
    return _base("REMOVE_BINDING", uid, _fence(runtime_instance_id, attachment_id))
