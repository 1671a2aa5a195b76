"""Configuration (docs/reference/configuration.md): env and --flags in, Config out; flags win."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from egressd.commonconfig import CommonConfig
from egressd.config import OPTIONS, ConfigError, parse_config, parse_fleet_config, parse_sidecar_config
from egressd.dnsproxy.config import DnsConfig
from egressd.fleet.config import FleetConfig
from egressd.kernel.config import KernelConfig, parse_doh_blocklist
from egressd.main import main
from egressd.mitm.config import MitmConfig
from egressd.options import Option
from egressd.sidecar.config import SidecarConfig
from egressd.vault.config import VaultConfig

FLEET = {"OPENSANDBOX_EGRESS_PROFILE": "fleet"}
BOOLEAN_ENVS = [o.env for o in OPTIONS if o.boolean]
#: The profile an option is read by (both: the default one).
PROFILE_OF = {o.env: {"OPENSANDBOX_EGRESS_PROFILE": o.profile} if o.profile != "both" else {} for o in OPTIONS}


def refused(env: dict[str, str], argv: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(env, argv or [])
    text = str(info.value)
    assert text
    assert "\n" not in text
    assert "Traceback" not in text
    return text


# --------------------------------------------------------------------------- defaults


def test_sidecar_defaults() -> None:
    cfg = parse_config({})
    assert cfg == SidecarConfig(
        common=CommonConfig(),
        dns=DnsConfig(),
        mitm=MitmConfig(),
        vault=VaultConfig(),
        kernel=KernelConfig(),
    )
    assert cfg.common.http_host == "0.0.0.0" and cfg.kernel.nft_table == "opensandbox"
    assert cfg.mitm.confdir == Path("/var/lib/egressd/mitm") and cfg.mode == "dns+nft"


def test_fleet_defaults() -> None:
    cfg = parse_fleet_config({})
    assert cfg.profile == "fleet"
    assert (cfg.common.http_host, cfg.common.http_port) == ("127.0.0.1", 18080)
    assert cfg.kernel.nft_table == "opensandbox-fleet"
    assert (cfg.dns.host, cfg.dns.port) == ("0.0.0.0", 15353)
    assert cfg.mitm.port == 18081
    assert cfg.pending_push_ttl == 30
    assert cfg.dns.upstream_timeout == 5.0
    assert cfg.common.log_format == "json"


def test_fleet_profile_from_flag_gets_fleet_defaults() -> None:
    cfg = parse_config({}, ["--profile", "fleet"])
    assert cfg.common.http_host == "127.0.0.1"
    assert cfg.kernel.nft_table == "opensandbox-fleet"


def test_profile_is_case_insensitive() -> None:
    assert parse_config({"OPENSANDBOX_EGRESS_PROFILE": " Fleet "}).profile == "fleet"


# --------------------------------------------------------------------------- flags win over env


def test_flags_win_over_env() -> None:
    env = {
        "OPENSANDBOX_EGRESS_PROFILE": "sidecar",
        "EGRESSD_NFT_TABLE": "from-env",
        "EGRESSD_DNS_ADDR": "127.0.0.1:5353",
        "OPENSANDBOX_EGRESS_PENDING_PUSH_TTL": "10",
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
    }
    cfg = parse_config(
        env,
        [
            "--profile",
            "fleet",
            "--nft-table",
            "from-flag",
            "--dns-addr=127.0.0.2:5354",
            "--pending-push-ttl",
            "20",
            "--mitmproxy-transparent",
            "0",
        ],
    )
    assert isinstance(cfg, FleetConfig)
    assert cfg.kernel.nft_table == "from-flag"
    assert (cfg.dns.host, cfg.dns.port) == ("127.0.0.2", 5354)
    assert cfg.pending_push_ttl == 20
    assert cfg.mitm.transparent is False


def test_env_used_when_no_flag() -> None:
    cfg = parse_config({**FLEET, "EGRESSD_NFT_TABLE": "t1", "OPENSANDBOX_EGRESS_MITMPROXY_PORT": "19000"})
    assert cfg.kernel.nft_table == "t1"
    assert cfg.mitm.port == 19000


def test_every_option_has_a_flag() -> None:
    for opt in OPTIONS:
        assert opt.flag.startswith("--")
    envs = {o.env for o in OPTIONS}
    for name in (
        "OPENSANDBOX_EGRESS_PROFILE",
        "OPENSANDBOX_EGRESS_HTTP_ADDR",
        "OPENSANDBOX_EGRESS_PENDING_PUSH_TTL",
        "OPENSANDBOX_EGRESS_BLOCK_DOH_443",
        "OPENSANDBOX_EGRESS_DOH_BLOCKLIST",
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT",
        "OPENSANDBOX_EGRESS_MITMPROXY_PORT",
        "OPENSANDBOX_EGRESS_DNS_UPSTREAM",
        "OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT",
        "EGRESSD_DNS_ADDR",
        "EGRESSD_NFT_TABLE",
        "EGRESSD_ALWAYS_RULES_DIR",
        "EGRESSD_VAULT_KEYS_DIR",
        "EGRESSD_LOG_FORMAT",
        "EGRESSD_ALLOW_NON_LOOPBACK",
    ):
        assert name in envs


def test_unknown_flag_is_a_config_error() -> None:
    assert "--bogus" in refused({}, ["--bogus", "1"])


# --------------------------------------------------------------------------- profile


@pytest.mark.parametrize("profile", ["both", "", "  ", "fleet2"])
def test_bad_profile_is_one_line_error(profile: str) -> None:
    text = refused({"OPENSANDBOX_EGRESS_PROFILE": profile})
    assert "OPENSANDBOX_EGRESS_PROFILE" in text


def test_main_exits_nonzero_with_one_line_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OPENSANDBOX_EGRESS_PROFILE", "nonsense")
    assert main([]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "OPENSANDBOX_EGRESS_PROFILE" in err
    assert "Traceback" not in err


# --------------------------------------------------------------------------- loopback guard


@pytest.mark.parametrize("addr", ["0.0.0.0:18080", "10.0.0.1:18080", "[::]:18080"])
def test_fleet_non_loopback_refused(addr: str) -> None:
    text = refused({**FLEET, "OPENSANDBOX_EGRESS_HTTP_ADDR": addr})
    assert "EGRESSD_ALLOW_NON_LOOPBACK" in text


@pytest.mark.parametrize("allow", ["1", "true"])
def test_fleet_non_loopback_allowed_with_override(allow: str) -> None:
    cfg = parse_fleet_config({"OPENSANDBOX_EGRESS_HTTP_ADDR": "0.0.0.0:9000", "EGRESSD_ALLOW_NON_LOOPBACK": allow})
    assert (cfg.common.http_host, cfg.common.http_port) == ("0.0.0.0", 9000)
    assert cfg.allow_non_loopback


def test_fleet_non_loopback_override_by_flag() -> None:
    cfg = parse_config(FLEET, ["--http-addr", "0.0.0.0:9000", "--allow-non-loopback", "1"])
    assert cfg.common.http_host == "0.0.0.0"


def test_fleet_override_set_to_zero_still_refuses() -> None:
    refused({**FLEET, "OPENSANDBOX_EGRESS_HTTP_ADDR": "0.0.0.0:9000", "EGRESSD_ALLOW_NON_LOOPBACK": "0"})


@pytest.mark.parametrize("addr", ["127.0.0.1:18080", "127.0.0.5:1", "[::1]:18080", "localhost:18080"])
def test_fleet_loopback_addresses(addr: str) -> None:
    parse_config({**FLEET, "OPENSANDBOX_EGRESS_HTTP_ADDR": addr})


def test_sidecar_may_listen_everywhere() -> None:
    assert parse_config({"OPENSANDBOX_EGRESS_HTTP_ADDR": "0.0.0.0:18080"}).common.http_host == "0.0.0.0"


@pytest.mark.parametrize(
    "addr", ["18080", "example.com:80", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:x", "[::1]"]
)
def test_bad_http_addr(addr: str) -> None:
    assert "OPENSANDBOX_EGRESS_HTTP_ADDR" in refused({**FLEET, "OPENSANDBOX_EGRESS_HTTP_ADDR": addr})


# --------------------------------------------------------------------------- DoH blocklist


def test_doh_blocklist_parsing() -> None:
    cfg = parse_config(
        {
            "OPENSANDBOX_EGRESS_BLOCK_DOH_443": "1",
            "OPENSANDBOX_EGRESS_DOH_BLOCKLIST": " 1.1.1.1, 9.9.9.9/24,,2606:4700::/32 , 2001:db8::1",
        }
    )
    assert cfg.kernel.block_doh_443
    assert cfg.kernel.doh_blocklist == (
        ipaddress.ip_network("1.1.1.1/32"),
        ipaddress.ip_network("9.9.9.0/24"),
        ipaddress.ip_network("2606:4700::/32"),
        ipaddress.ip_network("2001:db8::1/128"),
    )


@pytest.mark.parametrize("entry", ["dns.google", "1.1.1.1/33", "300.1.1.1", "1.1.1.1/x", "::g"])
def test_invalid_doh_entry_is_an_error(entry: str) -> None:
    text = refused({"OPENSANDBOX_EGRESS_DOH_BLOCKLIST": f"1.1.1.1,{entry}"})
    assert "OPENSANDBOX_EGRESS_DOH_BLOCKLIST" in text
    assert entry in text
    with pytest.raises(ConfigError):
        parse_doh_blocklist(entry)


def test_empty_doh_blocklist() -> None:
    assert parse_doh_blocklist("") == ()
    assert parse_doh_blocklist(" , ") == ()


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    ("value", "expected"), [("abc", 30), ("0", 30), ("-5", 30), ("", 30), ("1.5", 30), ("45", 45), (" 7 ", 7)]
)
def test_pending_push_ttl(value: str, expected: int) -> None:
    assert parse_fleet_config({"OPENSANDBOX_EGRESS_PENDING_PUSH_TTL": value}).pending_push_ttl == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("abc", 5.0),
        ("0", 5.0),
        ("-1", 5.0),
        ("", 5.0),
        ("nan", 5.0),
        ("2", 2.0),
        ("0.5", 0.5),
        ("120", 120.0),
        ("121", 120.0),
        ("100000", 120.0),
        ("inf", 120.0),
    ],
)
def test_dns_upstream_timeout(value: str, expected: float) -> None:
    cfg = parse_config({"OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT": value})
    assert cfg.dns.upstream_timeout == expected


@pytest.mark.parametrize("port", ["0", "65536", "abc", " "])
def test_bad_mitm_port(port: str) -> None:
    assert "OPENSANDBOX_EGRESS_MITMPROXY_PORT" in refused({"OPENSANDBOX_EGRESS_MITMPROXY_PORT": port})
    assert "OPENSANDBOX_EGRESS_MITMPROXY_PORT" in refused({}, ["--mitmproxy-port", port])


def test_mitm_port_colliding_with_dns_port() -> None:
    refused({"EGRESSD_DNS_ADDR": "0.0.0.0:18081"})


# --------------------------------------------------------------------------- booleans


@pytest.mark.parametrize("name", BOOLEAN_ENVS)
@pytest.mark.parametrize("value", ["maybe", "2", "yes please", "y"])
def test_bad_booleans(name: str, value: str) -> None:
    assert name in refused({name: value, **PROFILE_OF[name]})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("Off", False),
        ("no", False),
        ("", False),
    ],
)
def test_boolean_spellings(value: str, expected: bool) -> None:
    cfg = parse_config(
        {"OPENSANDBOX_EGRESS_BLOCK_DOH_443": value, "OPENSANDBOX_EGRESS_MITMPROXY_SSL_INSECURE": value}
    )
    assert cfg.kernel.block_doh_443 is expected
    assert cfg.mitm.ssl_insecure is expected


# --------------------------------------------------------------------------- table name, mode, log format


@pytest.mark.parametrize("table", ["1table", "has space", "semi;colon", "  ", 'quo"te', "new\nline", "t{x}"])
def test_invalid_table_name(table: str) -> None:
    assert "EGRESSD_NFT_TABLE" in refused({"EGRESSD_NFT_TABLE": table})


@pytest.mark.parametrize("table", ["t", "egress-test_1", "A" + "b" * 63])
def test_valid_table_names(table: str) -> None:
    assert parse_config({**FLEET, "EGRESSD_NFT_TABLE": table}).kernel.nft_table == table


def test_bad_mode_and_log_format() -> None:
    assert "OPENSANDBOX_EGRESS_MODE" in refused({"OPENSANDBOX_EGRESS_MODE": "iptables"})
    assert "EGRESSD_LOG_FORMAT" in refused({"EGRESSD_LOG_FORMAT": "xml"})
    assert parse_sidecar_config({"OPENSANDBOX_EGRESS_MODE": "DNS"}).mode == "dns"
    assert parse_config({"EGRESSD_LOG_FORMAT": "console"}).common.log_format == "console"


def test_paths_and_optional_strings() -> None:
    cfg = parse_config(
        {
            **FLEET,
            "EGRESSD_VAULT_KEYS_DIR": "/keys",
            "EGRESSD_ALWAYS_RULES_DIR": "/rules",
            "OPENSANDBOX_EGRESS_DNS_UPSTREAM": "1.1.1.1,8.8.8.8:53",
            "OPENSANDBOX_EGRESS_TOKEN": "",  # empty: not set, so no sidecar option in the fleet
        }
    )
    assert cfg.vault.keys_dir == Path("/keys")
    assert cfg.common.always_rules_dir == Path("/rules")
    assert cfg.dns.upstreams is not None and len(cfg.dns.upstreams) == 2
    assert parse_sidecar_config({"OPENSANDBOX_EGRESS_TOKEN": ""}).token is None


def test_the_token_is_not_in_the_config_repr() -> None:
    cfg = parse_sidecar_config({"OPENSANDBOX_EGRESS_TOKEN": "PLANTED-tok-42"})
    assert cfg.token == "PLANTED-tok-42" and "PLANTED-tok-42" not in repr(cfg)


# --------------------------------------------------------------------------- 14.7 vault caps


@pytest.mark.parametrize("base", [{}, FLEET])
def test_vault_caps_default_env_and_flag(base: dict[str, str]) -> None:
    from egressd.vault.types import VaultLimits

    cfg = parse_config(base)
    assert (cfg.vault.max_credentials, cfg.vault.max_bindings) == (256, 256)
    assert cfg.vault.limits(cfg.mitm.ignore_hosts) == VaultLimits()
    env = {**base, "EGRESSD_VAULT_MAX_CREDENTIALS": "10", "EGRESSD_VAULT_MAX_BINDINGS": "20"}
    cfg = parse_config(env)
    assert cfg.vault.limits(cfg.mitm.ignore_hosts) == VaultLimits(credentials=10, bindings=20)
    cfg = parse_config(env, ["--vault-max-credentials", "3", "--vault-max-bindings", "4"])
    assert (cfg.vault.max_credentials, cfg.vault.max_bindings) == (3, 4)


@pytest.mark.parametrize("value", ["0", "-1", "x", "100001"])
def test_vault_caps_refuse_nonsense(value: str) -> None:
    for name in ("EGRESSD_VAULT_MAX_CREDENTIALS", "EGRESSD_VAULT_MAX_BINDINGS"):
        assert name in refused({name: value})


# --------------------------------------------------------------------------- profiles (issue 24 item 4)

ONE_PROFILE = [o for o in OPTIONS if o.profile != "both"]
OTHER = {"fleet": "sidecar", "sidecar": "fleet"}


def test_each_profile_has_options_of_its_own() -> None:
    assert {o.profile for o in ONE_PROFILE} == {"fleet", "sidecar"}
    assert {o.env for o in ONE_PROFILE if o.profile == "sidecar"} == {
        "OPENSANDBOX_EGRESS_TOKEN",
        "OPENSANDBOX_EGRESS_RULES",
        "OPENSANDBOX_EGRESS_POLICY_FILE",
        "OPENSANDBOX_EGRESS_MODE",
        "EGRESSD_SIDECAR_KEEP_TABLE",
    }


@pytest.mark.parametrize("opt", ONE_PROFILE, ids=lambda o: o.env)
def test_an_option_of_the_other_profile_refuses_the_start(opt: Option) -> None:
    other = {"OPENSANDBOX_EGRESS_PROFILE": OTHER[opt.profile]}
    value = "1" if opt.boolean else (opt.default or "x")
    for text in (refused({**other, opt.env: value}), refused(other, [opt.flag, value])):
        assert text.startswith(f"{opt.env}: a {opt.profile} option")
    # Empty is unset: an environment file that lists the variable without a value is not
    # refused for the profile (an empty number is still refused as before, as not a number).
    try:
        parse_config({**other, opt.env: ""})
    except ConfigError as exc:
        assert "option, but OPENSANDBOX_EGRESS_PROFILE" not in str(exc)


@pytest.mark.parametrize("opt", ONE_PROFILE, ids=lambda o: o.env)
def test_an_option_is_read_by_its_own_profile(opt: Option) -> None:
    if opt.default is not None:
        parse_config({"OPENSANDBOX_EGRESS_PROFILE": opt.profile, opt.env: opt.default})


def test_options_of_both_profiles_are_never_refused() -> None:
    both = {o.env: o.default for o in OPTIONS if o.profile == "both" and o.default}
    del both["OPENSANDBOX_EGRESS_PROFILE"]
    for profile in ("fleet", "sidecar"):
        assert parse_config({**both, "OPENSANDBOX_EGRESS_PROFILE": profile}).profile == profile


def test_test_and_benchmark_switches_are_not_offered_but_still_read(
    capsys: pytest.CaptureFixture[str],
) -> None:
    hidden = {o.env for o in OPTIONS if not o.public}
    assert hidden == {
        "EGRESSD_DNS_LEASE_MIN",
        "EGRESSD_DNS_LEASE_MAX",
        "EGRESSD_MITM_BODY_REDACTION",
        "EGRESSD_MITM_KERNEL_RELAY",
        "EGRESSD_MITM_VAULT_PUSH",
    }
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--dns-lease-min" not in out and "EGRESSD_MITM_VAULT_PUSH" not in out
    assert "--mitm-tls-resume" in out
    cfg = parse_config({"EGRESSD_DNS_LEASE_MIN": "3"}, ["--dns-lease-max", "3", "--mitm-body-redaction", "off"])
    assert (cfg.dns.lease_min, cfg.dns.lease_max, cfg.mitm.body_redaction) == (3, 3, False)
    assert parse_config({}).mitm.kernel_relay is True
    assert parse_config({"EGRESSD_MITM_KERNEL_RELAY": "off"}).mitm.kernel_relay is False


# --------------------------------------------------------------------------- EGRESSD_NAME_CHECK (§18)

MITM = {"OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1"}


@pytest.mark.parametrize("profile", [{}, FLEET])
def test_name_check_is_on_by_default_with_the_mitm(profile: dict[str, str]) -> None:
    assert parse_config({**profile, **MITM}).mitm.name_check is True
    assert parse_config({**profile, **MITM, "EGRESSD_NAME_CHECK": " ON "}).mitm.name_check is True


@pytest.mark.parametrize("profile", [{}, FLEET])
def test_name_check_off_and_without_the_mitm(profile: dict[str, str]) -> None:
    assert parse_config({**profile, **MITM, "EGRESSD_NAME_CHECK": "off"}).mitm.name_check is False
    assert parse_config({**profile}).mitm.name_check is False  # no MITM: no name check
    assert parse_config({**profile, "EGRESSD_NAME_CHECK": "on"}).mitm.name_check is False
    assert parse_config({**profile, **MITM}, ["--name-check", "off"]).mitm.name_check is False


@pytest.mark.parametrize("value", ["maybe", "yes-please", "2"])
def test_an_invalid_name_check_refuses_the_start(value: str) -> None:
    text = refused({**MITM, "EGRESSD_NAME_CHECK": value})
    assert text.startswith("EGRESSD_NAME_CHECK:") and "on or off" in text
    refused({"EGRESSD_NAME_CHECK": value})  # checked without the MITM too
