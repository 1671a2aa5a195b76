"""Reference sidecar parity (issue 15 item 3): the OPENSANDBOX_EGRESS_* variables the
OpenSandbox server forwards to its egress sidecar, from the configuration to what they change
(metric labels, log fields, vault-write transport and scope, kernel rules)."""

from __future__ import annotations

import ipaddress
import json
import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp import web
from structlog.testing import capture_logs

from egressd.actionhandler.control import ControlPlane
from egressd.commonconfig import RESERVED_LABELS, ignored_settings
from egressd.config import ConfigError, parse_config
from egressd.fleet.proxyroute import ProxyRouteAPI
from egressd.fleet.server import FleetHTTP
from egressd.fleetnft.header import header_script
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.logsetup import configure, constant_fields
from egressd.main import main
from egressd.metriclabels import add_to_sample, with_constant_labels
from egressd.metrics import EgressMetrics
from egressd.policy import DENY_ALL, parse_policy
from egressd.sidecar.engine import SidecarEngine
from egressd.sidecar.http import SidecarHTTP
from egressd.sidecarnft.ruleset import SidecarTable, ruleset
from egressd.vault.parse import parse_create, parse_mutation
from egressd.vault.types import VaultError, VaultLimits
from egressd.web.transport import REFUSAL_TEXT, VaultTransport
from tests.unit.fakekernel import FakeTx
from tests.unit.sidecar.test_sidecar_http import AUTH, SECRET, VAULT, ready_prereqs

FLEET = {"OPENSANDBOX_EGRESS_PROFILE": "fleet"}


def refused(env: dict[str, str], argv: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(env, argv or [])
    text = str(info.value)
    assert text and "\n" not in text
    return text


# --------------------------------------------------------------------------- profile name


@pytest.mark.parametrize("value", ["fast-sandbox", " Fast-Sandbox "])
def test_fast_sandbox_is_the_fleet_profile(value: str) -> None:
    cfg = parse_config({"OPENSANDBOX_EGRESS_PROFILE": value})
    assert cfg == parse_config(FLEET)
    assert cfg.profile == "fleet" and cfg.common.http_host == "127.0.0.1" and cfg.kernel.nft_table == "opensandbox-fleet"


def test_fast_sandbox_from_the_flag() -> None:
    assert parse_config({}, ["--profile", "fast-sandbox"]).profile == "fleet"


def test_unknown_profile_names_the_accepted_ones() -> None:
    assert "fast-sandbox" in refused({"OPENSANDBOX_EGRESS_PROFILE": "fastsandbox"})


# --------------------------------------------------------------------------- log level


@pytest.mark.parametrize(
    ("value", "level"),
    [
        (None, logging.INFO),
        ("", logging.INFO),
        ("debug", logging.DEBUG),
        (" INFO ", logging.INFO),
        ("warn", logging.WARNING),
        ("warning", logging.WARNING),
        ("Error", logging.ERROR),
        ("fatal", logging.CRITICAL),
    ],
)
def test_log_level(value: str | None, level: int) -> None:
    env = {} if value is None else {"OPENSANDBOX_EGRESS_LOG_LEVEL": value}
    assert parse_config(env).common.log_level == level


@pytest.mark.parametrize("value", ["verbose", "trace", "5", "info,debug"])
def test_bad_log_level_is_one_line(value: str) -> None:
    assert "OPENSANDBOX_EGRESS_LOG_LEVEL" in refused({"OPENSANDBOX_EGRESS_LOG_LEVEL": value})


def test_log_level_flag_wins() -> None:
    cfg = parse_config({"OPENSANDBOX_EGRESS_LOG_LEVEL": "debug"}, ["--log-level", "error"])
    assert cfg.common.log_level == logging.ERROR


def test_log_level_filters_and_fields_reach_every_line(capsys: pytest.CaptureFixture[str]) -> None:
    saved = structlog.get_config()
    try:
        configure("json", logging.WARNING, {"sandbox_id": "sb-7", "team": "blue"})
        log = structlog.get_logger("t")
        log.info("quiet")
        log.warning("loud", team="own")
        lines = [json.loads(ln) for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    finally:
        structlog.configure(**saved)
    assert [ln["event"] for ln in lines] == ["loud"]
    assert lines[0]["sandbox_id"] == "sb-7"
    assert lines[0]["team"] == "own"  # the line's own key wins


def test_constant_fields_processor() -> None:
    add = constant_fields({"a": "1"})
    assert add(None, "info", {"event": "e"}) == {"event": "e", "a": "1"}
    assert add(None, "info", {"event": "e", "a": "x"}) == {"event": "e", "a": "x"}


# --------------------------------------------------------------------------- sandbox id and extra attrs


def test_sandbox_id_is_trimmed_and_empty_is_unset() -> None:
    assert parse_config({"OPENSANDBOX_EGRESS_SANDBOX_ID": "  sb-42 "}).common.sandbox_id == "sb-42"
    assert parse_config({"OPENSANDBOX_EGRESS_SANDBOX_ID": "  "}).common.sandbox_id is None
    assert parse_config({}).common.sandbox_id is None
    assert parse_config(FLEET, ["--sandbox-id", "pool-1"]).common.sandbox_id == "pool-1"


@pytest.mark.parametrize("value", ["a\x00b", "a\nb", "x" * 257])
def test_bad_sandbox_id_is_one_line(value: str) -> None:
    assert "OPENSANDBOX_EGRESS_SANDBOX_ID" in refused({"OPENSANDBOX_EGRESS_SANDBOX_ID": value})


def test_extra_attrs_parse_like_the_reference() -> None:
    cfg = parse_config(
        {
            "OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS": " team=blue , k8s.pod = p-1,,region-id=eu ",
            "OPENSANDBOX_EGRESS_SANDBOX_ID": "sb-1",
        }
    )
    assert cfg.common.metrics_extra_attrs == (("team", "blue"), ("k8s.pod", "p-1"), ("region-id", "eu"))
    assert cfg.common.metric_labels == (
        ("sandbox_id", "sb-1"),
        ("team", "blue"),
        ("k8s_pod", "p-1"),
        ("region_id", "eu"),
    )
    assert cfg.common.log_fields == {"sandbox_id": "sb-1", "team": "blue", "k8s.pod": "p-1", "region-id": "eu"}
    assert parse_config({}).common.metric_labels == () and parse_config({}).common.log_fields == {}


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("team", "key=value"),
        ("=blue", "key=value"),
        ("team=", "key=value"),
        ("9lives=x", "not a valid label name"),
        ("a b=x", "not a valid label name"),
        ("__name__=x", "not a valid label name"),
        ("subject=x", "already use"),
        ("sandbox_id=x", "already use"),
        ("le=x", "already use"),
        ("a.b=1,a_b=2", "twice"),
        ("team=a\x01b", "control character"),
    ],
)
def test_bad_extra_attrs_are_one_line(value: str, needle: str) -> None:
    text = refused({"OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS": value})
    assert "OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS" in text and needle in text


def test_reserved_labels_cover_every_label_egressd_metrics_use() -> None:
    """A new metric label must join RESERVED_LABELS, or a constant label could duplicate it."""
    metrics = EgressMetrics()
    used = {name for m in vars(metrics).values() for name in getattr(m, "labels", ())}
    assert used and used <= RESERVED_LABELS


# --------------------------------------------------------------------------- metric labels


def populated_metrics(labels: tuple[tuple[str, str], ...]) -> EgressMetrics:
    m = EgressMetrics()
    m.constant_labels = labels
    m.actions.inc("SET_BINDING", "200")
    m.nft_latency.observe(0.01, "static_apply")
    m.dns_latency.observe(0.002)
    m.would_deny.inc("s-u1", "dns", "egress[0]", exemplar={"decision_id": "0a1b"})
    m.dns_failed.inc('we"ird}, reason')
    m.subjects.collect_from(lambda: {("active",): 2.0})
    return m


SAMPLE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*\{(?P<labels>.*?)\} \S+")


@pytest.mark.parametrize("openmetrics", [False, True])
def test_constant_labels_are_on_every_sample(openmetrics: bool) -> None:
    labels = (("sandbox_id", "sb-1"), ("team", 'bl"ue'))
    text = populated_metrics(labels).render(openmetrics)
    plain = populated_metrics(()).render(openmetrics)
    samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(samples) > 30
    for line in samples:
        assert line.split("{", 1)[1].startswith('sandbox_id="sb-1",team="bl\\"ue"'), line
        assert SAMPLE.match(line), line
    # HELP/TYPE/EOF untouched, and nothing but the labels changed.
    assert [ln for ln in text.splitlines() if ln.startswith("#")] == [
        ln for ln in plain.splitlines() if ln.startswith("#")
    ]
    strip = 'sandbox_id="sb-1",team="bl\\"ue"'
    restored = text.replace("{" + strip + ",", "{").replace("{" + strip + "}", "")
    # Exemplar timestamps are the wall clock of each instance's observation.
    stamp = re.compile(r"(# \{[^}]*\} \S+) \d+\.\d+$", re.M)
    assert stamp.sub(r"\1", restored) == stamp.sub(r"\1", plain)
    assert 'le="+Inf"' in text and 'reason="we\\"ird}, reason"' in text
    if openmetrics:
        assert '# {decision_id="0a1b"} 1' in text  # exemplar left alone


def test_add_to_sample_shapes() -> None:
    labels = (("a", "1"),)
    assert add_to_sample("m 3", labels) == 'm{a="1"} 3'
    assert add_to_sample('m{b="x"} 3', labels) == 'm{a="1",b="x"} 3'
    assert add_to_sample('m{a="own"} 3', labels) == 'm{a="own"} 3'  # the sample's own label wins
    assert add_to_sample("m{} 3", labels) == 'm{a="1"} 3'
    assert add_to_sample('m{b="}"} 3 # {x="y"} 1 2', labels) == 'm{a="1",b="}"} 3 # {x="y"} 1 2'
    assert add_to_sample('m{b="unterminated 3', labels) == 'm{b="unterminated 3'
    assert with_constant_labels("m 1\n", ()) == "m 1\n"
    assert with_constant_labels("# HELP m x\nm 1\n", labels) == '# HELP m x\nm{a="1"} 1\n'


# --------------------------------------------------------------------------- extra ports


def test_extra_ports_parse() -> None:
    cfg = parse_config({"OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS": " 8080, 8443 "})
    assert cfg.mitm.extra_ports == (8080, 8443)
    assert parse_config({}).mitm.extra_ports == ()
    many = ",".join(str(p) for p in range(9000, 9013))  # 13 extras + 80 + 443 = 15
    assert len(parse_config({"OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS": many}).mitm.extra_ports) == 13


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("8080,", "empty entry"),
        ("8080,,8443", "empty entry"),
        ("http", "integer"),
        ("0", "outside"),
        ("65536", "outside"),
        ("8080,8080", "duplicate"),
        ("443", "always intercepted"),
        ("80", "always intercepted"),
        ("53", "cannot be intercepted"),
        ("853", "cannot be intercepted"),
        ("18081", "cannot be intercepted"),
        (",".join(str(p) for p in range(9000, 9014)), "more than 15"),
    ],
)
def test_bad_extra_ports_are_one_line(value: str, needle: str) -> None:
    text = refused({"OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS": value})
    assert "OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS" in text and needle in text


def test_extra_ports_without_the_mitm_are_reported_not_silently_dropped() -> None:
    cfg = parse_config({"OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS": "8080"})
    assert any("EXTRA_PORTS" in n for n in ignored_settings(cfg.mitm, cfg.vault))
    on = parse_config(
        {"OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS": "8080", "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1"}
    )
    assert ignored_settings(on.mitm, on.vault) == []


def test_fleet_header_intercepts_the_extra_ports_with_the_same_exemptions() -> None:
    base = TableConfig(table="T", mitm=True)
    plain = header_script(base, delete_existing=False)
    extra = header_script(
        TableConfig(table="T", mitm=True, mitm_extra_ports=(8080, 8443)), delete_existing=False
    )
    assert "{ 80, 443, 8080, 8443 }" not in plain
    assert extra == plain.replace("{ 80, 443 }", "{ 80, 443, 8080, 8443 }")
    nat = [ln for ln in extra.splitlines() if " nat " in ln and "dport {" in ln and "53" not in ln]
    assert len(nat) == 4 and all("{ 80, 443, 8080, 8443 }" in ln for ln in nat)
    assert any("redirect to :ip saddr map @mitm_port_v4" in ln for ln in nat)


def test_sidecar_ruleset_intercepts_the_extra_ports() -> None:
    table = SidecarTable(table="T", mitm_port=18081, mitm_extra_ports=(8080,))
    text = ruleset(table, DENY_ALL)
    assert "tcp dport { 80, 443, 8080 } redirect to :18081" in text
    assert "{ 80, 443 }" not in text
    # The MITM's input policing is port-agnostic: only redirected flows reach it.
    assert "add rule inet T mitm_input tcp dport 18081 ct status dnat accept" in text


# --------------------------------------------------------------------------- nameserver exempt


def test_nameserver_exempt_parse() -> None:
    cfg = parse_config({"OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT": " 10.96.0.10, fd00::53 ,10.96.0.10,"})
    assert cfg.kernel.nameserver_exempt == (ipaddress.ip_address("10.96.0.10"), ipaddress.ip_address("fd00::53"))
    assert parse_config({}).kernel.nameserver_exempt == ()


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("10.96.0.0/16", "not an IP address"),
        ("dns.local", "not an IP address"),
        ("0.0.0.0", "cannot be a nameserver"),
        ("127.0.0.53", "cannot be a nameserver"),
        ("::1", "cannot be a nameserver"),
        ("224.0.0.251", "cannot be a nameserver"),
    ],
)
def test_bad_nameserver_exempt_is_one_line(value: str, needle: str) -> None:
    text = refused({"OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT": value})
    assert "OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT" in text and needle in text


EXEMPT = (ipaddress.ip_address("10.204.0.9"), ipaddress.ip_address("fd00:204::9"))


def test_fleet_header_marks_only_port_53_of_exempt_nameservers_for_registered_sandboxes() -> None:
    plain = header_script(TableConfig(table="T"), delete_existing=False)
    text = header_script(TableConfig(table="T", nameserver_exempt=EXEMPT), delete_existing=False)
    assert "10.204.0.9" not in plain
    marking = [
        ln.split(" marking ", 1)[1] for ln in text.splitlines() if ln.startswith("add rule inet T marking")
    ]
    assert marking == [
        'iifname @sandbox_ifaces fib saddr . iif oif missing counter name "unattributed_dropped" drop',
        "meta mark set meta mark & 0xfffffffd",
        "ip saddr @sandboxes_v4 ip daddr { 10.204.0.9 } meta l4proto { tcp, udp } th dport 53 "
        "meta mark set meta mark | 0x2",
        "ip6 saddr @sandboxes_v6 ip6 daddr { fd00:204::9 } meta l4proto { tcp, udp } th dport 53 "
        "meta mark set meta mark | 0x2",
        "ip saddr vmap @marking_v4",
        "ip6 saddr vmap @marking_v6",
    ]
    # Nothing else changes: the DNS redirect stays the gateway's, the lateral drops and the
    # unmarked-drop tail are those of the plain header.
    others = [ln for ln in text.splitlines() if "10.204.0.9" not in ln and "fd00:204::9" not in ln]
    assert others == plain.splitlines()


def test_sidecar_exempt_nameservers_skip_the_redirect_and_get_port_53_only() -> None:
    table = SidecarTable(table="T", nameserver_exempt=EXEMPT)
    lines = ruleset(table, DENY_ALL).splitlines()
    nat = [ln for ln in lines if " dns_redirect " in ln]
    ret = "ip daddr { 10.204.0.9 } meta l4proto { tcp, udp } th dport 53 return"
    assert nat.index(f"add rule inet T dns_redirect {ret}") < nat.index(
        "add rule inet T dns_redirect udp dport 53 redirect to :15353"
    )
    assert (
        "add rule inet T dns_redirect ip6 daddr { fd00:204::9 } meta l4proto { tcp, udp } th dport 53 return"
        in nat
    )
    egress = [ln.split(" egress ", 1)[1] for ln in lines if ln.startswith("add rule inet T egress")]
    accept = "ip daddr { 10.204.0.9 } meta l4proto { tcp, udp } th dport 53 accept"
    assert (
        egress.index("ip6 daddr @deny_v6 goto denied")
        < egress.index(accept)
        < egress.index("ip daddr @dyn_allow_v4 accept")
    )
    assert not any("10.204.0.9" in ln and "dport 53" not in ln for ln in lines)
    # Mode dns: no filter chain, only the redirect exemption.
    dns_only = ruleset(SidecarTable(table="T", mode="dns", nameserver_exempt=EXEMPT), DENY_ALL)
    assert ret in dns_only and "accept" not in dns_only.split("dns_redirect", 1)[0]


# --------------------------------------------------------------------------- confdir alias


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({}, [], "/var/lib/egressd/mitm"),
        ({"EGRESSD_MITM_CONFDIR": "/a"}, [], "/a"),
        ({"OPENSANDBOX_EGRESS_MITMPROXY_CONFDIR": "/b"}, [], "/b"),
        ({"EGRESSD_MITM_CONFDIR": "/c", "OPENSANDBOX_EGRESS_MITMPROXY_CONFDIR": "/c/"}, [], "/c"),
        ({}, ["--mitmproxy-confdir", "/d"], "/d"),
        ({"OPENSANDBOX_EGRESS_MITMPROXY_CONFDIR": "/e"}, ["--mitmproxy-confdir", "/f"], "/f"),
    ],
)
def test_confdir_alias(env: dict[str, str], argv: list[str], expected: str) -> None:
    assert parse_config(env, argv).mitm.confdir == Path(expected)


@pytest.mark.parametrize(
    ("env", "argv"),
    [
        ({"EGRESSD_MITM_CONFDIR": "/a", "OPENSANDBOX_EGRESS_MITMPROXY_CONFDIR": "/b"}, []),
        ({"OPENSANDBOX_EGRESS_MITMPROXY_CONFDIR": "/b"}, ["--mitm-confdir", "/a"]),
        ({}, ["--mitm-confdir", "/a", "--mitmproxy-confdir", "/b"]),
    ],
)
def test_conflicting_confdirs_are_refused(env: dict[str, str], argv: list[str]) -> None:
    text = refused(env, argv)
    assert "EGRESSD_MITM_CONFDIR" in text and "OPENSANDBOX_EGRESS_MITMPROXY_CONFDIR" in text


# --------------------------------------------------------------------------- vault transport


def test_trusted_proxy_cidrs_parse() -> None:
    cfg = parse_config(
        {
            "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS": "1",
            "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS": "10.9.0.0/16, 192.0.2.7,fd00::/8",
        }
    )
    assert cfg.vault.require_tls
    assert cfg.vault.trusted_proxies == (
        ipaddress.ip_network("10.9.0.0/16"),
        ipaddress.ip_network("192.0.2.7/32"),
        ipaddress.ip_network("fd00::/8"),
    )
    assert ignored_settings(cfg.mitm, cfg.vault) == []
    alone = parse_config({"OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS": "10.9.0.0/16"})
    assert any("REQUIRE_TLS" in n for n in ignored_settings(alone.mitm, alone.vault))


@pytest.mark.parametrize("value", ["10.9.0.0/33", "proxy.local", "10.9.0.1,nope"])
def test_bad_trusted_proxy_cidrs_are_one_line(value: str) -> None:
    name = "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS"
    assert name in refused({name: value})


TRUSTED = (ipaddress.ip_network("10.9.0.0/16"), ipaddress.ip_network("fd00:9::/32"))


@pytest.mark.parametrize(
    ("peer", "proto", "allowed"),
    [
        ("127.0.0.1", None, True),
        ("127.8.0.1", None, True),
        ("::1", None, True),
        ("::ffff:127.0.0.1", None, True),
        ("203.0.113.5", None, False),
        ("203.0.113.5", "https", False),  # only a trusted proxy may assert it
        ("10.9.1.2", None, False),
        ("10.9.1.2", "http", False),
        ("10.9.1.2", " HTTPS ", True),
        ("::ffff:10.9.1.2", "https", True),
        ("fd00:9::5", "https", True),
        ("fd00:10::5", "https", False),
        (None, "https", False),
        ("", None, False),
        ("junk", "https", False),
    ],
)
def test_vault_transport_rules(peer: str | None, proto: str | None, allowed: bool) -> None:
    assert VaultTransport(True, TRUSTED).allows(peer, proto) is allowed
    assert VaultTransport(False, ()).allows(peer, proto) is True


@web.middleware
async def fake_peer(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The test client always connects from loopback: X-Test-Peer plays another peer."""
    peer = request.headers.get("X-Test-Peer")
    return await handler(request.clone(remote=peer) if peer else request)


ALLOW_API = {"egress": [{"action": "allow", "target": "api.allowed.test"}]}


async def sidecar_client(aiohttp_client: Any, transport: VaultTransport) -> Any:
    engine = SidecarEngine(SidecarTable(table="T"), FakeTx(), parse_policy(json.dumps(ALLOW_API)))
    await engine.install()
    http = SidecarHTTP(
        engine,
        EgressMetrics(),
        token="tok-PLANTED-7c1e",
        max_rules=4096,
        prerequisites=ready_prereqs(),
        vault_transport=transport,
    )
    app = http.app()
    app.middlewares.append(fake_peer)
    return await aiohttp_client(app)


async def test_sidecar_vault_writes_need_loopback_or_a_trusted_tls_proxy(aiohttp_client: Any) -> None:
    client = await sidecar_client(aiohttp_client, VaultTransport(True, TRUSTED))
    body = json.dumps(VAULT)

    async def write(method: str, **headers: str) -> tuple[int, str]:
        resp = await client.request(method, "/credential-vault", data=body, headers={**AUTH, **headers})
        return resp.status, (await resp.text()).strip()

    for method in ("POST", "PUT", "PATCH", "DELETE"):
        status, text = await write(method, **{"X-Test-Peer": "203.0.113.5"})
        assert (status, text) == (426, REFUSAL_TEXT)
        assert SECRET not in text
        status, _ = await write(method, **{"X-Test-Peer": "203.0.113.5", "X-Forwarded-Proto": "https"})
        assert status == 426
        assert (await write(method, **{"X-Test-Peer": "10.9.0.3"}))[0] == 426
    # A trusted TLS-terminating proxy and loopback pass (and then meet the usual checks).
    assert (await write("POST", **{"X-Test-Peer": "10.9.0.3", "X-Forwarded-Proto": "https"}))[0] == 201
    assert (await write("PUT"))[0] == 200
    # Reads are not writes.
    resp = await client.get("/credential-vault", headers={**AUTH, "X-Test-Peer": "203.0.113.5"})
    assert resp.status == 200
    # The token is still checked first: no hint that a vault exists without it.
    resp = await client.post("/credential-vault", data=body, headers={"X-Test-Peer": "203.0.113.5"})
    assert resp.status == 401


async def test_sidecar_vault_transport_off_accepts_any_peer(aiohttp_client: Any) -> None:
    client = await sidecar_client(aiohttp_client, VaultTransport())
    resp = await client.post(
        "/credential-vault", data=json.dumps(VAULT), headers={**AUTH, "X-Test-Peer": "203.0.113.5"}
    )
    assert resp.status == 201


async def fleet_client(aiohttp_client: Any, transport: VaultTransport) -> Any:
    control = ControlPlane(FleetPlanKernel(TableConfig(table="T"), FakeTx()))
    await control.reset_table()
    proxy = ProxyRouteAPI(control)
    http = FleetHTTP(control, EgressMetrics(), proxy=proxy, vault_transport=transport)
    app = http.app()
    app.middlewares.append(fake_peer)
    return await aiohttp_client(app)


async def test_fleet_proxy_route_vault_writes_need_loopback_or_a_trusted_tls_proxy(
    aiohttp_client: Any,
) -> None:
    client = await fleet_client(aiohttp_client, VaultTransport(True, TRUSTED))
    path = "/v1/sandboxfleets/u-1/egress/credential-vault"
    body = json.dumps(VAULT)
    for method in ("PUT", "POST", "PATCH", "DELETE"):
        resp = await client.request(method, path, data=body, headers={"X-Test-Peer": "203.0.113.5"})
        assert (resp.status, (await resp.text()).strip()) == (426, REFUSAL_TEXT)
        resp = await client.request(
            method, path, data=body, headers={"X-Test-Peer": "203.0.113.5", "X-Forwarded-Proto": "https"}
        )
        assert resp.status == 426
    # Not refused (the sandbox is unknown: cached pending), from a trusted proxy or loopback.
    resp = await client.put(
        path, data=body, headers={"X-Test-Peer": "10.9.0.3", "X-Forwarded-Proto": "https"}
    )
    assert resp.status == 202
    assert (await client.put(path, data=body)).status == 202
    # Reads and /policy pushes are no vault writes.
    assert (await client.get(path, headers={"X-Test-Peer": "203.0.113.5"})).status == 404
    resp = await client.put(
        "/v1/sandboxfleets/u-1/egress/policy",
        data=json.dumps(ALLOW_API),
        headers={"X-Test-Peer": "203.0.113.5"},
    )
    assert resp.status == 202


async def test_proxy_route_refuses_before_caching() -> None:
    control = ControlPlane(FleetPlanKernel(TableConfig(table="T"), FakeTx()))
    await control.reset_table()
    proxy = ProxyRouteAPI(control)
    path = "/v1/sandboxfleets/u-1/egress/credential-vault"
    reply = await proxy.handle("PUT", path, {}, json.dumps(VAULT).encode(), secure_transport=False)
    assert (reply.status, reply.text) == (426, REFUSAL_TEXT)
    assert control.credentials.pending_pushes.count() == 0
    assert (await proxy.handle("PUT", path, {}, json.dumps(VAULT).encode())).status == 202


# --------------------------------------------------------------------------- scoped match


SCOPED = VaultLimits(require_scoped_match=True)


def vault(match: dict[str, Any]) -> dict[str, Any]:
    return {
        "credentials": [{"name": "k", "source": {"type": "inline", "value": SECRET}}],
        "bindings": [
            {
                "name": "b",
                "match": {"hosts": ["api.allowed.test"], **match},
                "auth": {"type": "bearer", "credential": "k"},
            }
        ],
    }


@pytest.mark.parametrize(
    ("match", "needle"),
    [
        ({"paths": ["/v1/*"]}, "bindings[0].match.methods: must be explicit"),
        ({"methods": [], "paths": ["/v1/*"]}, "bindings[0].match.methods: must be explicit"),
        ({"methods": ["GET"]}, "bindings[0].match.paths: must be explicit"),
        ({"methods": ["GET"], "paths": ["/v1/*", "/*"]}, "bindings[0].match.paths: must not contain /*"),
    ],
)
def test_scoped_match_refuses_implicit_scope(match: dict[str, Any], needle: str) -> None:
    with pytest.raises(VaultError) as info:
        parse_create(vault(match), SCOPED)
    assert needle in str(info.value) and "REQUIRE_SCOPED_MATCH" in str(info.value)
    assert SECRET not in str(info.value)
    parse_create(vault(match))  # the default keeps the reference's compatibility defaults


def test_scoped_match_accepts_explicit_scope_and_applies_to_patch() -> None:
    content = parse_create(vault({"methods": ["get"], "paths": ["/v1/*", "/"]}), SCOPED)
    assert content.bindings[0].match.methods == ("GET",)
    wide = vault({})["bindings"][0] | {"name": "wide"}
    with pytest.raises(VaultError, match="must be explicit"):
        parse_mutation({"bindings": {"add": [wide]}}, SCOPED)
    parse_mutation({"bindings": {"add": [wide]}})


def test_scoped_match_flag_reaches_the_vault_limits() -> None:
    name = "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_SCOPED_MATCH"
    assert parse_config({name: "true"}).vault.limits(parse_config({name: "true"}).mitm.ignore_hosts).require_scoped_match
    assert not parse_config({}).vault.limits(parse_config({}).mitm.ignore_hosts).require_scoped_match
    assert parse_config({name: "1"}, ["--vault-max-bindings", "3"]).vault.limits(parse_config({name: "1"}, ["--vault-max-bindings", "3"]).mitm.ignore_hosts) == VaultLimits(
        bindings=3, require_scoped_match=True
    )


async def test_sidecar_scoped_match_is_a_400(aiohttp_client: Any) -> None:
    engine = SidecarEngine(SidecarTable(table="T"), FakeTx(), parse_policy(json.dumps(ALLOW_API)))
    await engine.install()
    http = SidecarHTTP(
        engine,
        EgressMetrics(),
        token=None,
        max_rules=4096,
        prerequisites=ready_prereqs(),
        vault_limits=SCOPED,
    )
    client = await aiohttp_client(http.app())
    resp = await client.post("/credential-vault", data=json.dumps(vault({})))
    assert resp.status == 400 and "must be explicit" in await resp.text()
    ok = vault({"methods": ["GET"], "paths": ["/v1/*"]})
    assert (await client.post("/credential-vault", data=json.dumps(ok))).status == 201


# --------------------------------------------------------------------------- start-up refusals


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OPENSANDBOX_EGRESS_LOG_LEVEL", "loud"),
        ("OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS", "novalue"),
        ("OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS", "443"),
        ("OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS", "sometimes"),
        ("OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_SCOPED_MATCH", "y"),
        ("OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_TRUSTED_PROXY_CIDRS", "a.b"),
        ("OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT", "10.0.0.0/8"),
        ("OPENSANDBOX_EGRESS_SANDBOX_ID", "a\tb"),
    ],
)
def test_bad_parity_values_exit_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("egressd: ") and name in err and "Traceback" not in err


def test_help_lists_every_parity_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--log-level",
        "--sandbox-id",
        "--metrics-extra-attrs",
        "--mitmproxy-extra-ports",
        "--mitmproxy-confdir",
        "--credential-vault-require-tls",
        "--credential-vault-require-scoped-match",
        "--credential-vault-trusted-proxy-cidrs",
        "--nameserver-exempt",
    ):
        assert flag in out


def test_ignored_settings_are_logged_not_silent() -> None:
    cfg = parse_config({"OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS": "8080"})
    with capture_logs() as logs:
        for note in ignored_settings(cfg.mitm, cfg.vault):
            structlog.get_logger("t").warning("config.ignored", reason=note)
    assert logs and "EXTRA_PORTS" in logs[0]["reason"]
