"""A small Prometheus text-exposition registry (counters, gauges, histograms with labels).

Label values are only ever operation names, states, codes, reasons, subject names and rule
labels chosen by the code, never request data (no names asked, no addresses), so nothing
sensitive can reach /metrics.

Two renderings: Prometheus text 0.0.4 (the default) and, when the scraper asks for it,
OpenMetrics 1.0, which is the only one that can carry exemplars: a counter may remember the
labels of the last event it counted (egressd uses that for the audit decision id), shown as
``name_total{...} 3 # {decision_id="0a1b2c3d4e5f"} 1.0 <unix time>``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence

OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_EXEMPLAR_MAX_CHARS = 128  # OpenMetrics: label names + values of one exemplar together

_DEFAULT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _fmt_labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v == int(v):
        return str(int(v))
    return repr(v)


class _Metric:
    kind = ""

    def __init__(self, name: str, help_: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_
        self.labels = tuple(labels)
        self._lock = threading.Lock()

    def render(self, openmetrics: bool = False) -> list[str]:
        family = self.name
        if openmetrics and self.kind == "counter" and family.endswith("_total"):
            family = family[: -len("_total")]  # OpenMetrics names the family without the suffix
        return [
            f"# HELP {family} {self.help}",
            f"# TYPE {family} {self.kind}",
            *self._samples(openmetrics),
        ]

    def _samples(self, openmetrics: bool) -> list[str]:
        raise NotImplementedError


def _exemplar(labels: Mapping[str, str], value: float, ts: float) -> str:
    """`` # {k="v",...} value ts``, dropping trailing labels that would exceed 128 characters."""
    parts: list[str] = []
    used = 0
    for k, v in labels.items():
        used += len(k) + len(v)
        if used > _EXEMPLAR_MAX_CHARS:
            break
        parts.append(f'{k}="{_escape(v)}"')
    return f" # {{{','.join(parts)}}} {_num(value)} {ts:.3f}"


class Counter(_Metric):
    kind = "counter"

    def __init__(
        self,
        name: str,
        help_: str,
        labels: Sequence[str] = (),
        collect: Callable[[], dict[tuple[str, ...], float]] | None = None,
    ) -> None:
        super().__init__(name, help_, labels)
        self._values: dict[tuple[str, ...], float] = {}
        self._exemplars: dict[tuple[str, ...], tuple[dict[str, str], float, float]] = {}
        self._collect = collect

    def collect_from(self, collect: Callable[[], dict[tuple[str, ...], float]]) -> None:
        """Extra samples computed at scrape time (e.g. kernel counters), next to the stored ones."""
        self._collect = collect

    def inc(self, *labels: str, amount: float = 1.0, exemplar: Mapping[str, str] | None = None) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount
            if exemplar is not None:
                self._exemplars[labels] = (dict(exemplar), amount, time.time())

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def exemplar(self, *labels: str) -> dict[str, str] | None:
        got = self._exemplars.get(labels)
        return dict(got[0]) if got is not None else None

    def forget(self, keep: Callable[[tuple[str, ...]], bool]) -> None:
        """Drop the series ``keep`` refuses (a removed subject's), bounding label cardinality."""
        with self._lock:
            for key in [k for k in self._values if not keep(k)]:
                del self._values[key]
                self._exemplars.pop(key, None)

    def _samples(self, openmetrics: bool) -> list[str]:
        with self._lock:
            values = dict(self._values)
            exemplars = dict(self._exemplars)
        if self._collect is not None:
            for key, v in self._collect().items():
                values[key] = values.get(key, 0.0) + v
        items = sorted(values.items())
        if not items and not self.labels:
            items = [((), 0.0)]
        out = []
        for k, v in items:
            line = f"{self.name}{_fmt_labels(self.labels, k)} {_num(v)}"
            ex = exemplars.get(k) if openmetrics else None
            if ex is not None:
                line += _exemplar(*ex)
            out.append(line)
        return out


class Gauge(_Metric):
    kind = "gauge"

    def __init__(
        self,
        name: str,
        help_: str,
        labels: Sequence[str] = (),
        collect: Callable[[], dict[tuple[str, ...], float]] | None = None,
    ) -> None:
        super().__init__(name, help_, labels)
        self._values: dict[tuple[str, ...], float] = {}
        self._collect = collect

    def collect_from(self, collect: Callable[[], dict[tuple[str, ...], float]]) -> None:
        """Compute the samples at scrape time instead of storing them."""
        self._collect = collect

    def set(self, value: float, *labels: str) -> None:
        with self._lock:
            self._values[labels] = value

    def _samples(self, openmetrics: bool) -> list[str]:
        if self._collect is not None:
            items = sorted(self._collect().items())
        else:
            with self._lock:
                items = sorted(self._values.items())
        if not items and not self.labels:
            items = [((), 0.0)]
        return [f"{self.name}{_fmt_labels(self.labels, k)} {_num(v)}" for k, v in items]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self, name: str, help_: str, labels: Sequence[str] = (), buckets: Sequence[float] = _DEFAULT_BUCKETS
    ) -> None:
        super().__init__(name, help_, labels)
        self.buckets = tuple(sorted(buckets))
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, value: float, *labels: str) -> None:
        with self._lock:
            counts, sums = self._series.setdefault(labels, ([0] * (len(self.buckets) + 1), [0.0]))
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    counts[i] += 1
            counts[-1] += 1
            sums[0] += value

    def _samples(self, openmetrics: bool) -> list[str]:
        with self._lock:
            series = sorted((k, (list(c), s[0])) for k, (c, s) in self._series.items())
        if not series and not self.labels:
            series = [((), ([0] * (len(self.buckets) + 1), 0.0))]
        out: list[str] = []
        for key, (counts, total) in series:
            for bound, count in zip((*self.buckets, math.inf), counts, strict=True):
                le = 'le="' + _num(bound) + '"'
                out.append(f"{self.name}_bucket{_fmt_labels(self.labels, key, le)} {count}")
            out.append(f"{self.name}_sum{_fmt_labels(self.labels, key)} {_num(total)}")
            out.append(f"{self.name}_count{_fmt_labels(self.labels, key)} {counts[-1]}")
        return out


class Registry:
    def __init__(self) -> None:
        self._metrics: list[_Metric] = []

    def register[M: _Metric](self, metric: M) -> M:
        self._metrics.append(metric)
        return metric

    def render(self, openmetrics: bool = False) -> str:
        lines: list[str] = []
        for m in self._metrics:
            lines.extend(m.render(openmetrics))
        if openmetrics:
            lines.append("# EOF")
        return "\n".join(lines) + "\n"


class EgressMetrics:
    """The instruments egressd exposes (BEHAVIOUR.md §12 plus egressd's own)."""

    def __init__(self, subjects_by_state: Callable[[], dict[tuple[str, ...], float]] | None = None) -> None:
        r = self.registry = Registry()
        self.subjects = r.register(
            Gauge("egressd_subjects", "Registered subjects by state.", ["state"], collect=subjects_by_state)
        )
        self.actions = r.register(
            Counter(
                "egressd_actions_total",
                "Fastlet actions by operation and HTTP status code.",
                ["operation", "code"],
            )
        )
        self.nft_updates = r.register(
            Counter("egress_nftables_updates_total", "nftables transactions applied.", ["operation"])
        )
        self.nft_failures = r.register(
            Counter(
                "egress_nftables_updates_failed_total", "nftables transactions that failed.", ["operation"]
            )
        )
        self.nft_latency = r.register(
            Histogram(
                "egressd_nft_transaction_duration_seconds", "nftables transaction latency.", ["operation"]
            )
        )
        self.nft_rules = r.register(
            Gauge("egress_nftables_rules_count", "Per-subject nftables rules installed.")
        )
        self.transitions = r.register(
            Counter("egressd_subject_transitions_total", "Subject state transitions.", ["from", "to"])
        )
        self.pending_pushes = r.register(
            Gauge("egressd_pending_pushes", "Credential pushes cached for unknown UIDs.")
        )
        # BEHAVIOUR 14.6: subjects whose narrowing the kernel refused and egressd is retrying.
        self.revocations_pending = r.register(
            Gauge(
                "egressd_revocations_pending",
                "Subjects whose revocation the kernel refused; egressd retries until it agrees.",
            )
        )
        # Exemplar: the last denial's decision_id, subject and rule (OpenMetrics only).
        self.policy_denied = r.register(Counter("egress_policy_denied_total", "Denied DNS queries."))
        # Audit mode: DNS queries (layer="dns", rule = the deciding rule's label) and new flows
        # (layer="ip", rule "egress-deny" or "default", read from the kernel's per-subject
        # counters at scrape time) that the policy would have denied but let pass.
        # Exemplar of the dns series: the last decision_id.
        self.would_deny = r.register(
            Counter(
                "egressd_policy_would_deny_total",
                "Audit mode: DNS queries and new flows the policy would deny, passed.",
                ["subject", "layer", "rule"],
            )
        )
        self.dns_latency = r.register(
            Histogram("egress_dns_query_duration_seconds", "DNS proxy query handling time.")
        )
        self.dns_failed = r.register(
            Counter("egress_dns_query_failed_total", "DNS queries answered SERVFAIL, by reason.", ["reason"])
        )
        # BEHAVIOUR 14.3: queries REFUSED because the asker was over EGRESSD_DNS_QPS_PER_SUBJECT.
        # subject = s-<uid>, or "-" for every unknown source together (bounded cardinality).
        # Exemplar: the last decision_id (the same as in the log line and the EDE text).
        self.dns_rate_limited = r.register(
            Counter(
                "egressd_dns_rate_limited_total",
                "DNS queries refused (not forwarded) over the per-subject query budget.",
                ["subject"],
            )
        )
        # The transparent MITM child (BEHAVIOUR §10), counted from the addon's decision events.
        self.mitm_ready = r.register(Gauge("egressd_mitm_ready", "1 when the MITM child is listening."))
        self.mitm_starts = r.register(
            Counter("egressd_mitm_starts_total", "MITM child processes started (restarts included).")
        )
        self.mitm_requests = r.register(
            Counter(
                "egressd_mitm_requests_total",
                "Intercepted requests by outcome (injected, pass, refused, error).",
                ["outcome"],
            )
        )
        # BEHAVIOUR 14.9: how many clients' vault snapshots the child holds (bounded; a removed,
        # rebound or vault-less subject's entry is dropped), as last reported by the child.
        self.mitm_cache_entries = r.register(
            Gauge(
                "egressd_mitm_snapshot_cache_entries",
                "Clients whose vault snapshot the MITM child holds in its cache.",
            )
        )

        # BEHAVIOUR §15: packets egressd's rules refused, read from the kernel's per-subject
        # counters at scrape time (one dump); subject "-" = sources that are no subject.
        self.subject_dropped = r.register(
            Counter(
                "egressd_subject_dropped_packets_total",
                "Packets egressd's nft rules refused, by source subject.",
                ["subject"],
            )
        )
        # OPENSANDBOX_EGRESS_DENY_WEBHOOK: events that found the queue full, and how the others ended.
        self.deny_webhook_dropped = r.register(
            Counter("egressd_deny_webhook_dropped_total", "Deny webhook events dropped: queue full.")
        )
        self.deny_webhook_deliveries = r.register(
            Counter(
                "egressd_deny_webhook_deliveries_total",
                "Deny webhook events by outcome (delivered, rejected, failed).",
                ["result"],
            )
        )

    def render(self, openmetrics: bool = False) -> str:
        return self.registry.render(openmetrics)
