"""Configuration from the environment and ``--flags`` (flags win). Pure: env and argv in, Config out."""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from egressd.dnsproxy.upstreams import Upstream, UpstreamError, parse_upstreams
from egressd.subject.hostuid import (
    DEFAULT_UID_PORTS,
    DEFAULT_UID_RANGE,
    HOST_UID_MAX,
    HOST_UID_MIN,
    UidPorts,
    UidRange,
)
from egressd.vault.model import VaultLimits

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class ConfigError(ValueError):
    """One-line reason the daemon refuses to start."""


@dataclass(frozen=True, slots=True)
class Option:
    env: str
    flag: str
    help: str
    default: str | None = None
    boolean: bool = False


OPTIONS: tuple[Option, ...] = (
    Option("OPENSANDBOX_EGRESS_PROFILE", "--profile", "sidecar or fleet", "sidecar"),
    Option("OPENSANDBOX_EGRESS_HTTP_ADDR", "--http-addr", "HTTP listener host:port (fleet 127.0.0.1:18080)"),
    Option(
        "EGRESSD_ALLOW_NON_LOOPBACK",
        "--allow-non-loopback",
        "fleet: allow a non-loopback HTTP address",
        boolean=True,
    ),
    Option(
        "OPENSANDBOX_EGRESS_PENDING_PUSH_TTL",
        "--pending-push-ttl",
        "seconds pushes for unknown UIDs are kept",
        "30",
    ),
    Option(
        "OPENSANDBOX_EGRESS_BLOCK_DOH_443",
        "--block-doh-443",
        "drop TCP 443 to the DoH blocklist",
        boolean=True,
    ),
    Option("OPENSANDBOX_EGRESS_DOH_BLOCKLIST", "--doh-blocklist", "comma-separated IPs/CIDRs", ""),
    Option(
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT",
        "--mitmproxy-transparent",
        "enable the shared MITM",
        boolean=True,
    ),
    Option("OPENSANDBOX_EGRESS_MITMPROXY_PORT", "--mitmproxy-port", "MITM listener port", "18081"),
    Option(
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR",
        "--mitmproxy-upstream-trust-dir",
        "CA directory the MITM trusts upstream",
        "/etc/ssl/certs",
    ),
    Option(
        "OPENSANDBOX_EGRESS_MITMPROXY_SSL_INSECURE",
        "--mitmproxy-ssl-insecure",
        "skip upstream TLS checks",
        boolean=True,
    ),
    Option("EGRESSD_MITM_CONFDIR", "--mitm-confdir", "the MITM's private directory", "/var/lib/egressd/mitm"),
    Option(
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET",
        "--credential-proxy-socket",
        "private unix socket the MITM reads vaults from",
        "/run/opensandbox/credential-proxy/active.sock",
    ),
    Option("OPENSANDBOX_EGRESS_DNS_UPSTREAM", "--dns-upstream", "comma-separated ip[:port] resolvers"),
    Option(
        "OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT",
        "--dns-upstream-timeout",
        "seconds per upstream attempt",
        "5",
    ),
    Option("OPENSANDBOX_EGRESS_TOKEN", "--token", "sidecar: API token"),
    Option("OPENSANDBOX_EGRESS_RULES", "--rules", "sidecar: initial policy JSON"),
    Option("OPENSANDBOX_EGRESS_POLICY_FILE", "--policy-file", "sidecar: initial policy file"),
    Option("OPENSANDBOX_EGRESS_MODE", "--mode", "sidecar: dns or dns+nft", "dns+nft"),
    Option("OPENSANDBOX_EGRESS_MAX_RULES", "--max-rules", "rule cap (0 = unlimited)", "4096"),
    Option(
        "EGRESSD_MAX_LEASES_PER_SUBJECT",
        "--max-leases-per-subject",
        "live DNS-learned addresses per subject (the dyn sets' size)",
        "4096",
    ),
    Option(
        "EGRESSD_VAULT_MAX_CREDENTIALS",
        "--vault-max-credentials",
        "credentials one vault may hold (BEHAVIOUR 14.7)",
        "256",
    ),
    Option(
        "EGRESSD_VAULT_MAX_BINDINGS",
        "--vault-max-bindings",
        "bindings one vault may hold (BEHAVIOUR 14.7)",
        "256",
    ),
    Option("EGRESSD_DNS_ADDR", "--dns-addr", "shared DNS proxy listener", "0.0.0.0:15353"),
    Option("EGRESSD_NFT_TABLE", "--nft-table", "nft table name"),
    Option(
        "EGRESSD_ALWAYS_RULES_DIR",
        "--always-rules-dir",
        "directory of deny.always/allow.always",
        "/var/egress/rules",
    ),
    Option("EGRESSD_VAULT_KEYS_DIR", "--vault-keys-dir", "fleet: sealed-vault key directory"),
    Option("EGRESSD_LOG_FORMAT", "--log-format", "json or console", "json"),
    Option(
        "EGRESSD_DNS_QPS_PER_SUBJECT",
        "--dns-qps-per-subject",
        "DNS queries per second per subject (unknown sources: per address), burst twice that; "
        "over it REFUSED; 0 = unlimited",
        "200",
    ),
    Option("EGRESSD_DNS_LEASE_MIN", "--dns-lease-min", "shortest DNS lease in seconds (tests)", "60"),
    Option("EGRESSD_DNS_LEASE_MAX", "--dns-lease-max", "longest DNS lease in seconds (tests)", "360"),
    Option("EGRESSD_REFRESH_INTERVAL", "--refresh-interval", "connection refresh period in seconds", "30"),
    Option(
        "EGRESSD_ALWAYS_RULES_RELOAD_INTERVAL",
        "--always-rules-reload-interval",
        "seconds between re-reads",
        "60",
    ),
    Option(
        "EGRESSD_SIDECAR_KEEP_TABLE",
        "--sidecar-keep-table",
        "sidecar: keep the nft table on SIGTERM (restart without an open window)",
        boolean=True,
    ),
    Option(
        "EGRESSD_ALLOW_BRIDGE_BYPASS",
        "--allow-bridge-bypass",
        "start even though bridged sandbox-to-sandbox traffic would bypass the forward hook",
        boolean=True,
    ),
    Option(
        "EGRESSD_UID_RANGE",
        "--uid-range",
        "fleet: host uids that belong to sandboxes, first-last (BEHAVIOUR 17)",
        str(DEFAULT_UID_RANGE),
    ),
    Option(
        "EGRESSD_UID_DNS_PORT_BASE",
        "--uid-dns-port-base",
        "fleet: first per-subject DNS port of host-uid subjects",
        "16000",
    ),
    Option(
        "EGRESSD_UID_MAX_SUBJECTS",
        "--uid-max-subjects",
        "fleet: most host-uid subjects at once (one DNS and one MITM port each)",
        "256",
    ),
)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True, slots=True)
class Config:
    profile: str
    http_host: str
    http_port: int
    allow_non_loopback: bool
    pending_push_ttl: int
    block_doh_443: bool
    doh_blocklist: tuple[IPNetwork, ...]
    mitm_transparent: bool
    mitm_port: int
    mitm_upstream_trust_dir: Path
    mitm_ssl_insecure: bool
    mitm_confdir: Path
    credential_proxy_socket: Path
    dns_upstream: str | None
    dns_upstream_timeout: float
    dns_host: str
    dns_port: int
    token: str | None = field(repr=False)
    rules: str | None
    policy_file: Path | None
    mode: str
    max_rules: int
    nft_table: str
    always_rules_dir: Path
    vault_keys_dir: Path | None
    log_format: str
    allow_bridge_bypass: bool
    dns_upstreams: tuple[Upstream, ...] | None = None  # None: from /etc/resolv.conf at start-up
    dns_qps_per_subject: int = 200  # BEHAVIOUR 14.3; 0 = no budget
    dns_lease_min: int = 60
    dns_lease_max: int = 360
    refresh_interval: float = 30.0
    always_reload_interval: float = 60.0
    sidecar_keep_table: bool = False
    max_leases: int = 4096  # EGRESSD_MAX_LEASES_PER_SUBJECT (BEHAVIOUR 14.4)
    vault_max_credentials: int = 256  # EGRESSD_VAULT_MAX_CREDENTIALS (BEHAVIOUR 14.7)
    vault_max_bindings: int = 256  # EGRESSD_VAULT_MAX_BINDINGS (BEHAVIOUR 14.7)
    uid_ports: UidPorts = DEFAULT_UID_PORTS  # EGRESSD_UID_* (BEHAVIOUR 17)

    @property
    def vault_limits(self) -> VaultLimits:
        return VaultLimits(credentials=self.vault_max_credentials, bindings=self.vault_max_bindings)


def parse_uid_range(name: str, value: str | None) -> UidRange:
    text = (value or "").strip()
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last)
    except ValueError:
        raise ConfigError(f"{name}: expected first-last, e.g. 100000-165535, got {value!r}") from None
    if not sep or not HOST_UID_MIN <= lo <= hi <= HOST_UID_MAX:
        raise ConfigError(
            f"{name}: expected first-last with {HOST_UID_MIN} <= first <= last <= {HOST_UID_MAX}"
        )
    return UidRange(lo, hi)


def _uid_ports(raw: Mapping[str, str | None], taken: Mapping[str, int]) -> UidPorts:
    """EGRESSD_UID_*; ``taken`` are the other listeners' ports, which the block must avoid
    (empty for the sidecar, which has no host-uid subjects)."""
    ports = UidPorts(
        parse_uid_range("EGRESSD_UID_RANGE", raw["EGRESSD_UID_RANGE"]),
        _int("EGRESSD_UID_DNS_PORT_BASE", raw["EGRESSD_UID_DNS_PORT_BASE"], 1, 65535),
        _int("EGRESSD_UID_MAX_SUBJECTS", raw["EGRESSD_UID_MAX_SUBJECTS"], 1, 16384),
    )
    if ports.last > 65535:
        raise ConfigError(
            f"EGRESSD_UID_DNS_PORT_BASE: {ports.base} + 2 x EGRESSD_UID_MAX_SUBJECTS + 1 passes port 65535"
        )
    for name, port in taken.items():
        if ports.base <= port <= ports.last:
            raise ConfigError(
                f"EGRESSD_UID_DNS_PORT_BASE: the host-uid ports {ports.base}-{ports.last} include {name} {port}"
            )
    return ports


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="egressd",
        description="Egress control plane for AI-agent sandboxes. Every flag also reads its environment variable.",
    )
    for opt in OPTIONS:
        default = f" (default {opt.default!r})" if opt.default not in (None, "") else ""
        parser.add_argument(
            opt.flag, dest=opt.env, metavar="VALUE", help=f"{opt.help}; env {opt.env}{default}"
        )
    return parser


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _ArgError(message)


def raw_settings(env: Mapping[str, str], argv: Sequence[str]) -> dict[str, str | None]:
    parser = build_arg_parser()
    quiet = _Parser(prog=parser.prog, description=parser.description, add_help=True)
    for action in parser._actions:
        if action.dest == "help":
            continue
        quiet.add_argument(*action.option_strings, dest=action.dest, metavar="VALUE", help=action.help)
    try:
        ns = quiet.parse_args(list(argv))
    except _ArgError as exc:
        raise ConfigError(str(exc)) from None
    out: dict[str, str | None] = {}
    for opt in OPTIONS:
        flag_value = getattr(ns, opt.env)
        out[opt.env] = flag_value if flag_value is not None else env.get(opt.env, opt.default)
    return out


def _bool(name: str, value: str | None) -> bool:
    v = (value or "").strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{name}: expected a boolean (1/0, true/false), got {value!r}")


def _int(name: str, value: str | None, lo: int, hi: int) -> int:
    try:
        n = int((value or "").strip())
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
    if not lo <= n <= hi:
        raise ConfigError(f"{name}: {n} is outside {lo}..{hi}")
    return n


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
    return host, _int(name, port_text, 1, 65535)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    return ipaddress.ip_address(host).is_loopback


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


def parse_config(env: Mapping[str, str], argv: Sequence[str] = ()) -> Config:
    raw = raw_settings(env, argv)
    profile = (raw["OPENSANDBOX_EGRESS_PROFILE"] or "").strip().lower()
    if profile not in ("sidecar", "fleet"):
        raise ConfigError(f"OPENSANDBOX_EGRESS_PROFILE: expected sidecar or fleet, got {profile!r}")
    http_default = "127.0.0.1:18080" if profile == "fleet" else "0.0.0.0:18080"
    http_host, http_port = parse_hostport(
        "OPENSANDBOX_EGRESS_HTTP_ADDR", raw["OPENSANDBOX_EGRESS_HTTP_ADDR"] or http_default
    )
    allow_non_loopback = _bool("EGRESSD_ALLOW_NON_LOOPBACK", raw["EGRESSD_ALLOW_NON_LOOPBACK"])
    if profile == "fleet" and not is_loopback(http_host) and not allow_non_loopback:
        raise ConfigError(
            f"OPENSANDBOX_EGRESS_HTTP_ADDR: {http_host} is not loopback; the fleet API must not be reachable "
            "from sandboxes (set EGRESSD_ALLOW_NON_LOOPBACK=1 to override)"
        )
    ttl_text = (raw["OPENSANDBOX_EGRESS_PENDING_PUSH_TTL"] or "").strip()
    try:
        ttl = int(ttl_text)
    except ValueError:
        ttl = 30
    if ttl <= 0:
        ttl = 30  # BEHAVIOUR §4: default/<=0/invalid -> 30
    try:
        timeout = float((raw["OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT"] or "5").strip())
    except ValueError:
        timeout = 5.0
    if not timeout > 0:
        timeout = 5.0
    timeout = min(timeout, 120.0)
    dns_host, dns_port = parse_hostport("EGRESSD_DNS_ADDR", raw["EGRESSD_DNS_ADDR"] or "0.0.0.0:15353")
    mode = (raw["OPENSANDBOX_EGRESS_MODE"] or "dns+nft").strip().lower()
    if mode not in ("dns", "dns+nft"):
        raise ConfigError(f"OPENSANDBOX_EGRESS_MODE: expected dns or dns+nft, got {mode!r}")
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
    log_format = (raw["EGRESSD_LOG_FORMAT"] or "json").strip().lower()
    if log_format not in ("json", "console"):
        raise ConfigError(f"EGRESSD_LOG_FORMAT: expected json or console, got {log_format!r}")
    policy_file = raw["OPENSANDBOX_EGRESS_POLICY_FILE"]
    vault_dir = raw["EGRESSD_VAULT_KEYS_DIR"]
    mitm_port = _int("OPENSANDBOX_EGRESS_MITMPROXY_PORT", raw["OPENSANDBOX_EGRESS_MITMPROXY_PORT"], 1, 65535)
    if mitm_port in (http_port, dns_port):
        raise ConfigError("OPENSANDBOX_EGRESS_MITMPROXY_PORT: collides with the HTTP or DNS port")
    upstreams = None
    if raw["OPENSANDBOX_EGRESS_DNS_UPSTREAM"] is not None:
        try:
            upstreams = parse_upstreams(raw["OPENSANDBOX_EGRESS_DNS_UPSTREAM"])
        except UpstreamError as exc:
            raise ConfigError(str(exc)) from None
    lease_min = _int("EGRESSD_DNS_LEASE_MIN", raw["EGRESSD_DNS_LEASE_MIN"], 1, 86400)
    lease_max = _int("EGRESSD_DNS_LEASE_MAX", raw["EGRESSD_DNS_LEASE_MAX"], 1, 86400)
    if lease_min > lease_max:
        raise ConfigError("EGRESSD_DNS_LEASE_MIN is larger than EGRESSD_DNS_LEASE_MAX")
    return Config(
        dns_upstreams=upstreams,
        dns_lease_min=lease_min,
        # 0 switches the budget off (like OPENSANDBOX_EGRESS_MAX_RULES=0); a negative or
        # non-integer value refuses to start rather than silently running unlimited.
        dns_qps_per_subject=_int(
            "EGRESSD_DNS_QPS_PER_SUBJECT", raw["EGRESSD_DNS_QPS_PER_SUBJECT"], 0, 1_000_000
        ),
        dns_lease_max=lease_max,
        refresh_interval=float(_int("EGRESSD_REFRESH_INTERVAL", raw["EGRESSD_REFRESH_INTERVAL"], 1, 3600)),
        always_reload_interval=float(
            _int(
                "EGRESSD_ALWAYS_RULES_RELOAD_INTERVAL", raw["EGRESSD_ALWAYS_RULES_RELOAD_INTERVAL"], 1, 86400
            )
        ),
        profile=profile,
        http_host=http_host,
        http_port=http_port,
        allow_non_loopback=allow_non_loopback,
        pending_push_ttl=ttl,
        block_doh_443=_bool("OPENSANDBOX_EGRESS_BLOCK_DOH_443", raw["OPENSANDBOX_EGRESS_BLOCK_DOH_443"]),
        doh_blocklist=parse_doh_blocklist(raw["OPENSANDBOX_EGRESS_DOH_BLOCKLIST"] or ""),
        mitm_transparent=_bool(
            "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT", raw["OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT"]
        ),
        mitm_port=mitm_port,
        mitm_upstream_trust_dir=Path(
            raw["OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR"] or "/etc/ssl/certs"
        ),
        mitm_ssl_insecure=_bool(
            "OPENSANDBOX_EGRESS_MITMPROXY_SSL_INSECURE", raw["OPENSANDBOX_EGRESS_MITMPROXY_SSL_INSECURE"]
        ),
        mitm_confdir=Path(raw["EGRESSD_MITM_CONFDIR"] or "/var/lib/egressd/mitm"),
        credential_proxy_socket=Path(
            raw["OPENSANDBOX_CREDENTIAL_PROXY_SOCKET"] or "/run/opensandbox/credential-proxy/active.sock"
        ),
        dns_upstream=raw["OPENSANDBOX_EGRESS_DNS_UPSTREAM"],
        dns_upstream_timeout=timeout,
        dns_host=dns_host,
        dns_port=dns_port,
        token=raw["OPENSANDBOX_EGRESS_TOKEN"] or None,
        rules=raw["OPENSANDBOX_EGRESS_RULES"],
        policy_file=Path(policy_file) if policy_file else None,
        mode=mode,
        max_rules=_int("OPENSANDBOX_EGRESS_MAX_RULES", raw["OPENSANDBOX_EGRESS_MAX_RULES"], 0, 10_000_000),
        max_leases=_int(
            "EGRESSD_MAX_LEASES_PER_SUBJECT", raw["EGRESSD_MAX_LEASES_PER_SUBJECT"] or "4096", 1, 1_000_000
        ),
        # No "0 = unlimited": the caps are what keeps validation cheap (14.7). The upper
        # bound is what a 1 MiB body could hold anyway.
        vault_max_credentials=_int(
            "EGRESSD_VAULT_MAX_CREDENTIALS", raw["EGRESSD_VAULT_MAX_CREDENTIALS"] or "256", 1, 100_000
        ),
        vault_max_bindings=_int(
            "EGRESSD_VAULT_MAX_BINDINGS", raw["EGRESSD_VAULT_MAX_BINDINGS"] or "256", 1, 100_000
        ),
        nft_table=table,
        always_rules_dir=Path(raw["EGRESSD_ALWAYS_RULES_DIR"] or "/var/egress/rules"),
        vault_keys_dir=Path(vault_dir) if vault_dir else None,
        log_format=log_format,
        allow_bridge_bypass=_bool("EGRESSD_ALLOW_BRIDGE_BYPASS", raw["EGRESSD_ALLOW_BRIDGE_BYPASS"]),
        sidecar_keep_table=_bool("EGRESSD_SIDECAR_KEEP_TABLE", raw["EGRESSD_SIDECAR_KEEP_TABLE"]),
        uid_ports=_uid_ports(
            raw,
            {
                "OPENSANDBOX_EGRESS_HTTP_ADDR": http_port,
                "EGRESSD_DNS_ADDR": dns_port,
                "OPENSANDBOX_EGRESS_MITMPROXY_PORT": mitm_port,
            }
            if profile == "fleet"
            else {},
        ),
    )
