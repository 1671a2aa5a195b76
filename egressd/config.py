"""Configuration from the environment and ``--flags`` (flags win). Pure: env and argv in, Config out."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from egressd.dnsproxy.upstreams import Upstream, UpstreamError, parse_upstreams
from egressd.events.webhook import WebhookURLError, parse_webhook_url
from egressd.fleetnft.ifaces import iface_problem
from egressd.subject.hostuid import (
    DEFAULT_UID_PORTS,
    DEFAULT_UID_RANGE,
    HOST_UID_MAX,
    HOST_UID_MIN,
    UidPorts,
    UidRange,
)
from egressd.vault.types import VaultLimits, compile_ignore_hosts

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class ConfigError(ValueError):
    """One-line reason the daemon refuses to start."""


DEFAULT_MITM_CONFDIR = "/var/lib/egressd/mitm"


@dataclass(frozen=True, slots=True)
class Option:
    env: str
    flag: str
    help: str
    default: str | None = None
    boolean: bool = False


OPTIONS: tuple[Option, ...] = (
    Option("OPENSANDBOX_EGRESS_PROFILE", "--profile", "sidecar or fleet (fast-sandbox = fleet)", "sidecar"),
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
        "EGRESSD_MITM_WORKERS",
        "--mitm-workers",
        "fleet: MITM worker processes, 1..16 (default: usable CPUs); worker i listens on the MITM port + i",
    ),
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
    # No table default: set or not decides the precedence against its alias (below).
    Option(
        "EGRESSD_MITM_CONFDIR",
        "--mitm-confdir",
        f"the MITM's private directory (default {DEFAULT_MITM_CONFDIR!r})",
    ),
    Option(
        "OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS",
        "--mitmproxy-ignore-hosts",
        "comma-separated host regexes the MITM never decrypts (docs/behaviour.md §16)",
        "",
    ),
    Option(
        "EGRESSD_MITM_TLS_RESUME",
        "--mitm-tls-resume",
        "on/off: the MITM resumes upstream TLS sessions, per sandbox, SNI and address",
        "on",
    ),
    Option(
        "EGRESSD_MITM_BODY_REDACTION",
        "--mitm-body-redaction",
        "on/off: the MITM redacts vault strings from response bodies and WebSocket messages"
        " (off only to measure what redaction costs: an echoing upstream then hands them back)",
        "on",
    ),
    Option(
        "EGRESSD_MITM_CA_EXPORT_DIR",
        "--mitm-ca-export-dir",
        "directory to write the public MITM CA certificate into (egressd-ca.pem, egressd-ca.crt)",
    ),
    Option(
        "EGRESSD_MITM_VAULT_PUSH",
        "--mitm-vault-push",
        "on: the MITM answers vault lookups from memory until egressd signals a narrowing (off: "
        "one _active round trip per lookup)",
        "on",
    ),
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
        "credentials one vault may hold (docs/behaviour.md §14.7)",
        "256",
    ),
    Option(
        "EGRESSD_VAULT_MAX_BINDINGS",
        "--vault-max-bindings",
        "bindings one vault may hold (docs/behaviour.md §14.7)",
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
        "fleet: host uids that belong to sandboxes, first-last (docs/behaviour.md §17)",
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
    Option(
        "EGRESSD_SANDBOX_IFACES",
        "--sandbox-ifaces",
        "fleet: comma-separated interface names, or name* prefixes, whose packets are a sandbox's "
        "besides the attachments' hostVeths (bridges; docs/behaviour.md §20.2)",
        "",
    ),
    # docs/behaviour.md §15 (visibility).
    Option(
        "OPENSANDBOX_EGRESS_DENY_WEBHOOK",
        "--deny-webhook",
        "http(s) URL that gets a JSON POST for every DNS name the policy denies",
    ),
    Option(
        "EGRESSD_DENY_REJECT",
        "--deny-reject",
        "refuse denied TCP with a reset and other denied packets with ICMP admin-prohibited",
        boolean=True,
    ),
)

# Reference sidecar parity (issue 15 item 3): the variables the OpenSandbox server forwards to
# its egress sidecar. Parsed by the parse_* functions at the end of this module.
PARITY_OPTIONS: tuple[Option, ...] = (
    Option(
        "OPENSANDBOX_EGRESS_MITMPROXY_CONFDIR",
        "--mitmproxy-confdir",
        "alias of EGRESSD_MITM_CONFDIR (both set and different: start-up error)",
    ),
    Option("OPENSANDBOX_EGRESS_LOG_LEVEL", "--log-level", "debug, info, warn, error or fatal", "info"),
    Option(
        "OPENSANDBOX_EGRESS_SANDBOX_ID",
        "--sandbox-id",
        "sandbox id: sandbox_id label on every metric and field on every log line (and the "
        "sidecar's deny webhook sandboxId)",
    ),
    Option(
        "OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS",
        "--metrics-extra-attrs",
        "comma-separated key=value: constant labels on every metric, fields on every log line",
        "",
    ),
    Option(
        "OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS",
        "--mitmproxy-extra-ports",
        "comma-separated TCP ports intercepted by the MITM besides 80 and 443 (at most 13)",
        "",
    ),
    Option(
        "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS",
        "--credential-vault-require-tls",
        "vault writes only from loopback or a trusted proxy asserting X-Forwarded-Proto: https (else 426)",
        boolean=True,
    ),
    Option(
        "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_SCOPED_MATCH",
        "--credential-vault-require-scoped-match",
        "every vault binding must list its methods and paths, and no path may be /*",
        boolean=True,
    ),
    Option(
        "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS",
        "--credential-vault-trusted-proxy-cidrs",
        "comma-separated IPs/CIDRs whose X-Forwarded-Proto: https counts as TLS",
        "",
    ),
    Option(
        "OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT",
        "--nameserver-exempt",
        "comma-separated nameserver IPs sandboxes may query directly on port 53 (not proxied)",
        "",
    ),
)
OPTIONS = OPTIONS + PARITY_OPTIONS

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
    dns_qps_per_subject: int = 200  # docs/behaviour.md §14.3; 0 = no budget
    dns_lease_min: int = 60
    dns_lease_max: int = 360
    refresh_interval: float = 30.0
    always_reload_interval: float = 60.0
    sidecar_keep_table: bool = False
    max_leases: int = 4096  # EGRESSD_MAX_LEASES_PER_SUBJECT (docs/behaviour.md §14.4)
    vault_max_credentials: int = 256  # EGRESSD_VAULT_MAX_CREDENTIALS (docs/behaviour.md §14.7)
    vault_max_bindings: int = 256  # EGRESSD_VAULT_MAX_BINDINGS (docs/behaviour.md §14.7)
    # Reference sidecar parity (issue 15 item 3).
    log_level: int = logging.INFO  # OPENSANDBOX_EGRESS_LOG_LEVEL
    sandbox_id: str | None = None  # OPENSANDBOX_EGRESS_SANDBOX_ID
    metrics_extra_attrs: tuple[tuple[str, str], ...] = ()  # OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS
    mitm_extra_ports: tuple[int, ...] = ()  # OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS
    vault_require_tls: bool = False  # OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS
    vault_require_scoped_match: bool = False  # ..._CREDENTIAL_VAULT_REQUIRE_SCOPED_MATCH
    vault_trusted_proxies: tuple[IPNetwork, ...] = ()  # ..._CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS
    nameserver_exempt: tuple[IPAddress, ...] = ()  # OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT
    uid_ports: UidPorts = DEFAULT_UID_PORTS  # EGRESSD_UID_* (docs/behaviour.md §17)
    mitm_ignore_hosts: tuple[str, ...] = ()  # OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS (docs/behaviour.md §16)
    mitm_ca_export_dir: Path | None = None  # EGRESSD_MITM_CA_EXPORT_DIR
    mitm_tls_resume: bool = True  # EGRESSD_MITM_TLS_RESUME (docs/behaviour.md §10)
    mitm_body_redaction: bool = True  # EGRESSD_MITM_BODY_REDACTION (docs/behaviour.md §10)
    mitm_vault_push: bool = True  # EGRESSD_MITM_VAULT_PUSH (docs/behaviour.md §10, "answered from memory")
    # docs/behaviour.md §15. The webhook URL may carry a token: kept out of repr (and of every log).
    deny_webhook: str | None = field(default=None, repr=False)
    deny_reject: bool = False  # EGRESSD_DENY_REJECT
    # EGRESSD_MITM_WORKERS: worker i listens on mitm_port + i (the sidecar: always 1).
    mitm_workers: int = 1
    # EGRESSD_SANDBOX_IFACES (docs/behaviour.md §20.2): names and "prefix*" of sandbox-facing interfaces.
    sandbox_ifaces: tuple[str, ...] = ()

    @property
    def mitm_worker_ports(self) -> tuple[int, ...]:
        return tuple(self.mitm_port + i for i in range(self.mitm_workers))

    @property
    def vault_limits(self) -> VaultLimits:
        return VaultLimits(
            credentials=self.vault_max_credentials,
            bindings=self.vault_max_bindings,
            require_scoped_match=self.vault_require_scoped_match,
            # A binding host the MITM never decrypts could never be injected (§6: 400).
            ignore_hosts=compile_ignore_hosts(self.mitm_ignore_hosts),
        )

    @property
    def metric_labels(self) -> tuple[tuple[str, str], ...]:
        """Constant labels of every metric: ``sandbox_id`` first (when set), then the extra
        attributes with their keys made Prometheus label names (the reference's OTel exporter
        does the same: ``k8s.pod`` -> ``k8s_pod``)."""
        out = [("sandbox_id", self.sandbox_id)] if self.sandbox_id is not None else []
        out += [(label_name(k), v) for k, v in self.metrics_extra_attrs]
        return tuple(out)

    @property
    def log_fields(self) -> dict[str, str]:
        """Fields on every log line (the reference merges the same pairs into its root logger)."""
        out = {"sandbox_id": self.sandbox_id} if self.sandbox_id is not None else {}
        return out | dict(self.metrics_extra_attrs)


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


def parse_sandbox_ifaces(value: str | None) -> tuple[str, ...]:
    """EGRESSD_SANDBOX_IFACES: interface names or ``prefix*``, each one that can name an
    interface other than loopback (a bad entry refuses the start: it would police nothing)."""
    out: list[str] = []
    for raw in (value or "").split(","):
        item = raw.strip()
        if not item:
            continue
        problem = iface_problem(item, prefix_ok=True)
        if problem is not None:
            raise ConfigError(f"EGRESSD_SANDBOX_IFACES: {item!r} {problem}")
        out.append(item)
    return tuple(dict.fromkeys(out))


def _uid_ports(raw: Mapping[str, str | None], taken: Mapping[str, tuple[int, int]]) -> UidPorts:
    """EGRESSD_UID_*; ``taken`` are the other listeners' port ranges (first, last), which the
    block must avoid (empty for the sidecar, which has no host-uid subjects)."""
    ports = UidPorts(
        parse_uid_range("EGRESSD_UID_RANGE", raw["EGRESSD_UID_RANGE"]),
        _int("EGRESSD_UID_DNS_PORT_BASE", raw["EGRESSD_UID_DNS_PORT_BASE"], 1, 65535),
        _int("EGRESSD_UID_MAX_SUBJECTS", raw["EGRESSD_UID_MAX_SUBJECTS"], 1, 16384),
    )
    if ports.last > 65535:
        raise ConfigError(
            f"EGRESSD_UID_DNS_PORT_BASE: {ports.base} + 2 x EGRESSD_UID_MAX_SUBJECTS + 1 passes port 65535"
        )
    for name, (lo, hi) in taken.items():
        if lo <= ports.last and ports.base <= hi:
            what = str(lo) if lo == hi else f"{lo}-{hi} (with EGRESSD_MITM_WORKERS)"
            raise ConfigError(
                f"EGRESSD_UID_DNS_PORT_BASE: the host-uid ports {ports.base}-{ports.last} include {name} {what}"
            )
    return ports


MAX_MITM_WORKERS = 16


def default_mitm_workers(cpus: int) -> int:
    """Unset EGRESSD_MITM_WORKERS: one worker per usable CPU, clamped to 1..16."""
    return max(1, min(MAX_MITM_WORKERS, cpus))


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_mitm_workers(value: str | None, cpus: int) -> int:
    """``EGRESSD_MITM_WORKERS``: an integer 1..16; unset (or empty) = the usable CPUs."""
    if value is None or not value.strip():
        return default_mitm_workers(cpus)
    return _int("EGRESSD_MITM_WORKERS", value, 1, MAX_MITM_WORKERS)


def _mitm_listeners(raw: Raw, profile: str, others: tuple[int, int]) -> tuple[int, int]:
    """(MITM port, workers). Worker i listens on port + i; the whole range must fit in
    1..65535 and miss the HTTP and DNS ports. The sidecar has one subject, so one worker
    (the variable is still checked, so a typo refuses start-up in both profiles)."""
    port = _int("OPENSANDBOX_EGRESS_MITMPROXY_PORT", raw["OPENSANDBOX_EGRESS_MITMPROXY_PORT"], 1, 65535)
    if port in others:
        raise ConfigError("OPENSANDBOX_EGRESS_MITMPROXY_PORT: collides with the HTTP or DNS port")
    workers = parse_mitm_workers(raw["EGRESSD_MITM_WORKERS"], _usable_cpus())
    if profile != "fleet":
        return port, 1
    last = port + workers - 1
    if last > 65535:
        raise ConfigError(
            f"EGRESSD_MITM_WORKERS: {workers} worker ports from OPENSANDBOX_EGRESS_MITMPROXY_PORT {port} pass port 65535"
        )
    for other in others:
        if port <= other <= last:
            raise ConfigError(
                f"EGRESSD_MITM_WORKERS: the worker ports {port}-{last} include the HTTP or DNS port {other}"
            )
    return port, workers


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


#: The settings as read (flag, else environment, else default), before any check.
Raw = Mapping[str, str | None]


# Groups of Config fields, filled by the helpers below (typed, so mypy checks every name).
class _Limits(TypedDict):
    dns_qps_per_subject: int
    refresh_interval: float
    always_reload_interval: float


class _Interception(TypedDict):
    block_doh_443: bool
    doh_blocklist: tuple[IPNetwork, ...]
    mitm_transparent: bool
    mitm_upstream_trust_dir: Path
    mitm_ssl_insecure: bool
    mitm_confdir: Path
    credential_proxy_socket: Path
    mitm_ignore_hosts: tuple[str, ...]
    mitm_ca_export_dir: Path | None
    mitm_tls_resume: bool
    mitm_body_redaction: bool
    mitm_vault_push: bool


class _Parity(TypedDict):
    log_level: int
    sandbox_id: str | None
    metrics_extra_attrs: tuple[tuple[str, str], ...]
    mitm_extra_ports: tuple[int, ...]
    vault_require_tls: bool
    vault_require_scoped_match: bool
    vault_trusted_proxies: tuple[IPNetwork, ...]
    nameserver_exempt: tuple[IPAddress, ...]


class _Visibility(TypedDict):
    deny_webhook: str | None
    deny_reject: bool


class _Caps(TypedDict):
    max_rules: int
    max_leases: int
    vault_max_credentials: int
    vault_max_bindings: int


class _Host(TypedDict):
    nft_table: str
    always_rules_dir: Path
    vault_keys_dir: Path | None
    log_format: str
    allow_bridge_bypass: bool
    sidecar_keep_table: bool


def parse_config(env: Mapping[str, str], argv: Sequence[str] = ()) -> Config:
    # The helpers run in the order the settings were always checked, so a configuration
    # with several mistakes still names the same one first.
    raw = raw_settings(env, argv)
    profile = _profile(raw)
    http_host, http_port, allow_non_loopback = _http_listener(raw, profile)
    ttl = _pending_push_ttl(raw)
    timeout = _dns_upstream_timeout(raw)
    dns_host, dns_port = parse_hostport("EGRESSD_DNS_ADDR", raw["EGRESSD_DNS_ADDR"] or "0.0.0.0:15353")
    mode = _choice(raw, "OPENSANDBOX_EGRESS_MODE", "dns+nft", ("dns", "dns+nft"), "dns or dns+nft")
    table = _nft_table(raw, profile)
    log_format = _choice(raw, "EGRESSD_LOG_FORMAT", "json", ("json", "console"), "json or console")
    mitm_port, workers = _mitm_listeners(raw, profile, (http_port, dns_port))
    upstreams = _dns_upstreams(raw)
    lease_min, lease_max = _lease_bounds(raw)
    policy_file = raw["OPENSANDBOX_EGRESS_POLICY_FILE"]
    return Config(
        **_parity(raw, mitm_port, workers),
        dns_upstreams=upstreams,
        dns_lease_min=lease_min,
        dns_lease_max=lease_max,
        **_visibility(raw),
        **_limits(raw),
        profile=profile,
        http_host=http_host,
        http_port=http_port,
        allow_non_loopback=allow_non_loopback,
        pending_push_ttl=ttl,
        **_interception(raw),
        mitm_port=mitm_port,
        mitm_workers=workers,
        dns_upstream=raw["OPENSANDBOX_EGRESS_DNS_UPSTREAM"],
        dns_upstream_timeout=timeout,
        dns_host=dns_host,
        dns_port=dns_port,
        token=raw["OPENSANDBOX_EGRESS_TOKEN"] or None,
        rules=raw["OPENSANDBOX_EGRESS_RULES"],
        policy_file=Path(policy_file) if policy_file else None,
        mode=mode,
        **_caps(raw),
        **_host(raw, table, log_format),
        sandbox_ifaces=parse_sandbox_ifaces(raw["EGRESSD_SANDBOX_IFACES"]),
        uid_ports=_uid_ports(
            raw,
            {
                "OPENSANDBOX_EGRESS_HTTP_ADDR": (http_port, http_port),
                "EGRESSD_DNS_ADDR": (dns_port, dns_port),
                "OPENSANDBOX_EGRESS_MITMPROXY_PORT": (mitm_port, mitm_port + workers - 1),
            }
            if profile == "fleet"
            else {},
        ),
    )


def _profile(raw: Raw) -> str:
    profile = (raw["OPENSANDBOX_EGRESS_PROFILE"] or "").strip().lower()
    profile = PROFILE_ALIASES.get(profile, profile)
    if profile not in ("sidecar", "fleet"):
        raise ConfigError(
            f"OPENSANDBOX_EGRESS_PROFILE: expected sidecar, fleet or fast-sandbox, got {profile!r}"
        )
    return profile


def _http_listener(raw: Raw, profile: str) -> tuple[str, int, bool]:
    """(host, port, allow_non_loopback); the fleet API stays on loopback unless overridden."""
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
    return http_host, http_port, allow_non_loopback


def _pending_push_ttl(raw: Raw) -> int:
    ttl_text = (raw["OPENSANDBOX_EGRESS_PENDING_PUSH_TTL"] or "").strip()
    try:
        ttl = int(ttl_text)
    except ValueError:
        ttl = 30
    if ttl <= 0:
        ttl = 30  # docs/protocol.md §4: default/<=0/invalid -> 30
    return ttl


def _dns_upstream_timeout(raw: Raw) -> float:
    try:
        timeout = float((raw["OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT"] or "5").strip())
    except ValueError:
        timeout = 5.0
    if not timeout > 0:
        timeout = 5.0
    return min(timeout, 120.0)


def _choice(raw: Raw, name: str, default: str, allowed: tuple[str, ...], expected: str) -> str:
    value = (raw[name] or default).strip().lower()
    if value not in allowed:
        raise ConfigError(f"{name}: expected {expected}, got {value!r}")
    return value


def _nft_table(raw: Raw, profile: str) -> str:
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


def _dns_upstreams(raw: Raw) -> tuple[Upstream, ...] | None:
    """None: not configured, the resolvers of /etc/resolv.conf are read at start-up."""
    if raw["OPENSANDBOX_EGRESS_DNS_UPSTREAM"] is None:
        return None
    try:
        return parse_upstreams(raw["OPENSANDBOX_EGRESS_DNS_UPSTREAM"])
    except UpstreamError as exc:
        raise ConfigError(str(exc)) from None


def _lease_bounds(raw: Raw) -> tuple[int, int]:
    lease_min = _int("EGRESSD_DNS_LEASE_MIN", raw["EGRESSD_DNS_LEASE_MIN"], 1, 86400)
    lease_max = _int("EGRESSD_DNS_LEASE_MAX", raw["EGRESSD_DNS_LEASE_MAX"], 1, 86400)
    if lease_min > lease_max:
        raise ConfigError("EGRESSD_DNS_LEASE_MIN is larger than EGRESSD_DNS_LEASE_MAX")
    return lease_min, lease_max


def _visibility(raw: Raw) -> _Visibility:
    """docs/behaviour.md §15: the deny webhook (its URL may carry a token: never echoed) and the reject knob."""
    try:
        deny_webhook = parse_webhook_url(raw["OPENSANDBOX_EGRESS_DENY_WEBHOOK"])
    except WebhookURLError as exc:
        raise ConfigError(f"OPENSANDBOX_EGRESS_DENY_WEBHOOK: {exc}") from None
    return _Visibility(
        deny_webhook=deny_webhook,
        deny_reject=_bool("EGRESSD_DENY_REJECT", raw["EGRESSD_DENY_REJECT"]),
    )


def _limits(raw: Raw) -> _Limits:
    return _Limits(
        # 0 switches the budget off (like OPENSANDBOX_EGRESS_MAX_RULES=0); a negative or
        # non-integer value refuses to start rather than silently running unlimited.
        dns_qps_per_subject=_int(
            "EGRESSD_DNS_QPS_PER_SUBJECT", raw["EGRESSD_DNS_QPS_PER_SUBJECT"], 0, 1_000_000
        ),
        refresh_interval=float(_int("EGRESSD_REFRESH_INTERVAL", raw["EGRESSD_REFRESH_INTERVAL"], 1, 3600)),
        always_reload_interval=float(
            _int(
                "EGRESSD_ALWAYS_RULES_RELOAD_INTERVAL", raw["EGRESSD_ALWAYS_RULES_RELOAD_INTERVAL"], 1, 86400
            )
        ),
    )


def _interception(raw: Raw) -> _Interception:
    """The DoH block and the MITM."""
    mitm = _bool("OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT", raw["OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT"])
    confdir = mitm_confdir(raw)
    return _Interception(
        block_doh_443=_bool("OPENSANDBOX_EGRESS_BLOCK_DOH_443", raw["OPENSANDBOX_EGRESS_BLOCK_DOH_443"]),
        doh_blocklist=parse_doh_blocklist(raw["OPENSANDBOX_EGRESS_DOH_BLOCKLIST"] or ""),
        mitm_transparent=mitm,
        mitm_upstream_trust_dir=Path(
            raw["OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR"] or "/etc/ssl/certs"
        ),
        mitm_ssl_insecure=_bool(
            "OPENSANDBOX_EGRESS_MITMPROXY_SSL_INSECURE", raw["OPENSANDBOX_EGRESS_MITMPROXY_SSL_INSECURE"]
        ),
        mitm_confdir=confdir,
        credential_proxy_socket=Path(
            raw["OPENSANDBOX_CREDENTIAL_PROXY_SOCKET"] or "/run/opensandbox/credential-proxy/active.sock"
        ),
        mitm_ignore_hosts=parse_ignore_hosts(raw["OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS"] or ""),
        mitm_ca_export_dir=_ca_export_dir(raw, mitm, confdir),
        mitm_tls_resume=_bool("EGRESSD_MITM_TLS_RESUME", raw["EGRESSD_MITM_TLS_RESUME"]),
        mitm_body_redaction=_bool("EGRESSD_MITM_BODY_REDACTION", raw["EGRESSD_MITM_BODY_REDACTION"]),
        mitm_vault_push=_bool("EGRESSD_MITM_VAULT_PUSH", raw["EGRESSD_MITM_VAULT_PUSH"]),
    )


def parse_ignore_hosts(value: str) -> tuple[str, ...]:
    """Comma-separated regular expressions (mitmproxy's ``ignore_hosts`` syntax, which the
    reference passes through): each must compile; empty items are dropped."""
    out: list[str] = []
    for raw in value.split(","):
        item = raw.strip()
        if not item:
            continue
        try:
            compile_ignore_hosts((item,))
        except re.error as exc:
            raise ConfigError(
                f"OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS: invalid pattern {item!r} ({exc})"
            ) from None
        out.append(item)
    return tuple(out)


def _ca_export_dir(raw: Raw, mitm: bool, confdir: Path) -> Path | None:
    """EGRESSD_MITM_CA_EXPORT_DIR: only with the MITM, and never overlapping its confdir."""
    text = (raw["EGRESSD_MITM_CA_EXPORT_DIR"] or "").strip()
    if not text:
        return None
    export = Path(text)
    if not mitm:
        raise ConfigError(
            "EGRESSD_MITM_CA_EXPORT_DIR: there is no MITM CA to export without "
            "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT"
        )
    # Whoever mounts the export directory into sandboxes must never see the CA key.
    a, b = export.absolute(), confdir.absolute()
    if a == b or b in a.parents or a in b.parents:
        raise ConfigError(
            f"EGRESSD_MITM_CA_EXPORT_DIR: {export} overlaps EGRESSD_MITM_CONFDIR {confdir}, which holds the CA key"
        )
    return export


def _parity(raw: Raw, mitm_port: int, workers: int = 1) -> _Parity:
    """The reference sidecar's variables (issue 15 item 3); see "Reference sidecar parity"."""
    extra_ports = parse_extra_ports(raw["OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS"] or "", mitm_port, workers)
    return _Parity(
        log_level=parse_log_level(raw["OPENSANDBOX_EGRESS_LOG_LEVEL"]),
        sandbox_id=parse_sandbox_id(raw["OPENSANDBOX_EGRESS_SANDBOX_ID"]),
        metrics_extra_attrs=parse_extra_attrs(raw["OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS"] or ""),
        mitm_extra_ports=extra_ports,
        vault_require_tls=_bool(
            "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS",
            raw["OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS"],
        ),
        vault_require_scoped_match=_bool(
            "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_SCOPED_MATCH",
            raw["OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_SCOPED_MATCH"],
        ),
        vault_trusted_proxies=parse_networks(
            "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS",
            raw["OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS"] or "",
        ),
        nameserver_exempt=parse_nameserver_exempt(raw["OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT"] or ""),
    )


def _caps(raw: Raw) -> _Caps:
    return _Caps(
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
    )


def _host(raw: Raw, table: str, log_format: str) -> _Host:
    """What the daemon keeps on this host: its table, its directories, its logs."""
    vault_dir = raw["EGRESSD_VAULT_KEYS_DIR"]
    return _Host(
        nft_table=table,
        always_rules_dir=Path(raw["EGRESSD_ALWAYS_RULES_DIR"] or "/var/egress/rules"),
        vault_keys_dir=Path(vault_dir) if vault_dir else None,
        log_format=log_format,
        allow_bridge_bypass=_bool("EGRESSD_ALLOW_BRIDGE_BYPASS", raw["EGRESSD_ALLOW_BRIDGE_BYPASS"]),
        sidecar_keep_table=_bool("EGRESSD_SIDECAR_KEEP_TABLE", raw["EGRESSD_SIDECAR_KEEP_TABLE"]),
    )


# ---- reference sidecar parity (issue 15 item 3) ----------------------------------------------

#: ``OPENSANDBOX_EGRESS_PROFILE`` values that name a profile by another name: the reference's
#: newer name for the multi-sandbox profile.
PROFILE_ALIASES: dict[str, str] = {"fast-sandbox": "fleet"}

_LOG_LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "fatal": logging.CRITICAL,
}

#: Label names a constant label may not take: Prometheus' own, and every label an egressd
#: metric carries (a sample with one label twice is not valid exposition text).
#: tests/unit/test_parity.py checks that every label of EgressMetrics is listed.
RESERVED_LABELS: frozenset[str] = frozenset(
    {
        "le",
        "quantile",
        "state",
        "operation",
        "code",
        "from",
        "to",
        "subject",
        "layer",
        "rule",
        "reason",
        "outcome",
        "result",
        "decision_id",
        "sandbox_id",
        "protocol",  # egressd_mitm_connections_total (docs/behaviour.md §16)
        "decision",
        "worker",  # the egressd_mitm_* series (EGRESSD_MITM_WORKERS)
    }
)
#: The reference's iptables multiport cap (80 and 443 included), kept so a configuration moves
#: between the two unchanged.
MAX_MITM_PORTS = 15
_ATTR_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def mitm_confdir(raw: Mapping[str, str | None]) -> Path:
    """``EGRESSD_MITM_CONFDIR`` or its reference alias ``OPENSANDBOX_EGRESS_MITMPROXY_CONFDIR``
    (each: flag over env). One of them set: that one; both set to different directories:
    refused, since nobody can tell which CA the operator meant to pin."""
    ours = raw["EGRESSD_MITM_CONFDIR"] or ""
    alias = raw["OPENSANDBOX_EGRESS_MITMPROXY_CONFDIR"] or ""
    if ours and alias and Path(ours) != Path(alias):
        raise ConfigError(
            f"EGRESSD_MITM_CONFDIR ({ours!r}) and OPENSANDBOX_EGRESS_MITMPROXY_CONFDIR ({alias!r}) "
            "name different directories; set one of them"
        )
    return Path(ours or alias or DEFAULT_MITM_CONFDIR)


def parse_log_level(value: str | None) -> int:
    """The reference's zap levels (``warning`` too); case-insensitive; unset/empty = info."""
    text = (value or "").strip().lower() or "info"
    if text not in _LOG_LEVELS:
        raise ConfigError(
            f"OPENSANDBOX_EGRESS_LOG_LEVEL: expected debug, info, warn, error or fatal, got {value!r}"
        )
    return _LOG_LEVELS[text]


def _printable(name: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise ConfigError(f"{name}: longer than {limit} characters")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ConfigError(f"{name}: contains a control character")


def parse_sandbox_id(value: str | None) -> str | None:
    """Trimmed like the reference; empty = unset. It lands in every log line and metric."""
    text = (value or "").strip()
    if not text:
        return None
    _printable("OPENSANDBOX_EGRESS_SANDBOX_ID", text, 256)
    return text


def label_name(key: str) -> str:
    """An attribute key as a Prometheus label name (``.`` and ``-`` become ``_``)."""
    return key.replace(".", "_").replace("-", "_")


def parse_extra_attrs(value: str) -> tuple[tuple[str, str], ...]:
    """``k=v,k2=v2`` (each part trimmed, empty parts skipped), as the reference reads it; a part
    it would skip silently (no ``=``, empty key or value) is refused here, like a key that is
    no label name, a label egressd's metrics already use, or a key given twice."""
    name = "OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS"
    out: list[tuple[str, str]] = []
    labels: set[str] = set()
    for raw_part in value.split(","):
        part = raw_part.strip()
        if not part:
            continue
        key, sep, val = part.partition("=")
        key, val = key.strip(), val.strip()
        if not sep or not key or not val:
            raise ConfigError(f"{name}: expected key=value, got {part!r}")
        label = label_name(key)
        if not _ATTR_KEY.fullmatch(key) or label.startswith("__"):
            raise ConfigError(f"{name}: {key!r} is not a valid label name")
        if label in RESERVED_LABELS:
            raise ConfigError(f"{name}: {key!r} is a label egressd's metrics already use")
        if label in labels:
            raise ConfigError(f"{name}: {key!r} is given twice")
        _printable(name, val, 256)
        labels.add(label)
        out.append((key, val))
    return tuple(out)


def parse_extra_ports(value: str, mitm_port: int, workers: int = 1) -> tuple[int, ...]:
    """The reference's rules: comma-separated integers 1..65535, no empty entry, no duplicate,
    never 80 or 443 (always intercepted), at most 15 ports with those two. egressd also
    refuses 53 and 853 (intercepting them would take DNS and DoT past their own rules) and the
    MITM's own ports (every worker's)."""
    name = "OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS"
    text = value.strip()
    if not text:
        return ()
    seen = {80, 443}
    out: list[int] = []
    for raw_part in text.split(","):
        part = raw_part.strip()
        if not part:
            raise ConfigError(f"{name}: empty entry in {value!r}")
        port = _int(name, part, 1, 65535)
        if port in seen:
            raise ConfigError(f"{name}: duplicate or reserved port {port} (80/443 are always intercepted)")
        if port in (53, 853) or mitm_port <= port < mitm_port + workers:
            raise ConfigError(f"{name}: port {port} cannot be intercepted (DNS, DoT or the MITM's own port)")
        seen.add(port)
        out.append(port)
    if len(out) + 2 > MAX_MITM_PORTS:
        raise ConfigError(f"{name}: {len(out) + 2} ports with 80 and 443, more than {MAX_MITM_PORTS}")
    return tuple(out)


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


def ignored_settings(cfg: Config) -> list[str]:
    """Parity settings that have no effect with the rest of ``cfg`` (logged at start-up, so
    nothing is ignored silently). None of them weakens enforcement by being ignored."""
    notes = []
    if cfg.mitm_extra_ports and not cfg.mitm_transparent:
        notes.append(
            "OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS: the MITM is off (OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT)"
        )
    if cfg.vault_trusted_proxies and not cfg.vault_require_tls:
        notes.append(
            "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS: only read with "
            "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS on"
        )
    if cfg.sandbox_ifaces and cfg.profile != "fleet":
        # The sidecar runs inside its sandbox's namespace: no interface there faces another.
        notes.append("EGRESSD_SANDBOX_IFACES: fleet only (the sidecar shares its sandbox's namespace)")
    return notes
