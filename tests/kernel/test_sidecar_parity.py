"""Reference parity on the real kernel, sidecar profile (issue 15 items 3 and 4): an exempt
nameserver is queried directly by the app (redirect skipped, port 53 only), extra MITM ports
are redirected to the real MITM and its upstream leg is still policed, vault writes over a
non-loopback transport are refused with REQUIRE_TLS, constant labels reach /metrics, and the
self-test reports how this kernel renews a lease (and the delete+add script works here)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from tests.kernel.sidecar import TOKEN, Sidecar
from tests.kernel.topology import UP_NET, VENV_PY, Topology, cleanup_stale

UP_A = f"{UP_NET}.2"  # a.test and the sidecar's DNS upstream
UP_B = f"{UP_NET}.3"  # b.test
UP_EX = f"{UP_NET}.5"  # example.test: never allowed here
# The upstream's wildcard DNS socket answers from 10.204.0.2 and fd00:204::9 only.
NS6 = "fd00:204::9"
MITM_PORT = 18183
RULES = json.dumps({"defaultAction": "deny", "egress": [{"action": "allow", "target": "b.test"}]})


@pytest.fixture(scope="module")
def ptopo() -> Iterator[Topology]:
    cleanup_stale()
    t = Topology(prefix=f"egp{os.getpid()}", sandboxes=1).up_()
    try:
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(ptopo: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(ptopo, sb=1)
    sc.env["OPENSANDBOX_EGRESS_RULES"] = RULES
    try:
        yield sc
    finally:
        print(sc.log_text()[-4000:])
        sc.cleanup()


def events(sc: Sidecar, name: str, since: int = 0) -> list[dict[str, object]]:
    """Log events ``name`` after the first ``since`` characters (the log outlives a test)."""
    out = []
    for line in sc.log_text()[since:].splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("event") == name:
            out.append(doc)
    return out


def test_exempt_nameservers_are_queried_directly_port_53_only(sidecar: Sidecar, ptopo: Topology) -> None:
    # Without the exemption every query of the app is the proxy's (a.test is not allowed).
    sidecar.start()
    assert sidecar.dig("a.test", server=UP_A)[0] == "NXDOMAIN"
    assert sidecar.dig("a.test", server=NS6)[0] == "NXDOMAIN"
    sidecar.kill(15)
    sidecar.env["OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT"] = f"{UP_A},{NS6}"
    sidecar.start()
    since = len(ptopo.upstream_requests())
    assert sidecar.dig("a.test", server=UP_A) == ("NOERROR", [UP_A])
    assert sidecar.dig("a.test", server=UP_A, tcp=True) == ("NOERROR", [UP_A])
    assert sidecar.dig("a.test", server=NS6) == ("NOERROR", [UP_A])
    # The proxy never forwards a denied name: the upstream heard the app itself.
    assert len([r for r in ptopo.upstream_requests()[since:] if r.get("dns") == "a.test"]) == 3
    # Port 53 only (fd00:204::9 is no resolver of the sidecar, so nothing else allows it).
    assert not sidecar.reaches(NS6, 80)
    assert not sidecar.reaches(NS6, 8080)
    # Names the app resolves through the exempt server teach the kernel nothing.
    assert sidecar.dig("example.test", server=UP_A) == ("NOERROR", [UP_EX])
    assert not sidecar.reaches(UP_EX, 80)


def test_selftest_reports_the_renewal_and_labels_reach_metrics(sidecar: Sidecar) -> None:
    sidecar.env["OPENSANDBOX_EGRESS_SANDBOX_ID"] = "sb-parity-1"
    sidecar.env["OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS"] = "team=blue"
    sidecar.env["OPENSANDBOX_EGRESS_LOG_LEVEL"] = "warn"
    since = len(sidecar.log_text())
    sidecar.start()
    code, text = sidecar.api("GET", "/metrics", token=None)
    assert code == 200
    samples = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert samples and all('{sandbox_id="sb-parity-1",team="blue"' in ln for ln in samples)
    # Level warn: the info lines (kernel.selftest_passed among them) are filtered out.
    assert events(sidecar, "kernel.selftest_passed", since) == []
    sidecar.kill(15)
    sidecar.env["OPENSANDBOX_EGRESS_LOG_LEVEL"] = "info"
    since = len(sidecar.log_text())
    sidecar.start()
    (line,) = events(sidecar, "kernel.selftest_passed", since)
    assert line["lease_renewal"] in ("re-add", "delete+add") and line["sandbox_id"] == "sb-parity-1"
    print(f"this kernel (sidecar): lease_renewal={line['lease_renewal']}")


def test_delete_and_add_script_renews_on_this_kernel(ptopo: Topology) -> None:
    """The sidecar's fallback renewal is a valid libnftables transaction here, also for a
    missing element, and leaves the new expiry."""
    code = (
        "import ipaddress, json, subprocess\n"
        "from egressd.sidecarnft.ruleset import SidecarTable, dyn_add\n"
        "t = SidecarTable(table='egp_renew', max_leases=0, renew_by_replace=True)\n"
        "a, b = ipaddress.ip_address('192.0.2.1'), ipaddress.ip_address('192.0.2.2')\n"
        "subprocess.run(['nft', '-f', '-'], input='add table inet egp_renew\\n' + "
        "dyn_add(SidecarTable(table='egp_renew', max_leases=0), [(a, 20)]), text=True, check=True)\n"
        "subprocess.run(['nft', '-f', '-'], input=dyn_add(t, [(a, 300), (b, 300)]), text=True, check=True)\n"
        "out = subprocess.run(['nft', '-j', 'list', 'set', 'inet', 'egp_renew', 'dyn_allow_v4'],"
        " capture_output=True, text=True, check=True).stdout\n"
        "print(out)\n"
    )
    ns = ptopo.sb(1)
    try:
        r = ptopo.ns(ns, str(VENV_PY), "-c", code, check=False, timeout=30)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        elems = next(i["set"]["elem"] for i in doc["nftables"] if "set" in i)
        expires = {e["elem"]["val"]: e["elem"]["expires"] for e in elems}
        assert set(expires) == {"192.0.2.1", "192.0.2.2"}
        assert all(250 < s <= 300 for s in expires.values()), expires
    finally:
        ptopo.ns(ns, "nft", "delete", "table", "inet", "egp_renew", check=False)


# ---------------------------------------------------------------------------------- with MITM


@pytest.fixture
def mitm_sidecar(ptopo: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(ptopo, sb=1).with_mitm(MITM_PORT)
    sc.env.update(
        {
            "OPENSANDBOX_EGRESS_RULES": RULES,
            "OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS": "8080",
            "OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS": "1",
        }
    )
    sc.start()
    try:
        yield sc
    finally:
        print(sc.log_text()[-4000:])
        sc.cleanup()


def redirected_flows(sc: Sidecar, port: int) -> list[str]:
    """conntrack entries of the sandbox's TCP flows to ``port`` that the redirect sent to the MITM."""
    out = sc.topo.ns(sc.ns, "conntrack", "-L", "-p", "tcp", "--orig-port-dst", str(port), check=False).stdout
    return [ln for ln in out.splitlines() if f"sport={MITM_PORT} " in ln]


def test_extra_port_goes_through_the_mitm_and_stays_policed(mitm_sidecar: Sidecar) -> None:
    sc = mitm_sidecar
    assert sc.dig("b.test") == ("NOERROR", [UP_B])
    sc.topo.ns(sc.ns, "conntrack", "-F", check=False)
    # The extra port is name-checked (docs/reference/behaviour.md §18): the allowed name passes,
    # an IP-literal Host is refused.
    assert (
        sc.topo.curl(sc.sb, "http://b.test:8080/probe", timeout=3, extra=("--resolve", f"b.test:8080:{UP_B}"))
        == 200
    )
    assert redirected_flows(sc, 8080), "the 8080 flow did not go through the MITM"
    assert sc.curl(f"http://{UP_B}:8080/probe", timeout=3) == 403
    # The MITM's upstream leg meets the policy like 80/443 do.
    assert sc.curl(f"http://{UP_EX}:8080/probe", timeout=2) != 200
    assert sc.curl(f"http://{UP_EX}:80/probe", timeout=2) != 200


def test_vault_writes_need_a_loopback_or_trusted_tls_transport(mitm_sidecar: Sidecar) -> None:
    sc = mitm_sidecar
    vault = {
        "credentials": [{"name": "k", "source": {"type": "inline", "value": "sk-parity-secret"}}],
        "bindings": [
            {
                "name": "b",
                "match": {"hosts": ["b.test"]},
                "auth": {"type": "bearer", "credential": "k"},
            }
        ],
    }
    body = sc.topo.workdir / "parity-vault.json"
    body.write_text(json.dumps(vault))
    # Like an SDK client outside the sandbox: from the pod namespace, at the sandbox address.
    r = sc.topo.ns(
        sc.topo.pod,
        "curl",
        "-s",
        "-m",
        "5",
        "-w",
        "\n%{http_code}",
        "-X",
        "POST",
        "-H",
        f"OPENSANDBOX-EGRESS-AUTH: {TOKEN}",
        "-H",
        "X-Forwarded-Proto: https",  # not a trusted proxy: ignored
        "--data-binary",
        f"@{body}",
        f"http://{sc.endpoint}/credential-vault",
        check=False,
    )
    text, _, code = r.stdout.rpartition("\n")
    assert code == "426" and "TLS" in text and "sk-parity-secret" not in text
    # Over loopback (inside the sandbox) the same write is accepted.
    assert sc.api("POST", "/credential-vault", vault)[0] == 201
