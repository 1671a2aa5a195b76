"""Request rules (docs/reference/behaviour.md §19), fleet profile, against the real MITM with real
clients in the CDN-shaped topology (tests/kernel/cdn.py): api.x.io (10.204.0.5) is judged by
methods and paths; the upstream records every request it reads, so a refused request must
leave no record.

The attacker tries HTTP/1.1 and HTTP/2, absolute-form, percent-encoding, dot segments, ``//``,
``;params``, method case, HEAD, OPTIONS, a body on GET, pipelining, requests after an upgrade
or a CONNECT on the same connection, and a WebSocket upgrade.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.cdn import (
    CDN_IP,
    DPR,
    OTHER_IP,
    XIO_IP,
    Webhook,
    allow,
    cdn_topology,
    dropped,
    learn,
    mark,
    mitm_env,
    policy,
    requests,
    tls,
)
from tests.kernel.topology import REPO, Daemon, Topology, envelope

HTTP_PORT, WEBHOOK_PORT = 18540, 18541
REQ_CLIENT = Path(__file__).with_name("req_client.py")

#: The §19 vector.
VECTOR = [
    allow("api.x.io", methods=["GET"], paths=["/repos/*"]),
    allow("api.x.io", methods=["POST"], paths=["/repos/o/r/issues"]),
    allow("a.cdn.test"),
]


@pytest.fixture(scope="module")
def cdn() -> Iterator[Topology]:
    t = cdn_topology(f"egq{os.getpid()}", sandboxes=2)
    try:
        yield t
    finally:
        t.down()


@pytest.fixture(scope="module")
def hook(cdn: Topology) -> Iterator[Webhook]:
    w = Webhook(cdn, cdn.pod, "127.0.0.1", WEBHOOK_PORT, "req")
    yield w
    cdn.stop(w.proc)


@pytest.fixture(scope="module")
def fleet(cdn: Topology, hook: Webhook) -> Iterator[Daemon]:
    env = {**mitm_env(cdn, "req"), "OPENSANDBOX_EGRESS_DENY_WEBHOOK": hook.url}
    d = Daemon(cdn, table="egt-req", port=HTTP_PORT, env=env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        yield d
    finally:
        if d.proc is not None:
            cdn.stop(d.proc)
        d.nft("delete", "table", "inet", d.table, check=False)
        print(d.log_text()[-8000:])


def bind(d: Daemon, sb: int, uid: str, pol: object) -> None:
    assert d.post(envelope("SET_BINDING", uid, ip=Topology.sb_ip(sb), policy=pol)) == (200, "{}")
    assert d.post(envelope("LIFECYCLE_HOOK", uid, hook=DPR)) == (200, "{}")


@pytest.fixture
def sb1(cdn: Topology, fleet: Daemon) -> Iterator[str]:
    bind(fleet, 1, "req1", policy(*VECTOR))
    learn(cdn, 1, "api.x.io", XIO_IP)
    yield "req1"
    fleet.post(envelope("REMOVE_BINDING", "req1"))


def mitm_ca(t: Topology) -> Path:
    return t.workdir / "req-mitm-conf" / "mitmproxy-ca-cert.pem"


def raw(
    t: Topology,
    sb: int,
    data: bytes,
    expect: int = 1,
    *,
    port: int = 443,
    sni: str = "api.x.io",
    ca: Path | None = None,
) -> dict[str, Any]:
    """``data`` sent verbatim on one connection to api.x.io (TLS on 443, trusting the MITM CA)."""
    path = t.workdir / f"req-raw-{time.monotonic_ns()}.bin"
    path.write_bytes(data)
    argv = [sys.executable, str(REQ_CLIENT), "--ip", XIO_IP, "--port", str(port), "--raw", str(path)]
    argv += ["--expect", str(expect)]
    if port in (443, 8443):
        argv += ["--tls", "--sni", sni, "--ca", str(ca or mitm_ca(t))]
    r = t.ns(t.sb(sb), *argv, check=False, timeout=30)
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def h2(t: Topology, sb: int, reqs: list[tuple[str, str] | tuple[str, str, str]]) -> dict[str, Any]:
    spec = []
    for item in reqs:
        method, target = item[0], item[1]
        headers = [[":method", method], [":scheme", "https"], [":authority", "api.x.io"], [":path", target]]
        spec.append([headers, item[2] if len(item) > 2 else None])
    argv = [sys.executable, str(REQ_CLIENT), "--ip", XIO_IP, "--port", "443", "--tls", "--sni", "api.x.io"]
    argv += ["--ca", str(mitm_ca(t)), "--h2", json.dumps(spec)]
    r = t.ns(t.sb(sb), *argv, check=False, timeout=30)
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def req(method: str, target: str, *extra: str, body: bytes = b"") -> bytes:
    head = f"{method} {target} HTTP/1.1\r\nHost: api.x.io\r\n"
    for h in extra:
        head += h + "\r\n"
    if body:
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def statuses(out: dict[str, Any]) -> list[int]:
    return [r["status"] for r in out["responses"]]


def upstream_paths(t: Topology, since: int) -> list[tuple[str, str]]:
    return [(r["host"], r["path"]) for r in requests(t, since)]


# ---------------------------------------------------------------------------------------------


def test_the_vector_pipelined_on_one_http1_connection(
    cdn: Topology, fleet: Daemon, hook: Webhook, sb1: str
) -> None:
    since, drops = mark(cdn), dropped(fleet, "s-req1")
    data = b"".join(
        [
            req("GET", "/repos/o/r"),
            req("POST", "/repos/o/r/issues", body=b"{}"),
            req("POST", "/repos/o/r/pulls", body=b"{}"),
            req("DELETE", "/repos/o/r"),
            req("GET", "/user?token=secret-q"),
            req("GET", "/repos/o/r"),
        ]
    )
    out = raw(cdn, 1, data, expect=6)
    assert out["ok"], out
    assert statuses(out) == [200, 200, 403, 403, 403, 200]
    assert upstream_paths(cdn, since) == [
        ("api.x.io", "/repos/o/r"),
        ("api.x.io", "/repos/o/r/issues"),
        ("api.x.io", "/repos/o/r"),
    ]
    refused = out["responses"][4]
    assert refused["body"] == {
        "error": "egress_denied",
        "subject": "s-req1",
        "host": "api.x.io",
        "method": "GET",
        "path": "/user",
        "reason": "default_action",
        "rule": None,
    }
    assert "secret-q" not in json.dumps(out["responses"][4])
    assert (
        out["responses"][2]["body"]["method"] == "POST"
        and out["responses"][2]["body"]["path"] == "/repos/o/r/pulls"
    )
    # Counted, logged, posted with method and path, kept for egressctl suggest.
    deadline = time.monotonic() + 10
    while dropped(fleet, "s-req1") < drops + 3:
        assert time.monotonic() < deadline, dropped(fleet, "s-req1")
        time.sleep(0.1)
    posts = [p for p in hook.posts() if p.get("hostname") == "api.x.io" and p.get("path") == "/user"]
    deadline = time.monotonic() + 10
    while not posts:
        assert time.monotonic() < deadline, hook.posts()
        time.sleep(0.1)
        posts = [p for p in hook.posts() if p.get("hostname") == "api.x.io" and p.get("path") == "/user"]
    assert posts[0]["method"] == "GET" and posts[0]["sandboxId"] == "req1"
    assert "mitm.request_refused" in fleet.log_text()
    (doc,) = [d for d in json.loads(fleet.get("/v1/subjects")[1])["subjects"] if d["uid"] == "req1"]
    assert {"name": "api.x.io", "method": "DELETE", "path": "/repos/o/r"}.items() <= {
        k: v for d in doc["recentDenials"] if d.get("method") == "DELETE" for k, v in d.items()
    }.items()


def test_the_vector_over_http2(cdn: Topology, fleet: Daemon, sb1: str) -> None:
    since = mark(cdn)
    out = h2(
        cdn,
        1,
        [
            ("GET", "/repos/o/r"),
            ("POST", "/repos/o/r/issues", "{}"),
            ("POST", "/repos/o/r/pulls", "{}"),
            ("DELETE", "/repos/o/r"),
            ("GET", "/user"),
            ("GET", "/repos/../user"),
            ("GET", "/repos/%2e%2e/user"),
        ],
    )
    assert out["ok"], out
    assert statuses(out) == [200, 200, 403, 403, 403, 403, 403], out
    assert sorted(p for _, p in upstream_paths(cdn, since)) == ["/repos/o/r", "/repos/o/r/issues"]
    assert out["responses"][2]["body"]["rule"] is None and out["responses"][2]["body"]["method"] == "POST"


TRICKS = [
    "/repos/../user",
    "/repos/./../user",
    "/repos/%2e%2e/user",
    "/repos/%2E%2E/user",
    "/repos/%252e%252e/user",
    "/repos%2f..%2fuser",
    "/repos/%2f/../user",
    "/repos/..%2fuser",
    "/repos/..;/user",
    "/repos/o/r/..%5cuser",
    "//user",
    "/user;/repos/x",
    "/REPOS/o/r",
    "https://api.x.io/user",
]


@pytest.mark.parametrize("target", TRICKS)
def test_path_tricks_do_not_reach_the_upstream(cdn: Topology, fleet: Daemon, sb1: str, target: str) -> None:
    since = mark(cdn)
    out = raw(cdn, 1, req("GET", target))
    assert out["ok"] and statuses(out) in ([403], [400]), (target, out)
    assert upstream_paths(cdn, since) == []


def test_absolute_form_is_judged_by_its_path(cdn: Topology, fleet: Daemon, sb1: str) -> None:
    since = mark(cdn)
    out = raw(
        cdn, 1, req("GET", "https://api.x.io/repos/o/r") + req("GET", "https://api.x.io/user"), expect=2
    )
    assert statuses(out) == [200, 403], out
    assert upstream_paths(cdn, since) == [("api.x.io", "/repos/o/r")]


def test_method_case_head_options_and_a_body_on_get(cdn: Topology, fleet: Daemon, sb1: str) -> None:
    since = mark(cdn)
    assert statuses(raw(cdn, 1, req("delete", "/repos/o/r"))) == [403]
    assert statuses(raw(cdn, 1, req("HEAD", "/repos/o/r"))) == [403]  # HEAD is judged as HEAD
    assert statuses(raw(cdn, 1, req("OPTIONS", "*"))) == [403]
    assert statuses(raw(cdn, 1, req("OPTIONS", "/repos/o/r"))) == [403]
    assert statuses(raw(cdn, 1, req("GET", "/user", body=b"x" * 5000))) == [403]
    assert upstream_paths(cdn, since) == []
    assert statuses(raw(cdn, 1, req("GET", "/repos/o/r", body=b"{}"))) == [200]
    assert upstream_paths(cdn, since) == [("api.x.io", "/repos/o/r")]


def test_requests_after_an_upgrade_or_connect_on_the_same_connection(
    cdn: Topology, fleet: Daemon, sb1: str
) -> None:
    since = mark(cdn)
    ws = (
        "Connection: Upgrade",
        "Upgrade: websocket",
        "Sec-WebSocket-Version: 13",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
    )
    out = raw(cdn, 1, req("GET", "/user", *ws))  # a WebSocket upgrade is judged as its GET
    assert statuses(out) == [403], out
    h2c = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA")
    out = raw(cdn, 1, req("GET", "/repos/o/r", *h2c) + req("GET", "/user"), expect=2)
    assert out["responses"] and out["responses"][-1]["status"] != 200, out
    out = raw(
        cdn, 1, b"CONNECT api.x.io:443 HTTP/1.1\r\nHost: api.x.io:443\r\n\r\n" + req("GET", "/user"), expect=2
    )
    assert all(s != 200 for s in statuses(out)), out
    assert ("api.x.io", "/user") not in upstream_paths(cdn, since)


#: The vector's GET rule for plain HTTP too: port 80 of api.x.io is open only by a rule that names it
#: (docs/reference/behaviour.md §18: the https rules open 443 alone; the kernel drops 80).
HTTP_RULE = allow("api.x.io", protocol="http", methods=["GET"], paths=["/repos/*"])


def test_plain_http_is_judged_too(cdn: Topology, fleet: Daemon, sb1: str) -> None:
    bind(fleet, 1, "req1", policy(*VECTOR, HTTP_RULE))
    since = mark(cdn)
    out = raw(cdn, 1, req("GET", "/repos/o/r") + req("GET", "/user"), expect=2, port=80)
    assert statuses(out) == [403, 403] or statuses(out)[1] == 403, out
    assert ("api.x.io", "/user") not in upstream_paths(cdn, since)


def test_other_names_stay_passed_through(cdn: Topology, fleet: Daemon, sb1: str) -> None:
    learn(cdn, 1, "a.cdn.test", CDN_IP)
    ok = tls(cdn, 1, CDN_IP, "a.cdn.test")  # trusting only the upstream's CA: not decrypted
    assert ok["ok"] and ok["responses"][0]["status"] == 200, ok


def test_a_narrowing_applies_to_the_next_request(cdn: Topology, fleet: Daemon, sb1: str) -> None:
    assert statuses(raw(cdn, 1, req("GET", "/repos/o/r"))) == [200]
    bind(fleet, 1, "req1", policy(allow("api.x.io", methods=["GET"], paths=["/repos/public/*"])))
    since = mark(cdn)
    out = raw(cdn, 1, req("GET", "/repos/o/r"))
    assert statuses(out) == [403] and out["responses"][0]["body"]["reason"] == "default_action"
    assert upstream_paths(cdn, since) == []
    assert statuses(raw(cdn, 1, req("GET", "/repos/public/x"))) == [200]
    # A widening applies too.
    bind(fleet, 1, "req1", policy(*VECTOR, allow("api.x.io", methods=["GET"], paths=["/user"])))
    assert statuses(raw(cdn, 1, req("GET", "/user"))) == [200]


def test_a_deny_rule_decides_with_its_index(cdn: Topology, fleet: Daemon) -> None:
    bind(
        fleet,
        2,
        "req2",
        policy(
            allow("a.cdn.test"),
            {"action": "deny", "target": "*.x.io", "methods": ["DELETE"]},
            default="allow",
        ),
    )
    try:
        learn(cdn, 2, "api.x.io", XIO_IP)
        since = mark(cdn)
        out = raw(cdn, 2, req("DELETE", "/repos/o/r") + req("GET", "/anything"), expect=2)
        assert statuses(out) == [403, 200], out
        assert out["responses"][0]["body"]["rule"] == 1 and out["responses"][0]["body"]["reason"] == "rule"
        assert upstream_paths(cdn, since) == [("api.x.io", "/anything")]
    finally:
        fleet.post(envelope("REMOVE_BINDING", "req2"))


def test_audit_mode_forwards_and_logs_would_denies(cdn: Topology, fleet: Daemon) -> None:
    pol = {**policy(*VECTOR), "mode": "audit"}
    bind(fleet, 2, "req-audit", pol)
    try:
        learn(cdn, 2, "api.x.io", XIO_IP)
        since, log_mark = mark(cdn), len(fleet.log_text())
        out = raw(cdn, 2, req("GET", "/user"))
        assert statuses(out) == [200], out
        assert upstream_paths(cdn, since) == [("api.x.io", "/user")]
        deadline = time.monotonic() + 10
        while "mitm.request_would_refuse" not in fleet.log_text()[log_mark:]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        fleet.post(envelope("REMOVE_BINDING", "req-audit"))


def test_egressctl_suggest_admits_a_scripted_sessions_five_denials(cdn: Topology, fleet: Daemon) -> None:
    """An agent hits five different denials (a DNS name, an SNI on a shared address, three
    requests); ``egressctl suggest`` prints a policy that, applied through SET_BINDING as it is,
    admits each of them, and changes nothing by itself."""
    uid = "req-suggest"
    bind(fleet, 2, uid, policy(*VECTOR))
    try:
        learn(cdn, 2, "api.x.io", XIO_IP)
        learn(cdn, 2, "a.cdn.test", CDN_IP)
        status, _ = cdn.dig(2, "c.cdn.test")
        assert status == "NXDOMAIN" or status == "REFUSED", status  # 1: a DNS name
        assert not tls(cdn, 2, CDN_IP, "b.cdn.test")["ok"]  # 2: an SNI on the shared address
        out = raw(
            cdn,
            2,
            req("DELETE", "/repos/o/r") + req("GET", "/user?page=2") + req("POST", "/repos/o/r/pulls", body=b"{}"),
            expect=3,
        )
        assert statuses(out) == [403, 403, 403], out  # 3, 4, 5: requests
        r = cdn.ns(
            cdn.pod,
            str(REPO / ".venv" / "bin" / "egressctl"),
            "--addr",
            f"127.0.0.1:{fleet.port}",
            "suggest",
            uid,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        suggested = json.loads(r.stdout)
        assert suggested["egress"][-len(VECTOR) :] == [json.loads(json.dumps(x)) for x in VECTOR]
        assert "page=2" not in r.stdout
        # Nothing changed by itself.
        assert statuses(raw(cdn, 2, req("GET", "/user"))) == [403]
        bind(fleet, 2, uid, suggested)
        learn(cdn, 2, "c.cdn.test", OTHER_IP)
        learn(cdn, 2, "b.cdn.test", CDN_IP)
        assert tls(cdn, 2, CDN_IP, "b.cdn.test")["ok"]
        since = mark(cdn)
        out = raw(
            cdn,
            2,
            req("DELETE", "/repos/o/r") + req("GET", "/user?page=2") + req("POST", "/repos/o/r/pulls", body=b"{}"),
            expect=3,
        )
        assert statuses(out) == [200, 200, 200], (suggested, out)
        assert len(upstream_paths(cdn, since)) == 3
    finally:
        fleet.post(envelope("REMOVE_BINDING", uid))


def test_request_rules_the_mitm_cannot_see_are_refused(fleet: Daemon) -> None:
    """A rule with methods/paths on a port the MITM never intercepts (53, 853: DNS and DNS over
    TLS) would pass its requests unjudged: 400 naming the rule, nothing changed. Any other port
    such a rule names is intercepted for its subject (§18: tests/kernel/test_names_named_ports.py)."""
    pol = policy(allow("api.x.io", methods=["GET"], paths=["/repos/*"], ports=[853]))
    code, text = fleet.post(envelope("SET_BINDING", "req-853", ip=Topology.sb_ip(2), policy=pol))
    assert code == 400 and "egress[0].ports" in text and "853" in text, text


def test_a_request_without_any_authority_is_judged_by_its_sni(cdn: Topology, fleet: Daemon, sb1: str) -> None:
    since = mark(cdn)
    out = raw(cdn, 1, b"GET /user HTTP/1.0\r\n\r\n")
    assert statuses(out) == [403], out
    assert out["responses"][0]["body"]["reason"] == "default_action"
    out = raw(cdn, 1, b"GET /repos/o/r HTTP/1.0\r\n\r\n")
    assert out["ok"] and ("api.x.io", "/user") not in upstream_paths(cdn, since), out
