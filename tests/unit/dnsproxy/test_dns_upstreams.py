"""§7 upstream resolvers: OPENSANDBOX_EGRESS_DNS_UPSTREAM parsing and /etc/resolv.conf fallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from egressd.dnsproxy.upstreams import (
    DEFAULT_PORT,
    MAX_RESOLV_CONF,
    Upstream,
    UpstreamError,
    from_resolv_conf,
    parse_upstreams,
)

# --------------------------------------------------------------------------- parse_upstreams


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("8.8.8.8", [("8.8.8.8", 53)]),
        ("8.8.8.8:5353", [("8.8.8.8", 5353)]),
        ("[2001:4860:4860::8888]", [("2001:4860:4860::8888", 53)]),
        ("[2001:4860:4860::8888]:5353", [("2001:4860:4860::8888", 5353)]),
        ("2001:4860:4860::8888", [("2001:4860:4860::8888", 53)]),  # bare v6: no port possible
        ("::1", [("::1", 53)]),
        ("  1.1.1.1 ,  9.9.9.9:54 ", [("1.1.1.1", 53), ("9.9.9.9", 54)]),
        ("1.1.1.1,,9.9.9.9,", [("1.1.1.1", 53), ("9.9.9.9", 53)]),  # empty items skipped
        ("[2001:DB8:0::1]", [("2001:db8::1", 53)]),  # canonical text
        ("1.2.3.4:65535", [("1.2.3.4", 65535)]),
        ("1.2.3.4:1", [("1.2.3.4", 1)]),
    ],
)
def test_parse_upstreams_forms(value: str, expected: list[tuple[str, int]]) -> None:
    assert parse_upstreams(value) == tuple(Upstream(h, p) for h, p in expected)


def test_default_port_is_53() -> None:
    assert DEFAULT_PORT == 53
    (up,) = parse_upstreams("10.1.2.3")
    assert up.port == 53
    assert str(up) == "10.1.2.3:53"
    assert up.family == 4


def test_v6_upstream_renders_bracketed() -> None:
    (up,) = parse_upstreams("[fd00::53]:5300")
    assert str(up) == "[fd00::53]:5300"
    assert up.family == 6


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        # Same endpoint spelled differently: one entry, at the first position.
        ("8.8.8.8,1.1.1.1,8.8.8.8:53", [("8.8.8.8", 53), ("1.1.1.1", 53)]),
        ("1.1.1.1,8.8.8.8,1.1.1.1", [("1.1.1.1", 53), ("8.8.8.8", 53)]),
        ("[2001:db8::1],2001:DB8::1,[2001:db8:0::1]:53", [("2001:db8::1", 53)]),
        # Same host, different ports: both kept, in order.
        ("8.8.8.8:5353,8.8.8.8", [("8.8.8.8", 5353), ("8.8.8.8", 53)]),
        ("9.9.9.9,1.1.1.1,8.8.8.8", [("9.9.9.9", 53), ("1.1.1.1", 53), ("8.8.8.8", 53)]),
    ],
)
def test_dedupe_keeps_first_occurrence_order(value: str, expected: list[tuple[str, int]]) -> None:
    assert parse_upstreams(value) == tuple(Upstream(h, p) for h, p in expected)


@pytest.mark.parametrize(
    "value",
    [
        "dns.google",
        "dns.google:53",
        "[dns.google]:53",
        "8.8.8.8,resolver.local",
        "localhost",
        "1.2.3",
        "256.1.1.1",
    ],
)
def test_hostnames_and_non_ips_are_rejected(value: str) -> None:
    with pytest.raises(UpstreamError):
        parse_upstreams(value)


@pytest.mark.parametrize("value", ["", " ", ",", " , ,"])
def test_empty_is_an_error(value: str) -> None:
    with pytest.raises(UpstreamError):
        parse_upstreams(value)


@pytest.mark.parametrize(
    "value",
    [
        "8.8.8.8:",
        "8.8.8.8:0",
        "8.8.8.8:65536",
        "8.8.8.8:-1",
        "8.8.8.8:5x",
        "8.8.8.8: 53",
        "[::1]:",
        "[::1]:0",
        "[::1]:99999",
        "[::1]x",
        "[::1]:53:53",
        "[::1",
    ],
)
def test_bad_port_or_bracket_is_an_error(value: str) -> None:
    with pytest.raises(UpstreamError):
        parse_upstreams(value)


@pytest.mark.parametrize("value", ["8.8.8.8:²", "8.8.8.8:５３"])
def test_non_ascii_digit_port_is_an_upstream_error(value: str) -> None:
    with pytest.raises(UpstreamError):
        parse_upstreams(value)


def test_zone_ids_are_rejected() -> None:
    with pytest.raises(UpstreamError):
        parse_upstreams("[fe80::1%eth0]:53")


def test_upstream_error_is_a_value_error() -> None:
    assert issubclass(UpstreamError, ValueError)


# --------------------------------------------------------------------------- resolv.conf


def test_resolv_conf_non_loopback_first_in_file_order() -> None:
    text = "nameserver 127.0.0.53\nnameserver 10.0.0.2\nnameserver ::1\nnameserver 2001:db8::53\n"
    assert from_resolv_conf(text) == (
        Upstream("10.0.0.2"),
        Upstream("2001:db8::53"),
        Upstream("127.0.0.53"),
        Upstream("::1"),
    )


def test_resolv_conf_only_loopback_is_kept() -> None:
    assert from_resolv_conf("nameserver 127.0.0.53\n") == (Upstream("127.0.0.53", 53),)


def test_resolv_conf_at_most_ten() -> None:
    text = "".join(f"nameserver 10.0.0.{i}\n" for i in range(1, 16))
    ups = from_resolv_conf(text)
    assert MAX_RESOLV_CONF == 10
    assert ups == tuple(Upstream(f"10.0.0.{i}") for i in range(1, 11))


def test_resolv_conf_cap_applies_after_loopback_reordering() -> None:
    # Loopback entries come first in the file but must not push real resolvers out of the ten.
    text = "".join(f"nameserver 127.0.0.{i}\n" for i in range(1, 6))
    text += "".join(f"nameserver 10.0.0.{i}\n" for i in range(1, 9))
    ups = from_resolv_conf(text)
    assert len(ups) == 10
    assert ups[:8] == tuple(Upstream(f"10.0.0.{i}") for i in range(1, 9))
    assert ups[8:] == (Upstream("127.0.0.1"), Upstream("127.0.0.2"))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n",
        "# nameserver 1.1.1.1\n; nameserver 9.9.9.9\n",
        "search example.com\noptions ndots:5\n",
        "nameserver\nnameserver dns.google\nnameserver 1.2.3\n",
    ],
)
def test_resolv_conf_without_nameservers_falls_back_to_google(text: str) -> None:
    assert from_resolv_conf(text) == (Upstream("8.8.8.8", 53),)


def test_resolv_conf_comments_and_garbage_are_ignored() -> None:
    text = """
# Generated by NetworkManager
search corp.example
; nameserver 6.6.6.6
#nameserver 7.7.7.7
nameserver not-an-ip
nameservers 5.5.5.5
domain example
nameserver 192.168.1.1   # trailing comment
   nameserver    192.168.1.2
options edns0 trust-ad
nameserver fe80::1%eth0
\x00\xff junk line
nameserver 192.168.1.1
"""
    assert from_resolv_conf(text) == (
        Upstream("192.168.1.1"),
        Upstream("192.168.1.2"),
        Upstream("fe80::1"),
    )
    assert all(u.port == 53 for u in from_resolv_conf(text))


def test_configured_upstreams_win_else_resolv_conf(tmp_path: Path) -> None:
    from egressd.dnsproxy.upstreams import parse_upstreams, upstreams_or_system

    configured = parse_upstreams("10.0.0.53")
    assert upstreams_or_system(configured, tmp_path / "absent") == configured
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 192.0.2.53\n")
    assert [str(u) for u in upstreams_or_system(None, resolv)] == [
        str(u) for u in parse_upstreams("192.0.2.53")
    ]
    assert [str(u) for u in upstreams_or_system(None, tmp_path / "absent")] == ["8.8.8.8:53"]
