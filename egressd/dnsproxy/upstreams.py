"""Upstream resolver configuration (docs/reference/behaviour.md §7): parsing is pure, /etc/resolv.conf is read by the shell."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PORT = 53
MAX_RESOLV_CONF = 10
FALLBACK = "8.8.8.8"


class UpstreamError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Upstream:
    host: str  # an IP literal
    port: int = DEFAULT_PORT

    @property
    def family(self) -> int:
        return ipaddress.ip_address(self.host).version

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _port(text: str, item: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
        raise UpstreamError(f"OPENSANDBOX_EGRESS_DNS_UPSTREAM: invalid port in {item!r}")
    return int(text)


def parse_upstreams(value: str) -> tuple[Upstream, ...]:
    """``ip``, ``ip:port``, ``[v6]`` or ``[v6]:port``, comma-separated, deduplicated in order."""
    out: list[Upstream] = []
    for raw in value.split(","):
        item = raw.strip()
        if not item:
            continue
        if item.startswith("["):
            host, sep, rest = item[1:].partition("]")
            if not sep:
                raise UpstreamError(f"OPENSANDBOX_EGRESS_DNS_UPSTREAM: unclosed '[' in {item!r}")
            if rest and not rest.startswith(":"):
                raise UpstreamError(f"OPENSANDBOX_EGRESS_DNS_UPSTREAM: invalid entry {item!r}")
            port = _port(rest[1:], item) if rest else DEFAULT_PORT
        elif item.count(":") == 1:
            host, _, port_text = item.partition(":")
            port = _port(port_text, item)
        else:
            host, port = item, DEFAULT_PORT
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            raise UpstreamError(
                f"OPENSANDBOX_EGRESS_DNS_UPSTREAM: {host!r} is not an IP address (hostnames are not allowed)"
            ) from None
        if isinstance(addr, ipaddress.IPv6Address) and addr.scope_id:
            raise UpstreamError(f"OPENSANDBOX_EGRESS_DNS_UPSTREAM: zone ids are not supported ({item!r})")
        up = Upstream(str(addr), port)
        if up not in out:
            out.append(up)
    if not out:
        raise UpstreamError("OPENSANDBOX_EGRESS_DNS_UPSTREAM: no upstream given")
    return tuple(out)


RESOLV_CONF = Path("/etc/resolv.conf")


def from_resolv_conf(text: str) -> tuple[Upstream, ...]:
    """Nameservers of a resolv.conf: non-loopback first, at most 10; none -> 8.8.8.8:53."""
    found: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            try:
                addr = ipaddress.ip_address(parts[1].split("%", 1)[0])
            except ValueError:
                continue
            if addr not in found:
                found.append(addr)
    ordered = [a for a in found if not a.is_loopback] + [a for a in found if a.is_loopback]
    ups = tuple(Upstream(str(a)) for a in ordered[:MAX_RESOLV_CONF])
    return ups or (Upstream(FALLBACK),)


def upstreams_or_system(
    configured: tuple[Upstream, ...] | None, resolv_conf: Path = RESOLV_CONF
) -> tuple[Upstream, ...]:
    """``OPENSANDBOX_EGRESS_DNS_UPSTREAM`` when given, else the nameservers of resolv.conf (§7;
    an unreadable file counts as empty, which falls back to 8.8.8.8)."""
    if configured is not None:
        return configured
    try:
        text = resolv_conf.read_text()
    except OSError:
        text = ""
    return from_resolv_conf(text)
