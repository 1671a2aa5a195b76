"""The kernel side's options: the nft table egressd owns, what it drops or
rejects, the DNS-learned sets' size (docs/reference/behaviour.md §14.4) and the connection refresh."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from egressd.options import ConfigError, IPAddress, IPNetwork, Option, Raw, parse_bool, parse_int

OPTIONS: tuple[Option, ...] = (
    Option("EGRESSD_NFT_TABLE", "--nft-table", "nft table name (unset: opensandbox-fleet, sidecar: opensandbox)"),
    Option(
        "OPENSANDBOX_EGRESS_BLOCK_DOH_443",
        "--block-doh-443",
        "drop TCP 443 to the DoH blocklist",
        boolean=True,
        example="1",
    ),
    Option(
        "OPENSANDBOX_EGRESS_DOH_BLOCKLIST",
        "--doh-blocklist",
        "comma-separated IPs/CIDRs",
        "",
        example="1.1.1.1,1.0.0.1,8.8.8.8,8.8.4.4",
    ),
    Option(
        "EGRESSD_MAX_LEASES_PER_SUBJECT",
        "--max-leases-per-subject",
        "live DNS-learned addresses per subject (the dyn sets' size)",
        "4096",
    ),
    # The fleet's connection refresh and bridge check (the sidecar has neither).
    Option(
        "EGRESSD_REFRESH_INTERVAL",
        "--refresh-interval",
        "fleet: connection refresh period in seconds",
        "30",
        profile="fleet",
    ),
    Option(
        "EGRESSD_ALLOW_BRIDGE_BYPASS",
        "--allow-bridge-bypass",
        "fleet: start even though bridged sandbox-to-sandbox traffic would bypass the forward hook",
        boolean=True,
        profile="fleet",
    ),
    Option(
        "EGRESSD_DENY_REJECT",
        "--deny-reject",
        "refuse denied TCP with a reset and other denied packets with ICMP admin-prohibited",
        boolean=True,
    ),
    # Reference sidecar parity (issue 15 item 3).
    Option(
        "OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT",
        "--nameserver-exempt",
        "comma-separated nameserver IPs sandboxes may query directly on port 53 (not proxied)",
        "",
    ),
)


@dataclass(frozen=True, slots=True)
class KernelConfig:
    nft_table: str = "opensandbox"
    block_doh_443: bool = False
    doh_blocklist: tuple[IPNetwork, ...] = ()
    max_leases: int = 4096  # EGRESSD_MAX_LEASES_PER_SUBJECT (docs/reference/behaviour.md §14.4)
    refresh_interval: float = 30.0
    allow_bridge_bypass: bool = False
    deny_reject: bool = False  # EGRESSD_DENY_REJECT
    nameserver_exempt: tuple[IPAddress, ...] = ()  # OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT


def load_table(raw: Raw, profile: str) -> str:
    table = (
        raw["EGRESSD_NFT_TABLE"] or ("opensandbox-fleet" if profile == "fleet" else "opensandbox")
    ).strip()
    if (
        not table
        or not all(c.isalnum() or c in "_-" for c in table)
        or not table[0].isalpha()
        or len(table) > 64
    ):
        raise ConfigError(f"EGRESSD_NFT_TABLE: {table!r} is not a valid nft table name")
    return table


def load(raw: Raw, profile: str) -> KernelConfig:
    return KernelConfig(
        nft_table=load_table(raw, profile),
        block_doh_443=parse_bool("OPENSANDBOX_EGRESS_BLOCK_DOH_443", raw["OPENSANDBOX_EGRESS_BLOCK_DOH_443"]),
        doh_blocklist=parse_doh_blocklist(raw["OPENSANDBOX_EGRESS_DOH_BLOCKLIST"] or ""),
        max_leases=parse_int(
            "EGRESSD_MAX_LEASES_PER_SUBJECT", raw["EGRESSD_MAX_LEASES_PER_SUBJECT"] or "4096", 1, 1_000_000
        ),
        refresh_interval=float(parse_int("EGRESSD_REFRESH_INTERVAL", raw["EGRESSD_REFRESH_INTERVAL"], 1, 3600)),
        allow_bridge_bypass=parse_bool("EGRESSD_ALLOW_BRIDGE_BYPASS", raw["EGRESSD_ALLOW_BRIDGE_BYPASS"]),
        deny_reject=parse_bool("EGRESSD_DENY_REJECT", raw["EGRESSD_DENY_REJECT"]),
        nameserver_exempt=parse_nameserver_exempt(raw["OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT"] or ""),
    )


def parse_doh_blocklist(value: str) -> tuple[IPNetwork, ...]:
    nets: list[IPNetwork] = []
    for raw in value.split(","):
        item = raw.strip()
        if not item:
            continue
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ConfigError(f"OPENSANDBOX_EGRESS_DOH_BLOCKLIST: invalid entry {item!r}") from None
    return tuple(nets)


def parse_nameserver_exempt(value: str) -> tuple[IPAddress, ...]:
    """Comma-separated nameserver IPs (the reference keeps single IPs only and skips anything
    else; here a CIDR or junk refuses start-up instead of exempting less than was asked).
    Duplicates collapse; unspecified, loopback and multicast addresses are no nameservers."""
    name = "OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT"
    out: list[IPAddress] = []
    for raw_part in value.split(","):
        item = raw_part.strip()
        if not item:
            continue
        try:
            ip = ipaddress.ip_address(item)
        except ValueError:
            raise ConfigError(f"{name}: {item!r} is not an IP address") from None
        if ip.is_unspecified or ip.is_loopback or ip.is_multicast:
            raise ConfigError(f"{name}: {item} cannot be a nameserver")
        if ip not in out:
            out.append(ip)
    return tuple(out)
