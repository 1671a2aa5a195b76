"""The instruments egressd exposes, held by prometheus_client (one CollectorRegistry per instance).

Label values are only ever operation names, states, codes, reasons, subject names and rule
labels chosen by the code, never request data (no names asked, no addresses), so nothing
sensitive can reach /metrics.

prometheus_client stores the values (thread-safe children per label set, exemplars, bucket
counts); each instrument here is a custom collector around one of them, so that samples computed
at scrape time (kernel counters, registry states) join the family the code counts into.

Two renderings: Prometheus text 0.0.4 (the default) and, when the scraper asks for it,
OpenMetrics 1.0, which is the only one that can carry exemplars: a counter may remember the
labels of the last event it counted (egressd uses that for the audit decision id), shown as
``name_total{...} 3 # {decision_id="0a1b2c3d4e5f"} 1 <unix time>``. The text is written here
rather than by prometheus_client's ``generate_latest``: that one sorts label names and prints
every value as a float (``1.0``, ``le="1.0"``), which would change the lines scrapers, alerts and
the tests already match (label order as declared, integers as integers, millisecond exemplar
times); ``_created`` samples, which egressd never exposed, are left out for the same reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import prometheus_client
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import CollectorRegistry
from prometheus_client.samples import Exemplar, Sample

from egressd.metriclabels import with_constant_labels

OPENMETRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST  # "application/openmetrics-text; version=1.0.0; ..."
_EXEMPLAR_MAX_CHARS = 128  # OpenMetrics: label names + values of one exemplar together

_DEFAULT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# Scrape-time samples: label values (in the instrument's label order) -> value.
Scraped = dict[tuple[str, ...], float]
Samples = Callable[[], Scraped]
_Native = prometheus_client.Counter | prometheus_client.Gauge | prometheus_client.Histogram


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v == int(v):
        return str(int(v))
    return repr(v)


def _fmt_labels(labels: Mapping[str, str]) -> str:
    # prometheus_client reports bucket bounds as "1.0"; egressd has always printed le="1".
    parts = [f'{k}="{_num(float(v)) if k == "le" else _escape(v)}"' for k, v in labels.items()]
    return "{" + ",".join(parts) + "}" if parts else ""


def _fit_exemplar(labels: Mapping[str, str] | None) -> dict[str, str] | None:
    """The exemplar's labels, dropping trailing ones that would exceed 128 characters.

    prometheus_client refuses a longer exemplar with ValueError; a counted event must not fail
    because the subject name it remembers is long.
    """
    if labels is None:
        return None
    fitted: dict[str, str] = {}
    used = 0
    for k, v in labels.items():
        used += len(k) + len(v)
        if used > _EXEMPLAR_MAX_CHARS:
            break
        fitted[k] = v
    return fitted


def _fmt_exemplar(ex: Exemplar) -> str:
    parts = ",".join(f'{k}="{_escape(v)}"' for k, v in ex.labels.items())
    ts = f" {float(ex.timestamp):.3f}" if ex.timestamp is not None else ""
    return f" # {{{parts}}} {_num(ex.value)}{ts}"


def render(registry: CollectorRegistry, openmetrics: bool = False) -> str:
    lines: list[str] = []
    for family in registry.collect():
        name = family.name  # prometheus_client names a counter family without "_total", as OpenMetrics does
        if family.type == "counter" and not openmetrics:
            name += "_total"
        lines += [f"# HELP {name} {family.documentation}", f"# TYPE {name} {family.type}"]
        for s in family.samples:
            line = f"{s.name}{_fmt_labels(s.labels)} {_num(s.value)}"
            if openmetrics and s.exemplar is not None:
                line += _fmt_exemplar(s.exemplar)
            lines.append(line)
    if openmetrics:
        lines.append("# EOF")
    return "\n".join(lines) + "\n"


_Stored = dict[tuple[str, ...], Sample]


class _Instrument:
    """One metric family in a registry: a prometheus_client metric plus optional scrape-time samples.

    Series come out sorted by label values, and without prometheus_client's ``_created``
    samples, as egressd has always rendered them.
    """

    def __init__(
        self, registry: CollectorRegistry, native: _Native, labels: Sequence[str], collect: Samples | None
    ) -> None:
        self.labels = tuple(labels)
        self._native = native
        self._collect = collect
        registry.register(self)

    def collect_from(self, collect: Samples) -> None:
        """Samples computed at scrape time (e.g. kernel counters); the subclass says how they join."""
        self._collect = collect

    def describe(self) -> Iterable[Metric]:
        # Lets the registry refuse a duplicate name without taking a scrape.
        return self._native.describe()

    def collect(self) -> Iterable[Metric]:
        (family,) = self._native.collect()
        family.samples = self._samples(family, self._collect() if self._collect is not None else None)
        return [family]

    def _samples(self, family: Metric, scraped: Scraped | None) -> list[Sample]:
        raise NotImplementedError

    def _key(self, sample: Sample) -> tuple[str, ...]:
        return tuple(sample.labels[n] for n in self.labels)

    def _stored(self, family: Metric, suffix: str = "") -> _Stored:
        return {self._key(s): s for s in family.samples if s.name == family.name + suffix}

    def _series(
        self, name: str, values: dict[tuple[str, ...], tuple[float, Exemplar | None]]
    ) -> list[Sample]:
        if not values and not self.labels:
            values = {(): (0.0, None)}
        return [
            Sample(name, dict(zip(self.labels, key, strict=True)), v, None, ex)
            for key, (v, ex) in sorted(values.items())
        ]


class Counter(_Instrument):
    def __init__(
        self,
        registry: CollectorRegistry,
        name: str,
        help_: str,
        labels: Sequence[str] = (),
        collect: Samples | None = None,
    ) -> None:
        self._counter = prometheus_client.Counter(name, help_, labels, registry=None)
        super().__init__(registry, self._counter, labels, collect)

    def inc(self, *labels: str, amount: float = 1.0, exemplar: Mapping[str, str] | None = None) -> None:
        child = self._counter.labels(*labels) if labels else self._counter
        child.inc(amount, exemplar=_fit_exemplar(exemplar))

    def value(self, *labels: str) -> float:
        """What the code counted (without the scrape-time samples)."""
        got = self._counted().get(labels)
        return got.value if got is not None else 0.0

    def exemplar(self, *labels: str) -> dict[str, str] | None:
        got = self._counted().get(labels)
        return dict(got.exemplar.labels) if got is not None and got.exemplar is not None else None

    def forget(self, keep: Callable[[tuple[str, ...]], bool]) -> None:
        """Drop the series ``keep`` refuses (a removed subject's), bounding label cardinality."""
        if not self.labels:
            return
        for key in [k for k in self._counted() if not keep(k)]:
            self._counter.remove(*key)

    def _counted(self) -> _Stored:
        (family,) = self._counter.collect()
        return self._stored(family, "_total")

    def _samples(self, family: Metric, scraped: Scraped | None) -> list[Sample]:
        # Scrape-time samples add to the stored ones of the same labels (audit mode: the DNS
        # layer is counted here, the IP layer read from the kernel).
        values = {k: (s.value, s.exemplar) for k, s in self._stored(family, "_total").items()}
        for key, v in (scraped or {}).items():
            old, ex = values.get(key, (0.0, None))
            values[key] = (old + v, ex)
        return self._series(family.name + "_total", values)


class Gauge(_Instrument):
    def __init__(
        self,
        registry: CollectorRegistry,
        name: str,
        help_: str,
        labels: Sequence[str] = (),
        collect: Samples | None = None,
    ) -> None:
        self._gauge = prometheus_client.Gauge(name, help_, labels, registry=None)
        super().__init__(registry, self._gauge, labels, collect)

    def set(self, value: float, *labels: str) -> None:
        (self._gauge.labels(*labels) if labels else self._gauge).set(value)

    def _samples(self, family: Metric, scraped: Scraped | None) -> list[Sample]:
        # A gauge computed at scrape time replaces what was stored.
        if scraped is None:
            scraped = {k: s.value for k, s in self._stored(family).items()}
        return self._series(family.name, {k: (v, None) for k, v in scraped.items()})


_HISTOGRAM_ORDER = ("_bucket", "_sum", "_count")


class Histogram(_Instrument):
    def __init__(
        self,
        registry: CollectorRegistry,
        name: str,
        help_: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = _DEFAULT_BUCKETS,
    ) -> None:
        self._histogram = prometheus_client.Histogram(name, help_, labels, registry=None, buckets=buckets)
        super().__init__(registry, self._histogram, labels, None)

    def observe(self, value: float, *labels: str) -> None:
        (self._histogram.labels(*labels) if labels else self._histogram).observe(value)

    def _samples(self, family: Metric, scraped: Scraped | None) -> list[Sample]:
        # Per series: the buckets in bound order (sorted() is stable), then _sum, then _count.
        rank = {family.name + suffix: i for i, suffix in enumerate(_HISTOGRAM_ORDER)}
        kept = [s for s in family.samples if s.name in rank]
        return sorted(kept, key=lambda s: (self._key(s), rank[s.name]))


class EgressMetrics:
    """The instruments egressd exposes (docs/reference/behaviour.md §12 plus egressd's own)."""

    def __init__(self, subjects_by_state: Samples | None = None) -> None:
        self.registry = CollectorRegistry()
        # OPENSANDBOX_EGRESS_SANDBOX_ID / ..._METRICS_EXTRA_ATTRS: on every sample (render()).
        self.constant_labels: tuple[tuple[str, str], ...] = ()
        # Registered (and so rendered) in this order: control plane and kernel, DNS and policy,
        # MITM, visibility.
        self._control_plane(subjects_by_state)
        self._dns_and_policy()
        self._mitm()
        self._visibility()

    def _control_plane(self, subjects_by_state: Samples | None) -> None:
        r = self.registry
        self.subjects = Gauge(
            r, "egressd_subjects", "Registered subjects by state.", ["state"], subjects_by_state
        )
        self.actions = Counter(
            r,
            "egressd_actions_total",
            "Fastlet actions by operation and HTTP status code.",
            ["operation", "code"],
        )
        self.nft_updates = Counter(
            r, "egress_nftables_updates_total", "nftables transactions applied.", ["operation"]
        )
        self.nft_failures = Counter(
            r, "egress_nftables_updates_failed_total", "nftables transactions that failed.", ["operation"]
        )
        self.nft_latency = Histogram(
            r, "egressd_nft_transaction_duration_seconds", "nftables transaction latency.", ["operation"]
        )
        self.nft_rules = Gauge(r, "egress_nftables_rules_count", "Per-subject nftables rules installed.")
        self.transitions = Counter(
            r, "egressd_subject_transitions_total", "Subject state transitions.", ["from", "to"]
        )
        self.pending_pushes = Gauge(r, "egressd_pending_pushes", "Credential pushes cached for unknown UIDs.")
        # docs/reference/behaviour.md §14.6: subjects whose narrowing the kernel refused and egressd is retrying.
        self.revocations_pending = Gauge(
            r,
            "egressd_revocations_pending",
            "Subjects whose revocation the kernel refused; egressd retries until it agrees.",
        )

    def _dns_and_policy(self) -> None:
        r = self.registry
        # Exemplar: the last denial's decision_id, subject and rule (OpenMetrics only).
        self.policy_denied = Counter(r, "egress_policy_denied_total", "Denied DNS queries.")
        # Audit mode: DNS queries (layer="dns", rule = the deciding rule's label), HTTP requests
        # (layer="request", §19) and new flows
        # (layer="ip", rule "egress-deny" or "default", read from the kernel's per-subject
        # counters at scrape time) that the policy would have denied but let pass.
        # Exemplar of the dns series: the last decision_id.
        self.would_deny = Counter(
            r,
            "egressd_policy_would_deny_total",
            "Audit mode: DNS queries, new flows and HTTP requests the policy would deny, passed.",
            ["subject", "layer", "rule"],
        )
        self.dns_latency = Histogram(r, "egress_dns_query_duration_seconds", "DNS proxy query handling time.")
        self.dns_failed = Counter(
            r, "egress_dns_query_failed_total", "DNS queries answered SERVFAIL, by reason.", ["reason"]
        )
        # docs/reference/behaviour.md §14.3: queries REFUSED because the asker was over EGRESSD_DNS_QPS_PER_SUBJECT.
        # subject = s-<uid>, or "-" for every unknown source together (bounded cardinality).
        # Exemplar: the last decision_id (the same as in the log line and the EDE text).
        self.dns_rate_limited = Counter(
            r,
            "egressd_dns_rate_limited_total",
            "DNS queries refused (not forwarded) over the per-subject query budget.",
            ["subject"],
        )

    def _mitm(self) -> None:
        r = self.registry
        # The transparent MITM child (docs/reference/behaviour.md §10), counted from the addon's decision events.
        # Every series carries the worker index (EGRESSD_MITM_WORKERS; the sidecar: always "0").
        self.mitm_ready = Gauge(
            r, "egressd_mitm_ready", "1 when the MITM worker child is listening.", ["worker"]
        )
        self.mitm_starts = Counter(
            r,
            "egressd_mitm_starts_total",
            "MITM worker child processes started (restarts included).",
            ["worker"],
        )
        self.mitm_requests = Counter(
            r,
            "egressd_mitm_requests_total",
            "Intercepted requests by outcome (injected, pass, refused, error).",
            ["worker", "outcome"],
        )
        # docs/reference/behaviour.md §16: redirected connections decrypted/parsed or relayed untouched.
        self.mitm_connections = Counter(
            r,
            "egressd_mitm_connections_total",
            "Connections the MITM child opened (decrypt, parse), relayed (passthrough) or refused by the "
            "name check (refuse); `protocol` is `tls`, `http`, or `tcp` (neither, or a silent client of a "
            "server-first protocol).",
            ["worker", "protocol", "decision"],
        )
        # docs/reference/behaviour.md §14.9: how many clients' vault snapshots the child holds (bounded; a removed,
        # rebound or vault-less subject's entry is dropped), as last reported by the child.
        self.mitm_cache_entries = Gauge(
            r,
            "egressd_mitm_snapshot_cache_entries",
            "Clients whose vault snapshot the MITM child holds in its cache.",
            ["worker"],
        )


    def _visibility(self) -> None:
        r = self.registry
        # docs/reference/behaviour.md §15: packets egressd's rules refused, read from the kernel's per-subject
        # counters at scrape time (one dump); subject "-" = sources that are no subject. Plus the
        # MITM's name-check refusals (§18: one per refused connection or request), kept in memory.
        self.subject_dropped = Counter(
            r,
            "egressd_subject_dropped_packets_total",
            "Packets egressd's nft rules refused, plus connections and requests the MITM's name check "
            "refused, by source subject.",
            ["subject"],
        )
        # OPENSANDBOX_EGRESS_DENY_WEBHOOK: events that found the queue full, and how the others ended.
        self.deny_webhook_dropped = Counter(
            r, "egressd_deny_webhook_dropped_total", "Deny webhook events dropped: queue full."
        )
        self.deny_webhook_deliveries = Counter(
            r,
            "egressd_deny_webhook_deliveries_total",
            "Deny webhook events by outcome (delivered, rejected, failed).",
            ["result"],
        )

    def render(self, openmetrics: bool = False) -> str:
        return with_constant_labels(render(self.registry, openmetrics), self.constant_labels)
