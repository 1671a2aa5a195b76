"""The options both profiles read: the profile itself, the HTTP listener,
logs and metric labels, the policy's rule cap, the always-rules and the deny webhook
(docs/reference/behaviour.md §15)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from egressd.events.webhook import WebhookURLError, parse_webhook_url
from egressd.mitm.config import MitmConfig
from egressd.options import (
    ConfigError,
    Option,
    Raw,
    check_printable,
    parse_choice,
    parse_hostport,
    parse_int,
)
from egressd.vault.config import VaultConfig

OPTIONS: tuple[Option, ...] = (
    Option("OPENSANDBOX_EGRESS_PROFILE", "--profile", "sidecar or fleet (fast-sandbox = fleet)", "sidecar"),
    Option("OPENSANDBOX_EGRESS_HTTP_ADDR", "--http-addr", "HTTP listener host:port (fleet 127.0.0.1:18080)"),
    Option("OPENSANDBOX_EGRESS_MAX_RULES", "--max-rules", "rule cap (0 = unlimited)", "4096"),
    Option(
        "EGRESSD_ALWAYS_RULES_DIR",
        "--always-rules-dir",
        "directory of deny.always/allow.always",
        "/var/egress/rules",
    ),
    Option(
        "EGRESSD_ALWAYS_RULES_RELOAD_INTERVAL",
        "--always-rules-reload-interval",
        "seconds between re-reads",
        "60",
    ),
    Option("EGRESSD_LOG_FORMAT", "--log-format", "json or console", "json"),
    # docs/reference/behaviour.md §15 (visibility).
    Option(
        "OPENSANDBOX_EGRESS_DENY_WEBHOOK",
        "--deny-webhook",
        "http(s) URL that gets a JSON POST for every DNS name the policy denies",
    ),
    # Reference sidecar parity (issue 15 item 3).
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
)

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
        "protocol",  # egressd_mitm_connections_total (docs/reference/behaviour.md §16)
        "decision",
        "worker",  # the egressd_mitm_* series (EGRESSD_MITM_WORKERS)
    }
)
_ATTR_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass(frozen=True, slots=True)
class CommonConfig:
    http_host: str = "0.0.0.0"
    http_port: int = 18080
    max_rules: int = 4096
    always_rules_dir: Path = Path("/var/egress/rules")
    always_reload_interval: float = 60.0
    log_format: str = "json"
    # docs/reference/behaviour.md §15. The webhook URL may carry a token: kept out of repr (and of every log).
    deny_webhook: str | None = field(default=None, repr=False)
    # Reference sidecar parity (issue 15 item 3).
    log_level: int = logging.INFO  # OPENSANDBOX_EGRESS_LOG_LEVEL
    sandbox_id: str | None = None  # OPENSANDBOX_EGRESS_SANDBOX_ID
    metrics_extra_attrs: tuple[tuple[str, str], ...] = ()  # OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS

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


def load_profile(raw: Raw) -> str:
    profile = (raw["OPENSANDBOX_EGRESS_PROFILE"] or "").strip().lower()
    profile = PROFILE_ALIASES.get(profile, profile)
    if profile not in ("sidecar", "fleet"):
        raise ConfigError(
            f"OPENSANDBOX_EGRESS_PROFILE: expected sidecar, fleet or fast-sandbox, got {profile!r}"
        )
    return profile


def load_http_listener(raw: Raw, profile: str) -> tuple[str, int]:
    """(host, port); the fleet's default stays on loopback (the fleet checks the rest)."""
    http_default = "127.0.0.1:18080" if profile == "fleet" else "0.0.0.0:18080"
    return parse_hostport("OPENSANDBOX_EGRESS_HTTP_ADDR", raw["OPENSANDBOX_EGRESS_HTTP_ADDR"] or http_default)


def load_log_format(raw: Raw) -> str:
    return parse_choice(raw, "EGRESSD_LOG_FORMAT", "json", ("json", "console"), "json or console")


def load(raw: Raw, http: tuple[str, int], log_format: str) -> CommonConfig:
    """The rest, once the listener and the log format (checked early) are known."""
    return CommonConfig(
        http_host=http[0],
        http_port=http[1],
        max_rules=parse_int("OPENSANDBOX_EGRESS_MAX_RULES", raw["OPENSANDBOX_EGRESS_MAX_RULES"], 0, 10_000_000),
        always_rules_dir=Path(raw["EGRESSD_ALWAYS_RULES_DIR"] or "/var/egress/rules"),
        always_reload_interval=float(
            parse_int(
                "EGRESSD_ALWAYS_RULES_RELOAD_INTERVAL", raw["EGRESSD_ALWAYS_RULES_RELOAD_INTERVAL"], 1, 86400
            )
        ),
        log_format=log_format,
        deny_webhook=_deny_webhook(raw),
        log_level=parse_log_level(raw["OPENSANDBOX_EGRESS_LOG_LEVEL"]),
        sandbox_id=parse_sandbox_id(raw["OPENSANDBOX_EGRESS_SANDBOX_ID"]),
        metrics_extra_attrs=parse_extra_attrs(raw["OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS"] or ""),
    )


def _deny_webhook(raw: Raw) -> str | None:
    """docs/reference/behaviour.md §15: the deny webhook (its URL may carry a token: never echoed)."""
    try:
        return parse_webhook_url(raw["OPENSANDBOX_EGRESS_DENY_WEBHOOK"])
    except WebhookURLError as exc:
        raise ConfigError(f"OPENSANDBOX_EGRESS_DENY_WEBHOOK: {exc}") from None


def parse_log_level(value: str | None) -> int:
    """The reference's zap levels (``warning`` too); case-insensitive; unset/empty = info."""
    text = (value or "").strip().lower() or "info"
    if text not in _LOG_LEVELS:
        raise ConfigError(
            f"OPENSANDBOX_EGRESS_LOG_LEVEL: expected debug, info, warn, error or fatal, got {value!r}"
        )
    return _LOG_LEVELS[text]


def parse_sandbox_id(value: str | None) -> str | None:
    """Trimmed like the reference; empty = unset. It lands in every log line and metric."""
    text = (value or "").strip()
    if not text:
        return None
    check_printable("OPENSANDBOX_EGRESS_SANDBOX_ID", text, 256)
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
        check_printable(name, val, 256)
        labels.add(label)
        out.append((key, val))
    return tuple(out)


def ignored_settings(mitm: MitmConfig, vault: VaultConfig) -> list[str]:
    """Parity settings that have no effect with the rest of the configuration (logged at
    start-up, so nothing is ignored silently). None of them weakens enforcement by being
    ignored. (An option of the other profile is refused instead: egressd.config.)"""
    notes = []
    if mitm.extra_ports and not mitm.transparent:
        notes.append(
            "OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS: the MITM is off (OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT)"
        )
    if vault.trusted_proxies and not vault.require_tls:
        notes.append(
            "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS: only read with "
            "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS on"
        )
    return notes
