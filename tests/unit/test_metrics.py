"""egressd.metrics on prometheus_client: one registry per instance, scrape-time samples, and the
exposition lines egressd has always served (declared label order, integers, no _created)."""

from __future__ import annotations

import re

import pytest
from prometheus_client.registry import CollectorRegistry

from egressd.metrics import Counter, EgressMetrics, Gauge, render


def test_each_instance_has_its_own_registry() -> None:
    a, b = EgressMetrics(), EgressMetrics()
    assert isinstance(a.registry, CollectorRegistry) and a.registry is not b.registry
    a.actions.inc("SET_BINDING", "200")
    assert a.actions.value("SET_BINDING", "200") == 1
    assert b.actions.value("SET_BINDING", "200") == 0
    assert "SET_BINDING" not in b.render()


def test_a_duplicate_name_in_one_registry_is_refused() -> None:
    r = CollectorRegistry()
    Counter(r, "x_total", "x")
    with pytest.raises(ValueError, match="Duplicated"):
        Counter(r, "x_total", "again")


def test_lines_keep_declared_label_order_integers_and_no_created() -> None:
    m = EgressMetrics()
    m.transitions.inc("denying", "active")
    m.nft_latency.observe(0.7, "remove")
    text = m.render()
    assert 'egressd_subject_transitions_total{from="denying",to="active"} 1\n' in text
    assert 'egressd_nft_transaction_duration_seconds_bucket{operation="remove",le="1"} 1\n' in text
    assert "_created" not in text and "1.0" not in text
    # A histogram series: buckets, then _sum, then _count, as before.
    series = [ln.split("{")[0] for ln in text.splitlines() if ln.startswith("egressd_nft_transaction")]
    assert series[-2:] == [
        "egressd_nft_transaction_duration_seconds_sum",
        "egressd_nft_transaction_duration_seconds_count",
    ]
    om = m.render(openmetrics=True)
    assert "# TYPE egressd_subject_transitions counter" in om and "_created" not in om


def test_scrape_time_samples_are_read_on_every_scrape() -> None:
    calls: list[int] = []
    r = CollectorRegistry()
    g = Gauge(r, "g", "a gauge", ["state"])
    c = Counter(r, "c_total", "a counter", ["k"])

    def states() -> dict[tuple[str, ...], float]:
        calls.append(1)
        return {("b",): float(len(calls)), ("a",): 0.5}

    g.collect_from(states)
    c.inc("x", amount=2, exemplar={"decision_id": "d1"})
    c.collect_from(lambda: {("x",): 3.0, ("y",): 1.0})
    first, second = render(r), render(r)
    assert len(calls) == 2
    assert 'g{state="a"} 0.5\ng{state="b"} 1\n' in first and 'g{state="b"} 2\n' in second
    assert 'c_total{k="x"} 5\nc_total{k="y"} 1\n' in first
    assert c.value("x") == 2  # only what the code counted
    assert re.search(r'^c_total\{k="x"\} 5 # \{decision_id="d1"\} 2 \d+\.\d{3}$', render(r, True), re.M)


def test_forget_drops_series_and_their_exemplars() -> None:
    m = EgressMetrics()
    m.dns_rate_limited.inc("s-a", exemplar={"decision_id": "1"})
    m.dns_rate_limited.inc("s-b")
    m.dns_rate_limited.forget(lambda labels: labels[0] != "s-a")
    assert m.dns_rate_limited.value("s-a") == 0 and m.dns_rate_limited.exemplar("s-a") is None
    assert m.dns_rate_limited.value("s-b") == 1
    assert 's-a"' not in m.render(openmetrics=True)
