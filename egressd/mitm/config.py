"""The MITM's options: its listeners and workers, its CA and private
directory, upstream trust, and what the child does with a decrypted flow (docs/reference/behaviour.md
§10, §16)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from egressd.options import ConfigError, Option, Raw, parse_bool, parse_int
from egressd.vault.types import compile_ignore_hosts

DEFAULT_MITM_CONFDIR = "/var/lib/egressd/mitm"
MAX_MITM_WORKERS = 16
#: The reference's iptables multiport cap (80 and 443 included), kept so a configuration moves
#: between the two unchanged.
MAX_MITM_PORTS = 15

OPTIONS: tuple[Option, ...] = (
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
        "MITM worker processes, 1..16 (default: usable CPUs); worker i listens on the MITM port + i; "
        "the sidecar (one subject) always runs one, and checks the value all the same",
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
        "comma-separated host regexes the MITM never decrypts (docs/reference/behaviour.md §16)",
        "",
        example=r"^pinned\.example\.com$",
    ),
    Option(
        "EGRESSD_MITM_TLS_RESUME",
        "--mitm-tls-resume",
        "on/off: the MITM resumes upstream TLS sessions, per sandbox, SNI and address",
        "on",
    ),
    # Benchmark switch: what redaction costs (an echoing upstream then hands the strings back).
    Option(
        "EGRESSD_MITM_BODY_REDACTION",
        "--mitm-body-redaction",
        "on/off: the MITM redacts vault strings from response bodies and WebSocket messages"
        " (off only to measure what redaction costs: an echoing upstream then hands them back)",
        "on",
        public=False,
    ),
    # Benchmark switch: what the kernel relay of passed-through TLS saves (issue 25 item 5).
    Option(
        "EGRESSD_MITM_KERNEL_RELAY",
        "--mitm-kernel-relay",
        "on/off: the MITM moves an admitted, passed-through TLS connection's upstream bytes to the"
        " client by splice(2) instead of through mitmproxy (off only to measure what that saves)",
        "on",
        public=False,
    ),
    Option(
        "EGRESSD_MITM_CA_EXPORT_DIR",
        "--mitm-ca-export-dir",
        "directory to write the public MITM CA certificate into (egressd-ca.pem, egressd-ca.crt)",
        example="/run/egressd/ca",
    ),
    # Benchmark switch: the round trip per lookup that answering from memory saves.
    Option(
        "EGRESSD_MITM_VAULT_PUSH",
        "--mitm-vault-push",
        "on: the MITM answers vault lookups from memory until egressd signals a narrowing (off: "
        "one _active round trip per lookup)",
        "on",
        public=False,
    ),
    Option(
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET",
        "--credential-proxy-socket",
        "private unix socket the MITM reads vaults from",
        "/run/opensandbox/credential-proxy/active.sock",
    ),
    # Reference sidecar parity (issue 15 item 3).
    Option(
        "OPENSANDBOX_EGRESS_MITMPROXY_CONFDIR",
        "--mitmproxy-confdir",
        "alias of EGRESSD_MITM_CONFDIR (both set and different: start-up error)",
    ),
    Option(
        "EGRESSD_NAME_CHECK",
        "--name-check",
        "on/off, with the MITM: TLS SNI and plain-HTTP Host of every intercepted TCP connection (80, 443, "
        "the extra ports, the ports a subject's http/https and any-protocol domain rules name) are admitted "
        "only for names that may reach that address and port (docs/reference/behaviour.md §18); off: "
        "address-level admission. Without the MITM there is no name check",
        "on",
    ),
    Option(
        "OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS",
        "--mitmproxy-extra-ports",
        "comma-separated TCP ports intercepted by the MITM besides 80 and 443 (at most 13)",
        "",
    ),
)


@dataclass(frozen=True, slots=True)
class MitmConfig:
    transparent: bool = False
    port: int = 18081
    # EGRESSD_MITM_WORKERS: worker i listens on port + i (the sidecar: always 1).
    workers: int = 1
    upstream_trust_dir: Path = Path("/etc/ssl/certs")
    ssl_insecure: bool = False
    confdir: Path = Path(DEFAULT_MITM_CONFDIR)
    credential_proxy_socket: Path = Path("/run/opensandbox/credential-proxy/active.sock")
    ignore_hosts: tuple[str, ...] = ()  # OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS (docs/reference/behaviour.md §16)
    ca_export_dir: Path | None = None  # EGRESSD_MITM_CA_EXPORT_DIR
    tls_resume: bool = True  # EGRESSD_MITM_TLS_RESUME (docs/reference/behaviour.md §10)
    body_redaction: bool = True  # EGRESSD_MITM_BODY_REDACTION (docs/reference/behaviour.md §10)
    kernel_relay: bool = True  # EGRESSD_MITM_KERNEL_RELAY (docs/reference/behaviour.md §16)
    vault_push: bool = True  # EGRESSD_MITM_VAULT_PUSH (docs/reference/behaviour.md §10, "answered from memory")
    extra_ports: tuple[int, ...] = ()  # OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS
    name_check_setting: bool = True  # EGRESSD_NAME_CHECK as set (docs/reference/behaviour.md §18)

    @property
    def name_check(self) -> bool:
        """Whether names are checked on the wire (docs/reference/behaviour.md §18): the one place that
        decides it (the MITM child, the status documents and the kernel's UDP 443 rule all read
        this). Only with the MITM, and unless ``EGRESSD_NAME_CHECK=off``."""
        return self.transparent and self.name_check_setting

    @property
    def quic_guard(self) -> bool:
        """Whether the kernel drops UDP 443 (QUIC) to an address open only by DNS learning
        (docs/reference/behaviour.md §18): unless ``EGRESSD_NAME_CHECK=off``, with or without the
        MITM. **egressd:** without the MITM there is no name check, but the §18 vector (``ports:
        [443]`` opens TCP 443, not UDP 443) holds all the same; ``off`` lifts it."""
        return self.name_check_setting

    @property
    def worker_ports(self) -> tuple[int, ...]:
        return tuple(self.port + i for i in range(self.workers))


def load_listeners(raw: Raw, profile: str, others: tuple[int, int]) -> tuple[int, int]:
    """(MITM port, workers). Worker i listens on port + i; the whole range must fit in
    1..65535 and miss the HTTP and DNS ports. The sidecar has one subject, so one worker."""
    port = parse_int("OPENSANDBOX_EGRESS_MITMPROXY_PORT", raw["OPENSANDBOX_EGRESS_MITMPROXY_PORT"], 1, 65535)
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


def load(raw: Raw, port: int, workers: int) -> MitmConfig:
    """The rest, once :func:`load_listeners` has placed the ports."""
    mitm = parse_bool("OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT", raw["OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT"])
    confdir = mitm_confdir(raw)
    return MitmConfig(
        transparent=mitm,
        port=port,
        workers=workers,
        upstream_trust_dir=Path(raw["OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR"] or "/etc/ssl/certs"),
        ssl_insecure=parse_bool(
            "OPENSANDBOX_EGRESS_MITMPROXY_SSL_INSECURE", raw["OPENSANDBOX_EGRESS_MITMPROXY_SSL_INSECURE"]
        ),
        confdir=confdir,
        credential_proxy_socket=Path(
            raw["OPENSANDBOX_CREDENTIAL_PROXY_SOCKET"] or "/run/opensandbox/credential-proxy/active.sock"
        ),
        ignore_hosts=parse_ignore_hosts(raw["OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS"] or ""),
        ca_export_dir=_ca_export_dir(raw, mitm, confdir),
        tls_resume=parse_bool("EGRESSD_MITM_TLS_RESUME", raw["EGRESSD_MITM_TLS_RESUME"]),
        body_redaction=parse_bool("EGRESSD_MITM_BODY_REDACTION", raw["EGRESSD_MITM_BODY_REDACTION"]),
        kernel_relay=parse_bool("EGRESSD_MITM_KERNEL_RELAY", raw["EGRESSD_MITM_KERNEL_RELAY"]),
        vault_push=parse_bool("EGRESSD_MITM_VAULT_PUSH", raw["EGRESSD_MITM_VAULT_PUSH"]),
        extra_ports=parse_extra_ports(raw["OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS"] or "", port, workers),
        name_check_setting=parse_name_check(raw["EGRESSD_NAME_CHECK"]),
    )


def parse_name_check(value: str | None) -> bool:
    """``EGRESSD_NAME_CHECK``: ``on`` (also unset or empty) or ``off``; anything else refuses the start."""
    text = (value or "").strip().lower()
    if text in ("", "on"):
        return True
    if text == "off":
        return False
    raise ConfigError(f"EGRESSD_NAME_CHECK: expected on or off, got {value!r}")


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
    return parse_int("EGRESSD_MITM_WORKERS", value, 1, MAX_MITM_WORKERS)


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


def mitm_confdir(raw: Raw) -> Path:
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
        port = parse_int(name, part, 1, 65535)
        if port in seen:
            raise ConfigError(f"{name}: duplicate or reserved port {port} (80/443 are always intercepted)")
        if port in (53, 853) or mitm_port <= port < mitm_port + workers:
            raise ConfigError(f"{name}: port {port} cannot be intercepted (DNS, DoT or the MITM's own port)")
        seen.add(port)
        out.append(port)
    if len(out) + 2 > MAX_MITM_PORTS:
        raise ConfigError(f"{name}: {len(out) + 2} ports with 80 and 443, more than {MAX_MITM_PORTS}")
    return tuple(out)
