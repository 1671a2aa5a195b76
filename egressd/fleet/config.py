"""The fleet profile's configuration: the options only the fleet reads
(its API's loopback guard, pending pushes, host-uid subjects docs/reference/behaviour.md §17, extra
sandbox-facing interfaces §20.2), composed with the subsystems' frozen configs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from egressd.commonconfig import CommonConfig
from egressd.dnsproxy.config import DnsConfig
from egressd.fleetnft.ifaces import iface_problem
from egressd.kernel.config import KernelConfig
from egressd.mitm.config import MitmConfig
from egressd.options import ConfigError, Option, Raw, is_loopback, parse_bool, parse_int
from egressd.subject.hostuid import (
    DEFAULT_UID_PORTS,
    DEFAULT_UID_RANGE,
    HOST_UID_MAX,
    HOST_UID_MIN,
    UidPorts,
    UidRange,
)
from egressd.vault.config import VaultConfig

OPTIONS: tuple[Option, ...] = (
    Option(
        "EGRESSD_ALLOW_NON_LOOPBACK",
        "--allow-non-loopback",
        "fleet: allow a non-loopback HTTP address",
        boolean=True,
        profile="fleet",
    ),
    Option(
        "OPENSANDBOX_EGRESS_PENDING_PUSH_TTL",
        "--pending-push-ttl",
        "seconds pushes for unknown UIDs are kept (the sidecar has no proxy route: no effect there)",
        "30",
    ),
    Option(
        "EGRESSD_UID_RANGE",
        "--uid-range",
        "fleet: host uids that belong to sandboxes, first-last (docs/reference/behaviour.md §17)",
        str(DEFAULT_UID_RANGE),
        profile="fleet",
    ),
    Option(
        "EGRESSD_UID_DNS_PORT_BASE",
        "--uid-dns-port-base",
        "fleet: first per-subject DNS port of host-uid subjects",
        "16000",
        profile="fleet",
    ),
    Option(
        "EGRESSD_UID_MAX_SUBJECTS",
        "--uid-max-subjects",
        "fleet: most host-uid subjects at once (one DNS and one MITM port each)",
        "256",
        profile="fleet",
    ),
    Option(
        "EGRESSD_SANDBOX_IFACES",
        "--sandbox-ifaces",
        "fleet: comma-separated interface names, or name* prefixes, whose packets are a sandbox's "
        "besides the attachments' hostVeths (bridges; docs/reference/behaviour.md §20.2)",
        "",
        profile="fleet",
        example="br-sandbox,veth*",
    ),
)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    common: CommonConfig
    dns: DnsConfig
    mitm: MitmConfig
    vault: VaultConfig
    kernel: KernelConfig
    allow_non_loopback: bool = False
    pending_push_ttl: int = 30
    uid_ports: UidPorts = DEFAULT_UID_PORTS  # EGRESSD_UID_* (docs/reference/behaviour.md §17)
    # EGRESSD_SANDBOX_IFACES (docs/reference/behaviour.md §20.2): names and "prefix*" of sandbox-facing interfaces.
    sandbox_ifaces: tuple[str, ...] = ()

    @property
    def profile(self) -> str:
        return "fleet"


def check_http_listener(raw: Raw, http_host: str) -> bool:
    """EGRESSD_ALLOW_NON_LOOPBACK; the fleet API stays on loopback unless overridden."""
    allow_non_loopback = parse_bool("EGRESSD_ALLOW_NON_LOOPBACK", raw["EGRESSD_ALLOW_NON_LOOPBACK"])
    if not is_loopback(http_host) and not allow_non_loopback:
        raise ConfigError(
            f"OPENSANDBOX_EGRESS_HTTP_ADDR: {http_host} is not loopback; the fleet API must not be reachable "
            "from sandboxes (set EGRESSD_ALLOW_NON_LOOPBACK=1 to override)"
        )
    return allow_non_loopback


def load(
    raw: Raw,
    allow_non_loopback: bool,
    subsystems: tuple[CommonConfig, DnsConfig, MitmConfig, VaultConfig, KernelConfig],
) -> FleetConfig:
    common, dns, mitm, vault, kernel = subsystems
    return FleetConfig(
        common=common,
        dns=dns,
        mitm=mitm,
        vault=vault,
        kernel=kernel,
        allow_non_loopback=allow_non_loopback,
        pending_push_ttl=pending_push_ttl(raw),
        sandbox_ifaces=parse_sandbox_ifaces(raw["EGRESSD_SANDBOX_IFACES"]),
        uid_ports=_uid_ports(
            raw,
            {
                "OPENSANDBOX_EGRESS_HTTP_ADDR": (common.http_port, common.http_port),
                "EGRESSD_DNS_ADDR": (dns.port, dns.port),
                "OPENSANDBOX_EGRESS_MITMPROXY_PORT": (mitm.port, mitm.port + mitm.workers - 1),
            },
        ),
    )


def pending_push_ttl(raw: Raw) -> int:
    ttl_text = (raw["OPENSANDBOX_EGRESS_PENDING_PUSH_TTL"] or "").strip()
    try:
        ttl = int(ttl_text)
    except ValueError:
        ttl = 30
    if ttl <= 0:
        ttl = 30  # docs/reference/actions-protocol.md §4: default/<=0/invalid -> 30
    return ttl


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
    block must avoid."""
    ports = UidPorts(
        parse_uid_range("EGRESSD_UID_RANGE", raw["EGRESSD_UID_RANGE"]),
        parse_int("EGRESSD_UID_DNS_PORT_BASE", raw["EGRESSD_UID_DNS_PORT_BASE"], 1, 65535),
        parse_int("EGRESSD_UID_MAX_SUBJECTS", raw["EGRESSD_UID_MAX_SUBJECTS"], 1, 16384),
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
