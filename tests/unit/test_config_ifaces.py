"""EGRESSD_SANDBOX_IFACES (docs/reference/behaviour.md §20.2): names and prefixes; anything that could
police loopback or nothing refuses the start with one line."""

from __future__ import annotations

import pytest

from egressd.config import ConfigError, parse_config, parse_fleet_config
from egressd.fleetnft.header import header_script
from egressd.fleetnft.table import TableConfig

FLEET = {"OPENSANDBOX_EGRESS_PROFILE": "fleet"}


def test_names_and_prefixes_become_header_rules() -> None:
    cfg = parse_fleet_config({"EGRESSD_SANDBOX_IFACES": " br0, vh*,br0 ,"})
    assert cfg.sandbox_ifaces == ("br0", "vh*")
    script = header_script(TableConfig(table="T", sandbox_ifaces=cfg.sandbox_ifaces), delete_existing=False)
    assert 'add rule inet T input iifname "br0" jump sandbox_in' in script
    assert 'add rule inet T input iifname "vh*" jump sandbox_in' in script
    assert "add rule inet T input iifname @sandbox_ifaces jump sandbox_in" in script
    assert parse_fleet_config({}).sandbox_ifaces == ()


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("lo", "loopback"),
        ("l*", "loopback"),
        ("lo*", "loopback"),
        ("*", "every interface"),
        ("x" * 16, "longer than 15 bytes"),
        ('br"0', "not an interface name"),
        ("br 0", "not an interface name"),
        ("vh*x", "not an interface name"),
    ],
)
def test_an_entry_that_could_police_loopback_or_nothing_refuses_the_start(value: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**FLEET, "EGRESSD_SANDBOX_IFACES": value})
    assert str(info.value).startswith("EGRESSD_SANDBOX_IFACES: ") and reason in str(info.value)
    assert "\n" not in str(info.value)


def test_the_sidecar_refuses_them() -> None:
    """A fleet option: the sidecar shares its sandbox's namespace, no interface there faces
    another sandbox (it used to log that it ignored them; issue 24 item 4 refuses)."""
    with pytest.raises(ConfigError) as info:
        parse_config({"EGRESSD_SANDBOX_IFACES": "br0"})
    assert str(info.value).startswith("EGRESSD_SANDBOX_IFACES: a fleet option")
    assert "\n" not in str(info.value)


def test_the_flag_wins_and_is_in_the_help() -> None:
    cfg = parse_fleet_config({"EGRESSD_SANDBOX_IFACES": "br0"}, ["--sandbox-ifaces", "vh*"])
    assert cfg.sandbox_ifaces == ("vh*",)
