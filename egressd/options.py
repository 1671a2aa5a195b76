"""How a subsystem declares its options (issue 24 item 4): one :class:`Option` per variable,
next to the code that reads it, and the value parsers they share. Pure, and imports nothing
from egressd: every subsystem's ``config`` module builds on it, and the top-level loader
(:mod:`egressd.config`) composes their declarations.

A subsystem's ``config`` module holds ``OPTIONS`` (its declarations), a frozen config of its
own, and ``load(raw, ...)`` that checks the raw settings into it (as mitmproxy's addons declare
their options in ``load()``)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: The settings as read (flag, else environment, else default), before any check.
Raw = Mapping[str, str | None]

#: ``both``: read by either profile; ``fleet``/``sidecar``: set for the other one, it refuses
#: the start (:func:`egressd.config.other_profile_problem`).
Profile = Literal["both", "fleet", "sidecar"]


class ConfigError(ValueError):
    """One-line reason the daemon refuses to start."""


@dataclass(frozen=True, slots=True)
class Option:
    env: str
    flag: str
    help: str
    default: str | None = None
    boolean: bool = False
    profile: Profile = "both"
    #: False: a test or benchmark switch. Still read (the kernel tests and the benchmarks set
    #: it), but not a public option: left out of ``egressd --help`` and listed apart in
    #: docs/reference/configuration.md.
    public: bool = True
    #: A value to show in deploy/systemd/egressd.env.example when the default says little.
    example: str | None = None


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_bool(name: str, value: str | None) -> bool:
    v = (value or "").strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{name}: expected a boolean (1/0, true/false), got {value!r}")


def parse_int(name: str, value: str | None, lo: int, hi: int) -> int:
    try:
        n = int((value or "").strip())
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
    if not lo <= n <= hi:
        raise ConfigError(f"{name}: {n} is outside {lo}..{hi}")
    return n


def parse_choice(raw: Raw, name: str, default: str, allowed: tuple[str, ...], expected: str) -> str:
    value = (raw[name] or default).strip().lower()
    if value not in allowed:
        raise ConfigError(f"{name}: expected {expected}, got {value!r}")
    return value


def parse_hostport(name: str, value: str) -> tuple[str, int]:
    text = value.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ConfigError(f"{name}: expected [v6]:port, got {value!r}")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ConfigError(f"{name}: expected host:port, got {value!r}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise ConfigError(f"{name}: {host!r} is not an IP address") from None
    return host, parse_int(name, port_text, 1, 65535)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    return ipaddress.ip_address(host).is_loopback


def parse_networks(name: str, value: str) -> tuple[IPNetwork, ...]:
    """Comma-separated IPs or CIDRs; an invalid entry refuses start-up (the reference skips it)."""
    nets: list[IPNetwork] = []
    for raw_part in value.split(","):
        item = raw_part.strip()
        if not item:
            continue
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ConfigError(f"{name}: invalid entry {item!r}") from None
    return tuple(nets)


def check_printable(name: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise ConfigError(f"{name}: longer than {limit} characters")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ConfigError(f"{name}: contains a control character")
