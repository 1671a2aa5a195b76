"""The name check's two sides (docs/reference/behaviour.md §18): egressd's ``GET /_names``
(:mod:`egressd.mitm.names`: the query, the answer, the report of a refusal) and the child's
reading of the reply (:mod:`egressd.mitmchild.names`: anything but a well-formed 200 refuses)."""

from __future__ import annotations

import ipaddress
import json
import math
from typing import Any

import pytest

from egressd.engine.backend import Refusals
from egressd.engine.refusals import with_extra
from egressd.mitm.active import active_app
from egressd.mitm.names import (
    NameQuery,
    NameRefusals,
    NameReport,
    NameService,
    answer,
    parse_query,
    parse_refused,
    record_refused,
    remember_for,
)
from egressd.mitm.protocol import NAMES_PATH
from egressd.mitmchild.names import LOOKUP_FAILED, NameAnswer, Remembered, as_name, interpret
from egressd.policy.namecheck import NameReason, NameVerdict, Wire

DST = ipaddress.ip_address("203.0.113.10")
CLIENT = ipaddress.ip_address("10.203.0.11")
GOOD = {"clientIp": "10.203.0.11", "wire": "tls", "name": "a.io", "dst": "203.0.113.10", "dport": "443"}


def query(**over: object) -> NameQuery:
    fields: dict[str, Any] = dict(client=CLIENT, listen_port=None, wire=Wire.TLS, name="b.io", dst=DST, port=443)
    fields.update(over)
    return NameQuery(**fields)


# ---- the query -----------------------------------------------------------------------------------


def test_a_query_is_parsed() -> None:
    assert parse_query(GOOD) == NameQuery(CLIENT, None, Wire.TLS, "a.io", DST, 443)
    assert parse_query({**GOOD, "port": "16001"}) == NameQuery(CLIENT, 16001, Wire.TLS, "a.io", DST, 443)
    without = {k: v for k, v in GOOD.items() if k != "name"}
    assert parse_query(without) == NameQuery(CLIENT, None, Wire.TLS, None, DST, 443)
    assert parse_query({**GOOD, "clientIp": "::ffff:10.203.0.11"}) == parse_query(GOOD)


@pytest.mark.parametrize(
    "bad",
    [
        {"clientIp": "nope"},
        {"clientIp": ""},
        {"dst": "x"},
        {"dport": "0"},
        {"dport": "65536"},
        {"dport": "+443"},
        {"wire": "quic"},
        {"port": "abc"},
    ],
)
def test_a_malformed_query_is_refused(bad: dict[str, str]) -> None:
    assert parse_query({**GOOD, **bad}) is None


@pytest.mark.parametrize("name", ["a" * 254, "é.io"])
def test_a_name_that_is_no_dns_name_is_a_query_marked_unreadable(name: str) -> None:
    query = parse_query({**GOOD, "name": name})
    assert query is not None and query.unreadable and query.name is not None and len(query.name) <= 253


# ---- the answer ----------------------------------------------------------------------------------


def test_no_active_subject_is_refused() -> None:
    verdict = answer(lambda q: (None, None), None, query())
    assert not verdict.admit and verdict.reason is NameReason.SNI_NOT_ALLOWED
    assert answer(lambda q: (None, None), None, query(name=None)).reason is NameReason.NO_SNI
    assert answer(lambda q: (None, None), None, query(wire=Wire.HTTP)).reason is NameReason.HOST_NOT_ALLOWED


def test_a_check_that_raises_refuses() -> None:
    def boom(q: NameQuery) -> tuple[str | None, NameVerdict | None]:
        raise RuntimeError("x")

    assert not answer(boom, None, query()).admit


def test_a_refusal_is_counted_reported_and_logged_once() -> None:
    denied: list[tuple[str, str, str]] = []
    report = NameReport(NameRefusals(), lambda uid, name, rule, port: denied.append((uid, name, rule)))
    refuse = NameVerdict(False, NameReason.SNI_NOT_ALLOWED, "default")
    answer(lambda q: ("u1", refuse), report, query())
    answer(lambda q: ("u1", refuse), report, query(name=None))
    answer(lambda q: ("u1", NameVerdict(True)), report, query())
    would = NameVerdict(True, NameReason.SNI_NOT_LEARNED, "egress[0]", would_deny=True)
    answer(lambda q: ("u1", would), report, query())
    assert report.refusals.of("u1") == 2
    assert denied == [("u1", "b.io", "default"), ("u1", str(DST), "default")]
    report.forget("u1")
    assert report.refusals.of("u1") == 0


def test_the_log_is_rate_limited_per_subject() -> None:
    report = NameReport(NameRefusals(), clock=lambda: 100.0)
    refuse = NameVerdict(False, NameReason.SNI_NOT_ALLOWED)
    for _ in range(50):
        report(query(), "u1", refuse)
    assert report.refusals.of("u1") == 50  # every refusal counts, whatever is logged
    assert report._window["u1"][2] == 30


def test_refusals_outside_the_kernel_join_the_exported_count() -> None:
    kernel = Refusals({"a": 3, "b": 1}, unattributed=7)
    merged = with_extra(kernel, {"a": 2, "c": 5})
    assert merged.by_subject == {"a": 5, "b": 1, "c": 5} and merged.unattributed == 7
    assert with_extra(kernel, {}) is kernel


async def test_the_route_answers(aiohttp_client: Any) -> None:
    seen: list[NameQuery] = []

    def check(q: NameQuery) -> tuple[str | None, NameVerdict | None]:
        seen.append(q)
        if q.name == "a.io":
            return "u1", NameVerdict(True)
        return "u1", NameVerdict(False, NameReason.SNI_NOT_LEARNED)

    client = await aiohttp_client(active_app(lambda ip: None, names=NameService(check)))
    resp = await client.get(NAMES_PATH, params=GOOD)
    assert resp.status == 200 and json.loads(await resp.read()) == {"admit": True, "reason": None}
    resp = await client.get(NAMES_PATH, params={**GOOD, "name": "w.io"})
    assert json.loads(await resp.read()) == {"admit": False, "reason": "sni_not_learned"}
    assert (await client.get(NAMES_PATH, params={**GOOD, "dport": "x"})).status == 400
    assert (await client.post(NAMES_PATH, params=GOOD)).status == 405
    assert [q.name for q in seen] == ["a.io", "w.io"]
    # Without a name service (EGRESSD_NAME_CHECK=off), there is no such route.
    client = await aiohttp_client(active_app(lambda ip: None))
    assert (await client.get(NAMES_PATH, params=GOOD)).status == 404


# ---- the child's reading -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (200, b'{"admit": true, "reason": null}', NameAnswer(True, None)),
        (200, b'{"admit": false, "reason": "no_sni"}', NameAnswer(False, "no_sni")),
        (200, b'{"admit": false}', NameAnswer(False, LOOKUP_FAILED)),
        (200, b'{"admit": "yes"}', NameAnswer(False, LOOKUP_FAILED)),
        (200, b"[]", NameAnswer(False, LOOKUP_FAILED)),
        (200, b"not json", NameAnswer(False, LOOKUP_FAILED)),
        (404, b'{"admit": true}', NameAnswer(False, LOOKUP_FAILED)),
        (500, b"", NameAnswer(False, LOOKUP_FAILED)),
    ],
)
def test_the_child_admits_only_on_a_well_formed_yes(status: int, body: bytes, expected: NameAnswer) -> None:
    assert interpret(status, body) == expected


# ---- answered from memory --------------------------------------------------------------------------


def test_the_reply_says_how_long_an_admission_may_be_remembered() -> None:
    assert remember_for(NameVerdict(True, until=110.0), 100.0) == 10.0
    assert remember_for(NameVerdict(True, until=math.inf), 100.0) == 300.0
    assert remember_for(NameVerdict(True, until=0.0), 100.0) is None
    assert remember_for(NameVerdict(False, NameReason.NO_SNI, until=math.inf), 100.0) is None
    assert remember_for(NameVerdict(True, NameReason.NO_SNI, would_deny=True, until=math.inf), 100.0) is None
    assert interpret(200, b'{"admit": true, "reason": null, "ttl": 12.5}') == NameAnswer(True, None, 12.5)
    assert interpret(200, b'{"admit": true, "ttl": 1e9}').ttl == 300.0
    assert interpret(200, b'{"admit": true, "ttl": -1}').ttl is None
    assert interpret(200, b'{"admit": true, "ttl": true}').ttl is None


def test_an_admission_is_remembered_only_under_its_stamp_and_until_its_lease_ends() -> None:
    memory = Remembered(max_entries=2)
    key = ("10.203.0.11", "tls", "a.io", "203.0.113.10", 443)
    memory.learn(key, NameAnswer(True, None, 10.0), (1, 1), 100.0)
    assert memory.recall(key, (1, 1), 105.0)
    assert not memory.recall(key, (1, 2), 105.0)  # a narrowing since
    assert not memory.recall(key, (1, 1), 110.0)  # the lease ended
    assert not memory.recall(key, None, 105.0)  # egressd silent: ask
    memory.learn(key, NameAnswer(False, "sni_not_learned"), (1, 1), 100.0)
    memory.learn(("x", "tls", "b.io", "d", 443), NameAnswer(True, None), (1, 1), 100.0)  # no ttl: not kept
    assert len(memory.entries) == 1
    for i in range(3):
        memory.learn((str(i), "tls", "", "d", 443), NameAnswer(True, None, 5.0), (1, 1), 100.0)
    assert len(memory.entries) == 2


def test_an_address_names_no_name() -> None:
    assert as_name("a.io") == "a.io"
    assert as_name("10.204.0.3") is None and as_name("[2001:db8::1]") is None and as_name("2001:db8::1") is None
    assert as_name("") is None and as_name(None) is None


def test_a_nameless_tcp_query_is_parsed_and_a_tcp_query_with_a_name_is_malformed() -> None:
    without = {k: v for k, v in GOOD.items() if k != "name"}
    assert parse_query({**without, "wire": "tcp"}) == NameQuery(CLIENT, None, Wire.TCP, None, DST, 443)
    assert parse_query({**GOOD, "wire": "tcp"}) is None
    refused = answer(lambda q: (None, None), None, query(wire=Wire.TCP, name=None))
    assert not refused.admit and refused.reason is NameReason.NO_SNI


async def test_a_question_asked_without_report_is_answered_and_not_reported(aiohttp_client: Any) -> None:
    """report=0 (a silent client's "would no name do?", §18): the same verdict, no count,
    no webhook post."""
    denied: list[str] = []
    report = NameReport(NameRefusals(), lambda uid, name, rule, port: denied.append(name))

    def check(q: NameQuery) -> tuple[str | None, NameVerdict | None]:
        return "u1", NameVerdict(False, NameReason.NO_SNI)

    client = await aiohttp_client(active_app(lambda ip: None, names=NameService(check, report)))
    without = {k: v for k, v in GOOD.items() if k != "name"}
    resp = await client.get(NAMES_PATH, params={**without, "wire": "tcp", "report": "0"})
    assert json.loads(await resp.read()) == {"admit": False, "reason": "no_sni"}
    assert report.refusals.of("u1") == 0 and denied == []
    await client.get(NAMES_PATH, params={**without, "wire": "tcp"})
    assert report.refusals.of("u1") == 1 and len(denied) == 1


# ---- refusals the child made from the first bytes (§18, "connections that carry no name") ------


async def test_a_first_bytes_refusal_is_reported_whatever_the_check_would_say(aiohttp_client: Any) -> None:
    """refused=no_sni|host_not_allowed: the child reset the connection already (bytes it could
    not read a name in); egressd attributes it to the subject and counts, logs and posts it even
    where a nameless connection would have been admitted."""
    denied: list[tuple[str, str, str, int]] = []
    report = NameReport(NameRefusals(), lambda uid, name, rule, port: denied.append((uid, name, rule, port)))

    def check(q: NameQuery) -> tuple[str | None, NameVerdict | None]:
        return "u1", NameVerdict(True, None, "address")

    client = await aiohttp_client(active_app(lambda ip: None, names=NameService(check, report)))
    without = {k: v for k, v in GOOD.items() if k != "name"}
    resp = await client.get(NAMES_PATH, params={**without, "refused": "no_sni"})
    assert json.loads(await resp.read()) == {"admit": False, "reason": "no_sni"}
    resp = await client.get(NAMES_PATH, params={**without, "wire": "http", "refused": "host_not_allowed"})
    assert json.loads(await resp.read()) == {"admit": False, "reason": "host_not_allowed"}
    assert report.refusals.of("u1") == 2
    assert denied == [("u1", str(DST), "first-bytes", 443)] * 2


@pytest.mark.parametrize("reason", ["sni_not_allowed", "port_not_allowed", "bogus", ""])
async def test_a_refused_report_with_another_reason_is_malformed(aiohttp_client: Any, reason: str) -> None:
    """Only the reasons the first bytes alone can give: a report is never a way to count a
    name egressd was not asked about."""
    report = NameReport(NameRefusals())
    client = await aiohttp_client(
        active_app(lambda ip: None, names=NameService(lambda q: ("u1", NameVerdict(True)), report))
    )
    resp = await client.get(NAMES_PATH, params={**GOOD, "refused": reason})
    assert resp.status == 400 and report.refusals.of("u1") == 0


def test_a_first_bytes_report_for_no_subject_counts_nothing() -> None:
    report = NameReport(NameRefusals())
    verdict = record_refused(lambda q: (None, None), report, query(name=None), NameReason.NO_SNI)
    assert not verdict.admit and verdict.rule == "first-bytes"
    assert report.refusals.by_uid() == {}
    with pytest.raises(ValueError):
        parse_refused("sni_not_learned")
    assert parse_refused(None) is None and parse_refused("no_sni") is NameReason.NO_SNI
