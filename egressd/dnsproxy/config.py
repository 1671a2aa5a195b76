"""The DNS proxy's options: its listener, its upstreams, the per-subject
query budget (docs/reference/behaviour.md §14.3) and the lease bounds."""

from __future__ import annotations

from dataclasses import dataclass

from egressd.dnsproxy.upstreams import Upstream, UpstreamError, parse_upstreams
from egressd.options import ConfigError, Option, Raw, parse_hostport, parse_int

OPTIONS: tuple[Option, ...] = (
    Option(
        "OPENSANDBOX_EGRESS_DNS_UPSTREAM",
        "--dns-upstream",
        "comma-separated ip[:port] resolvers (unset: the nameservers of /etc/resolv.conf)",
        example="192.0.2.53,[2001:db8::53]:53",
    ),
    Option(
        "OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT",
        "--dns-upstream-timeout",
        "seconds per upstream attempt",
        "5",
    ),
    Option("EGRESSD_DNS_ADDR", "--dns-addr", "shared DNS proxy listener", "0.0.0.0:15353"),
    Option(
        "EGRESSD_DNS_QPS_PER_SUBJECT",
        "--dns-qps-per-subject",
        "DNS queries per second per subject (unknown sources: per address), burst twice that; "
        "over it REFUSED; 0 = unlimited",
        "200",
    ),
    # Test-only: the kernel tests shorten the leases to see them expire.
    Option("EGRESSD_DNS_LEASE_MIN", "--dns-lease-min", "shortest DNS lease in seconds (tests)", "60", public=False),
    Option("EGRESSD_DNS_LEASE_MAX", "--dns-lease-max", "longest DNS lease in seconds (tests)", "360", public=False),
)


@dataclass(frozen=True, slots=True)
class DnsConfig:
    host: str = "0.0.0.0"
    port: int = 15353
    upstreams: tuple[Upstream, ...] | None = None  # None: from /etc/resolv.conf at start-up
    upstream_timeout: float = 5.0
    qps_per_subject: int = 200  # docs/reference/behaviour.md §14.3; 0 = no budget
    lease_min: int = 60
    lease_max: int = 360


def load_listener(raw: Raw) -> tuple[str, int]:
    """EGRESSD_DNS_ADDR (read before the others: the MITM's ports must miss it)."""
    return parse_hostport("EGRESSD_DNS_ADDR", raw["EGRESSD_DNS_ADDR"] or "0.0.0.0:15353")


def load(raw: Raw) -> DnsConfig:
    host, port = load_listener(raw)
    lease_min, lease_max = _lease_bounds(raw)
    return DnsConfig(
        host=host,
        port=port,
        upstreams=_upstreams(raw),
        upstream_timeout=_upstream_timeout(raw),
        # 0 switches the budget off (like OPENSANDBOX_EGRESS_MAX_RULES=0); a negative or
        # non-integer value refuses to start rather than silently running unlimited.
        qps_per_subject=parse_int(
            "EGRESSD_DNS_QPS_PER_SUBJECT", raw["EGRESSD_DNS_QPS_PER_SUBJECT"], 0, 1_000_000
        ),
        lease_min=lease_min,
        lease_max=lease_max,
    )


def _upstream_timeout(raw: Raw) -> float:
    try:
        timeout = float((raw["OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT"] or "5").strip())
    except ValueError:
        timeout = 5.0
    if not timeout > 0:
        timeout = 5.0
    return min(timeout, 120.0)


def _upstreams(raw: Raw) -> tuple[Upstream, ...] | None:
    """None: not configured, the resolvers of /etc/resolv.conf are read at start-up."""
    if raw["OPENSANDBOX_EGRESS_DNS_UPSTREAM"] is None:
        return None
    try:
        return parse_upstreams(raw["OPENSANDBOX_EGRESS_DNS_UPSTREAM"])
    except UpstreamError as exc:
        raise ConfigError(str(exc)) from None


def _lease_bounds(raw: Raw) -> tuple[int, int]:
    lease_min = parse_int("EGRESSD_DNS_LEASE_MIN", raw["EGRESSD_DNS_LEASE_MIN"], 1, 86400)
    lease_max = parse_int("EGRESSD_DNS_LEASE_MAX", raw["EGRESSD_DNS_LEASE_MAX"], 1, 86400)
    if lease_min > lease_max:
        raise ConfigError("EGRESSD_DNS_LEASE_MIN is larger than EGRESSD_DNS_LEASE_MAX")
    return lease_min, lease_max
