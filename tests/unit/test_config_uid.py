"""EGRESSD_UID_RANGE, EGRESSD_UID_DNS_PORT_BASE and EGRESSD_UID_MAX_SUBJECTS (docs/reference/behaviour.md §17)."""

from __future__ import annotations

import pytest

from egressd.config import ConfigError, parse_config, parse_fleet_config
from egressd.subject.hostuid import UidPorts, UidRange, free_slot

FLEET = {"OPENSANDBOX_EGRESS_PROFILE": "fleet"}


def refused(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(env)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_defaults() -> None:
    ports = parse_fleet_config(FLEET).uid_ports
    assert ports.uid_range == UidRange(100000, 165535)
    assert ports.base == 16000
    assert ports.dns_port(0) == 16000 and ports.dns_port(255) == 16255
    assert ports.unknown_dns_port == 16256
    assert ports.mitm_port(0) == 16257 and ports.mitm_ports == (16257, 16512)
    assert ports.dns_ports == (16000, 16256)


def test_env_and_flags() -> None:
    env = FLEET | {"EGRESSD_UID_RANGE": " 200-300 ", "EGRESSD_UID_DNS_PORT_BASE": "20000"}
    ports = parse_fleet_config(env, ["--uid-max-subjects", "4"]).uid_ports
    assert ports == UidPorts(UidRange(200, 300), 20000, 4)
    assert (ports.unknown_dns_port, ports.mitm_ports) == (20004, (20005, 20008))
    assert parse_fleet_config(FLEET | {"EGRESSD_UID_RANGE": "7-7"}).uid_ports.uid_range == UidRange(7, 7)


@pytest.mark.parametrize(
    "value", ["", "100000", "100000-", "-5", "a-b", "5-4", "0-10", "1-4294967295", "1--2", "1.5-3"]
)
def test_bad_range_refuses_to_start(value: str) -> None:
    assert "EGRESSD_UID_RANGE" in refused(FLEET | {"EGRESSD_UID_RANGE": value})


@pytest.mark.parametrize(
    ("name", "value"), [("EGRESSD_UID_DNS_PORT_BASE", "0"), ("EGRESSD_UID_MAX_SUBJECTS", "0")]
)
def test_bad_numbers_refuse_to_start(name: str, value: str) -> None:
    assert name in refused(FLEET | {name: value})


def test_port_block_must_fit() -> None:
    text = refused(FLEET | {"EGRESSD_UID_DNS_PORT_BASE": "65000", "EGRESSD_UID_MAX_SUBJECTS": "300"})
    assert "65535" in text


@pytest.mark.parametrize(
    "env",
    [
        {"OPENSANDBOX_EGRESS_MITMPROXY_PORT": "16300"},
        {"EGRESSD_DNS_ADDR": "0.0.0.0:16000"},
        {"OPENSANDBOX_EGRESS_HTTP_ADDR": "127.0.0.1:16512"},
    ],
)
def test_port_block_must_not_cover_other_listeners(env: dict[str, str]) -> None:
    assert "host-uid ports 16000-16512" in refused(FLEET | env)


def test_sidecar_ignores_the_port_block() -> None:
    cfg = parse_config({"OPENSANDBOX_EGRESS_MITMPROXY_PORT": "16300"})
    assert cfg.mitm.port == 16300


def test_slots_and_ports_map_both_ways() -> None:
    ports = UidPorts(UidRange(1, 9), 30000, 3)
    assert [ports.slot_of_dns_port(p) for p in (29999, 30000, 30002, 30003)] == [None, 0, 2, None]
    assert ports.unknown_dns_port == 30003
    assert [ports.slot_of_mitm_port(p) for p in (30003, 30004, 30006, 30007)] == [None, 0, 2, None]
    assert free_slot({0, 1}, 3) == 2 and free_slot({0, 2}, 3) == 1 and free_slot({0, 1, 2}, 3) is None
