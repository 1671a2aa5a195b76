"""Findings of the attacker review of names on the wire (docs/reference/behaviour.md §18), each
the test that showed it, now passing: a name the check cannot read is refused and counted, never
"no name" and never an error; no upgrade but WebSocket reaches the upstream (after a 101 the MITM
relays raw TCP, unchecked). The QUIC finding is a kernel test (tests/kernel/test_names_bypass.py)."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

import pytest
from mitmproxy.test import tflow

from egressd.mitm.active import active_app
from egressd.mitm.names import NameQuery, NameRefusals, NameReport, NameService, answer, parse_query
from egressd.mitm.protocol import NAMES_PATH
from egressd.mitmchild.authority import normalise_authority
from egressd.mitmchild.intercept import sni_name
from egressd.mitmchild.names import as_name
from egressd.mitmchild.upgrades import OnlyWebSocketUpgrades
from egressd.policy.namecheck import NameReason, NameVerdict

CDN = ipaddress.ip_address("203.0.113.10")


async def test_a_refusal_of_a_254_char_name_is_counted(aiohttp_client: Any) -> None:
    # The child sends what its normalisation keeps: a 254-character name passes sni_name and
    # normalise_authority (mitmproxy accepts SNIs up to 255 bytes; a Host has no limit).
    long = ("a" * 63 + ".") * 3 + "b" * 61 + ".cdn.test"
    assert len(long) > 253
    assert sni_name(long) == long and normalise_authority(long) == (long, None) and as_name(long) == long
    refusals = NameRefusals()
    reported: list[NameQuery] = []

    def check(q: NameQuery) -> tuple[str | None, NameVerdict | None]:
        reported.append(q)
        return "u1", NameVerdict(False, NameReason.SNI_NOT_LEARNED)

    client = await aiohttp_client(
        active_app(lambda ip: None, names=NameService(check, NameReport(refusals)))
    )
    params = {"clientIp": "10.203.0.11", "wire": "http", "name": long, "dst": str(CDN), "dport": "80"}
    resp = await client.get(NAMES_PATH, params=params)
    # The child refuses (503 name_check_unavailable), but egressd never saw a query: no count,
    # no mitm.name_refused line, no webhook, no recent denial.
    assert resp.status == 200, f"route answered {resp.status}: the refusal is not counted"
    assert json.loads(await resp.read())["admit"] is False
    assert refusals.of("u1") == 1


@pytest.mark.parametrize("value", ["H2C", "h2c", "TLS/1.2", "foo, websocket", "IRC/6.9"])
def test_only_websocket_upgrades_reach_the_upstream(value: str) -> None:
    f = tflow.tflow()
    f.request.headers["upgrade"] = value
    f.request.headers["connection"] = "Upgrade, HTTP2-Settings"
    f.request.headers["http2-settings"] = "AAMAAABkAAQCAAAAAAIAAAAA"
    OnlyWebSocketUpgrades().process_flow(f)
    assert "upgrade" not in f.request.headers and "http2-settings" not in f.request.headers


def test_a_websocket_upgrade_is_kept() -> None:
    f = tflow.tflow()
    f.request.headers["upgrade"] = "WebSocket"
    f.request.headers["connection"] = "Upgrade"
    OnlyWebSocketUpgrades().process_flow(f)
    assert f.request.headers["upgrade"] == "WebSocket"


@pytest.mark.parametrize("host", ["evil.test..", "user@evil.test", "evil%2etest", "a..b", "x" * 64 + ".io", "*.evil.test"])
def test_a_name_the_check_cannot_read_is_refused_as_such(host: str) -> None:
    params = {"clientIp": "10.203.0.11", "wire": "http", "name": host, "dst": str(CDN), "dport": "80"}
    query = parse_query(params)
    assert query is not None and query.unreadable
    verdict = answer(lambda q: ("u1", NameVerdict(True)), None, query)
    assert not verdict.admit and verdict.reason is NameReason.HOST_NOT_ALLOWED


def test_a_dns_name_is_readable() -> None:
    for host in ("evil.test", "EVIL.test.", "a_b.x-y.io", ("a" * 63 + ".") * 3 + "a" * 61):
        query = parse_query({"clientIp": "10.203.0.11", "wire": "tls", "name": host, "dst": str(CDN), "dport": "443"})
        assert query is not None and not query.unreadable, host
