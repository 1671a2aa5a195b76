"""Names on the wire (docs/reference/behaviour.md §18): the sidecar profile, and
``EGRESSD_NAME_CHECK=off`` restoring address-level admission, in the CDN-shaped topology of
tests/kernel/cdn.py (one daemon at a time: each test starts its own)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import pytest

from tests.kernel.cdn import (
    CDN_IP,
    CDN_POLICY,
    DPR,
    Webhook,
    accepts,
    cdn_topology,
    http,
    learn,
    mark,
    mitm_env,
    requests,
    tls,
    wait_refusal,
)
from tests.kernel.sidecar import Sidecar
from tests.kernel.topology import Daemon, Topology, envelope


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"egw{os.getpid()}", sandboxes=1)
    try:
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(cdn: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(cdn, sb=1).with_mitm()
    sc.env["OPENSANDBOX_EGRESS_POLICY_FILE"] = str(cdn.workdir / "names-sidecar-policy.json")
    sc.start()
    try:
        yield sc
    finally:
        print(sc.log_text()[-6000:])
        sc.cleanup()


def sidecar_dropped(sc: Sidecar) -> int:
    code, text = sc.api("GET", "/metrics")
    assert code == 200, text
    m = re.search(r'^egressd_subject_dropped_packets_total\{subject="s-sidecar"[^}]*\} (\d+)', text, re.M)
    return int(m.group(1)) if m else 0


def test_the_sidecar_checks_sni_and_host(cdn: Topology, sidecar: Sidecar) -> None:
    sidecar.set_policy(CDN_POLICY)
    assert sidecar.policy()["nameCheck"] is True
    learn(cdn, 1, "a.cdn.test", CDN_IP)
    ok = tls(cdn, 1, CDN_IP, "a.cdn.test")
    assert ok["ok"] and ok["responses"][0]["body"]["sni"] == "a.cdn.test", ok
    before, log_mark, since = sidecar_dropped(sidecar), len(sidecar.log_text()), mark(cdn)
    assert not tls(cdn, 1, CDN_IP, "b.cdn.test")["ok"]
    assert not tls(cdn, 1, CDN_IP, None, host="a.cdn.test")["ok"]
    out = http(cdn, 1, CDN_IP, "b.cdn.test", "a.cdn.test")
    assert [r["status"] for r in out["responses"]] == [403, 200], out
    assert out["responses"][0]["body"]["reason"] == "host_not_allowed"
    assert len(accepts(cdn, since)) == 1  # the admitted request's connection only
    assert [r["host"] for r in requests(cdn, since)] == ["a.cdn.test"]
    event = wait_refusal(sidecar.log_text, log_mark, name="b.cdn.test", port=443)
    assert (event["subject"], event["dst"], event["reason"]) == ("s-sidecar", CDN_IP, "sni_not_allowed")
    wait_refusal(sidecar.log_text, log_mark, reason="no_sni")
    assert sidecar_dropped(sidecar) >= before + 3


def test_name_check_off_restores_address_level_admission(cdn: Topology) -> None:
    hook = Webhook(cdn, cdn.pod, "127.0.0.1", 18531, "names-off")
    env = {**mitm_env(cdn, "off"), "EGRESSD_NAME_CHECK": "off", "OPENSANDBOX_EGRESS_DENY_WEBHOOK": hook.url}
    d = Daemon(cdn, table="egt-names-off", port=18530, env=env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        assert d.status()["nameCheck"] is False
        assert d.post(envelope("SET_BINDING", "off1", ip=Topology.sb_ip(1), policy=CDN_POLICY)) == (200, "{}")
        assert d.post(envelope("LIFECYCLE_HOOK", "off1", hook=DPR)) == (200, "{}")
        learn(cdn, 1, "a.cdn.test", CDN_IP)
        since = mark(cdn)
        out = tls(cdn, 1, CDN_IP, "b.cdn.test")
        assert out["ok"] and out["responses"][0]["body"]["sni"] == "b.cdn.test", out
        assert http(cdn, 1, CDN_IP, "b.cdn.test")["responses"][0]["status"] == 200
        assert tls(cdn, 1, CDN_IP, None, host="a.cdn.test")["ok"]
        assert [r["host"] for r in requests(cdn, since)] == ["b.cdn.test", "b.cdn.test", "a.cdn.test"]
        assert '"mitm.name_refused"' not in d.log_text()
        assert hook.posts() == []
    finally:
        if d.proc is not None:
            cdn.stop(d.proc)
        d.nft("delete", "table", "inet", d.table, check=False)
        cdn.stop(hook.proc)
        print(d.log_text()[-4000:])


def test_an_invalid_name_check_value_refuses_the_start(cdn: Topology) -> None:
    env = {**mitm_env(cdn, "bad"), "EGRESSD_NAME_CHECK": "sometimes"}
    d = Daemon(cdn, table="egt-names-bad", port=18532, env=env)
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(20) != 0
    text = d.log_text()
    assert "EGRESSD_NAME_CHECK" in text and "Traceback" not in text, text
    json.dumps(text)  # one readable line, no traceback
