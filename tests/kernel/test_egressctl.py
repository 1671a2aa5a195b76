"""Every egressctl command against a real egressd in the pod namespace, human and ``--json``.

One daemon serves the whole module (its own table and port); each test uses its own subject
and sandbox and removes it again. egressctl runs as the installed console script through
``ip netns exec <pod>``, exactly as an operator would run it inside the pod.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.topology import GATEWAY, REPO, UPSTREAM_IPS, Daemon, Topology

CTL = str(REPO / ".venv" / "bin" / "egressctl")
PORT = 18190  # inside the pod namespace; apart from conftest's counter (18100 + n)
TABLE = "egt-ctl"
KID = "k1"
KEY = bytes(range(32))
SECRET = "sk-egressctl-kernel-PLANTED"

POLICY = {
    "defaultAction": "deny",
    "egress": [
        {"action": "allow", "target": "a.test"},
        {"action": "allow", "target": UPSTREAM_IPS[0]},
        {"action": "deny", "target": UPSTREAM_IPS[1]},
    ],
}
VAULT = {
    "credentials": [{"name": "tok", "source": {"type": "inline", "value": SECRET}}],
    "bindings": [
        {"name": "b", "match": {"hosts": ["a.test"]}, "auth": {"type": "bearer", "credential": "tok"}}
    ],
}

# /v1/subjects entries: key -> accepted types (the --json shape scripts rely on).
SUBJECT_SHAPE: dict[str, tuple[type, ...]] = {
    "subject": (str,),
    "uid": (str,),
    "state": (str,),
    "sourceIp": (str, type(None)),
    "gateway": (str, type(None)),
    "specGeneration": (int,),
    "pending": (bool,),
    "kernelInstalled": (bool,),
    "policy": (dict, type(None)),
    "vaultRevision": (int, type(None)),
    "leases": (int,),
}


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        """The one JSON document on stdout (one line, nothing else)."""
        assert self.out.count("\n") == 1 and self.out.endswith("\n"), self.out
        return json.loads(self.out)

    def failed(self, code: int, fragment: str = "") -> Run:
        """Non-zero ``code`` with exactly one ``egressctl: ...`` line on stderr, no traceback."""
        assert self.code == code, (self.code, self.out, self.err)
        assert self.err.count("\n") == 1 and self.err.startswith("egressctl: "), self.err
        assert "Traceback" not in self.err and fragment in self.err, self.err
        return self

    def ok(self) -> Run:
        assert self.code == 0, (self.code, self.out, self.err)
        return self


@pytest.fixture(scope="module")
def ctld(topo: Topology) -> Iterator[Daemon]:
    keys = topo.workdir / "ctl-keys"
    keys.mkdir(exist_ok=True)
    (keys / f"{KID}.key").write_bytes(KEY)
    d = Daemon(topo, table=TABLE, port=PORT, env={"EGRESSD_VAULT_KEYS_DIR": str(keys)})
    try:
        d.start()
        yield d
    finally:
        d.kill(15)
        topo.ns(topo.pod, "nft", "delete", "table", "inet", TABLE, check=False)


def ctl(d: Daemon, *argv: str, port: int | None = None, stdin: str | None = None) -> Run:
    addr = f"127.0.0.1:{port if port is not None else d.port}"
    r = subprocess.run(
        ["ip", "netns", "exec", d.topo.pod, CTL, "--addr", addr, *argv],
        capture_output=True,
        text=True,
        timeout=30,
        input=stdin,
    )
    return Run(r.returncode, r.stdout, r.stderr)


def kv(out: str) -> dict[str, str]:
    return dict(line.split(None, 1) for line in out.splitlines())


def bind(d: Daemon, uid: str, sb: int, *extra: str) -> None:
    ip = d.topo.sb_ip(sb)
    r = ctl(d, "send", "set-binding", "--uid", uid, "--ip", ip, "--gateway", GATEWAY, *extra).ok()
    assert r.out == "200 OK\n{}\n"


def remove(d: Daemon, uid: str) -> None:
    ctl(d, "send", "remove", "--uid", uid)


def subjects(d: Daemon) -> list[dict[str, Any]]:
    doc = ctl(d, "--json", "subjects").ok().json()
    assert isinstance(doc, list)
    return doc


def subject(d: Daemon, uid: str) -> dict[str, Any]:
    (entry,) = [s for s in subjects(d) if s["uid"] == uid]
    return entry


# --------------------------------------------------------------------------- status


def test_status_human_and_json(ctld: Daemon) -> None:
    r = ctl(ctld, "status").ok()
    assert r.err == ""
    fields = kv(r.out)
    assert list(fields) == ["instance", "ready", "health", "mitm-ca", "name-check", "subjects", "dropped"]
    assert fields["name-check"].startswith("off")  # no MITM: no name check (docs/reference/behaviour.md §18)
    assert fields["ready"] == "yes" and fields["health"] == "ok" and fields["mitm-ca"] == "disabled"
    assert fields["instance"] == ctld.status()["instanceId"]

    for argv in (("--json", "status"), ("status", "--json")):  # the global flag goes either side
        doc = ctl(ctld, *argv).ok().json()
        assert set(doc) == {"status", "healthy", "health", "subjects"}
        assert doc["healthy"] is True and doc["health"] == "ok"
        st = doc["status"]
        assert st["apiVersion"] == "sandbox.fast.io/actions/v1"
        assert st["ready"] is True and isinstance(st["instanceId"], str)
        assert st.get("mitmCaFingerprint") is None
        assert isinstance(doc["subjects"]["total"], int) and isinstance(doc["subjects"]["byState"], dict)
        assert isinstance(doc["subjects"]["droppedPackets"], int)  # docs/reference/behaviour.md §15
        assert isinstance(doc["subjects"]["unattributedDroppedPackets"], int)


# --------------------------------------------------------------------------- send + subjects


def test_send_drives_the_kernel_and_subjects_shows_it(ctld: Daemon) -> None:
    topo, uid, ip = ctld.topo, "ctl-flow", ctld.topo.sb_ip(1)
    try:
        bind(ctld, uid, 1, "--policy", json.dumps(POLICY), "--spec-generation", "4")
        row = subject(ctld, uid)
        assert set(row) >= set(SUBJECT_SHAPE)
        for key, types in SUBJECT_SHAPE.items():
            assert isinstance(row[key], types), (key, row[key])
        assert (row["subject"], row["state"], row["sourceIp"], row["pending"]) == (
            f"s-{uid}",
            "denying",
            ip,
            True,
        )
        assert ip in ctld.map_keys("dispatch_v4")
        assert not topo.reaches(1, UPSTREAM_IPS[0])  # deny-first until data-plane-ready

        r = ctl(ctld, "send", "hook", "runtime-ready", "--uid", uid).ok()
        assert r.out == "200 OK\n{}\n"
        doc = ctl(ctld, "--json", "send", "hook", "sandbox.data-plane-ready", "--uid", uid).ok().json()
        assert doc == {"code": 200, "body": {}}
        assert topo.reaches(1, UPSTREAM_IPS[0]) and not topo.reaches(1, UPSTREAM_IPS[1])

        r = ctl(ctld, "subjects").ok()
        header, *rows = r.out.splitlines()
        cols = ["SUBJECT", "STATE", "SOURCE-IP", "GATEWAY", "POLICY", "PENDING", "VAULT-REV", "LEASES"]
        assert header.split() == [*cols, "DROPPED", "RECENT-DENIALS"]  # docs/reference/behaviour.md §15
        (line,) = [ln for ln in rows if ln.startswith(f"s-{uid} ")]
        assert line.split()[:8] == [f"s-{uid}", "active", ip, GATEWAY, "default=deny,rules=3", "no", "-", "0"]
        dropped, denials = line.split()[8:]
        assert int(dropped) > 0 and denials == "-"  # the refused probe above, counted by the kernel
        # Cells are aligned under their headers.
        assert line.index(ip) == header.index("SOURCE-IP")
        row = subject(ctld, uid)
        assert (row["state"], row["specGeneration"], row["kernelInstalled"]) == ("active", 4, True)
        assert row["policy"] == {"defaultAction": "deny", "rules": 3}
    finally:
        remove(ctld, uid)
    assert all(s["uid"] != uid for s in subjects(ctld))
    assert ip not in ctld.map_keys("dispatch_v4")
    assert not topo.reaches(1, UPSTREAM_IPS[0])


def test_send_refusals_print_the_answer_and_one_error_line(ctld: Daemon) -> None:
    r = ctl(ctld, "send", "hook", "data-plane-ready", "--uid", "ctl-nobody").failed(1, "409 ")
    assert r.out.startswith("409 Conflict\n") and r.out.count("\n") == 2
    r = ctl(ctld, "--json", "send", "hook", "runtime-ready", "--uid", "ctl-nobody").failed(1, "409 ")
    doc = r.json()
    assert doc["code"] == 409 and isinstance(doc["body"], str) and doc["body"]

    bad = ("send", "set-binding", "--uid", "ctl-bad", "--ip", ctld.topo.sb_ip(2), "--policy", "nope")
    r = ctl(ctld, *bad).failed(1, "POST /_fastlet/v1/actions: 400 ")
    assert r.out.startswith("400 Bad Request\n")
    assert ctl(ctld, "--json", *bad).failed(1).json()["code"] == 400
    assert all(s["uid"] != "ctl-bad" for s in subjects(ctld))


def test_send_raw_and_remove(ctld: Daemon, tmp_path: Path) -> None:
    uid, ip = "ctl-raw", ctld.topo.sb_ip(3)
    envelope = {
        "apiVersion": "sandbox.fast.io/actions/v1",
        "operation": "SET_BINDING",
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": "r1", "attachmentId": "a1", "specGeneration": 1},
        "attachment": {"network": {"ip": ip, "gateway": GATEWAY, "hostVeth": "vh3"}},
        "binding": {"input": "{}"},
    }
    path = tmp_path / "envelope.json"
    path.write_text(json.dumps(envelope))
    try:
        assert ctl(ctld, "send", "raw", "--file", str(path)).ok().out == "200 OK\n{}\n"
        assert subject(ctld, uid)["sourceIp"] == ip
        # The same envelope from stdin, with --json: idempotent.
        doc = ctl(ctld, "--json", "send", "raw", "--file", "-", stdin=json.dumps(envelope)).ok().json()
        assert doc == {"code": 200, "body": {}}
        r = ctl(ctld, "send", "raw", "--file", "-", stdin="{").failed(1, "400 invalid action envelope")
        assert r.out.startswith("400 Bad Request\ninvalid action envelope")
        assert ctl(ctld, "send", "remove", "--uid", uid).ok().out == "200 OK\n{}\n"
        assert ctl(ctld, "--json", "send", "remove", "--uid", uid).ok().json() == {"code": 200, "body": {}}
        assert all(s["uid"] != uid for s in subjects(ctld))
    finally:
        remove(ctld, uid)


# --------------------------------------------------------------------------- explain


def test_explain_human_and_json(ctld: Daemon) -> None:
    uid, ip = "ctl-explain", ctld.topo.sb_ip(4)
    try:
        bind(ctld, uid, 4, "--policy", json.dumps(POLICY))
        doc = ctl(ctld, "--json", "explain", ip, UPSTREAM_IPS[0]).ok().json()
        assert (doc["state"], doc["decision"], doc["layer"]) == ("denying", "deny", "dispatch")
        ctl(ctld, "send", "hook", "data-plane-ready", "--uid", uid).ok()

        sets = "subj_s_ctl_explain"
        cases = [
            (UPSTREAM_IPS[0], "allow", "ip", f"{sets}_allow_v4 has {UPSTREAM_IPS[0]}"),
            (UPSTREAM_IPS[1], "deny", "ip", f"{sets}_deny_v4 has {UPSTREAM_IPS[1]}"),
            (UPSTREAM_IPS[2], "deny", "ip", "in none of the subject's sets: unmarked, dropped"),
            ("a.test", "allow", "dns", "answers are added to the dyn set as leases"),
        ]
        for target, decision, layer, kernel in cases:
            doc = ctl(ctld, "--json", "explain", ip, target).ok().json()
            assert {"target", "state", "decision", "layer", "reason", "sourceIp", "subject"} <= set(doc)
            assert (doc["target"], doc["sourceIp"], doc["subject"]) == (target, ip, f"s-{uid}")
            assert (doc["decision"], doc["layer"], doc["state"]) == (decision, layer, "active")
            assert isinstance(doc["reason"], str) and doc["reason"]
            fields = kv(ctl(ctld, "explain", ip, target).ok().out)
            assert list(fields) == [
                "verdict",
                "source",
                "subject",
                "target",
                "port",
                "layer",
                "rule",
                "kernel",
                "why",
                "name-check",
            ]
            assert (fields["verdict"], fields["layer"], fields["kernel"]) == (decision.upper(), layer, kernel)
        assert kv(ctl(ctld, "explain", ip, "a.test").out)["rule"] == "allow a.test"
        # What the kernel holds is read from the kernel: after a DNS answer the lease shows up
        # in the dyn set with its remaining lifetime.
        assert ctld.topo.dig(4, "a.test")[0] == "NOERROR"
        view = ctl(ctld, "--json", "explain", ip, UPSTREAM_IPS[0]).ok().json()["kernelView"]
        assert view["available"] is True and view["dispatched"] is True
        by_set = {item["set"]: item for item in view["sets"]}
        assert by_set[f"{sets}_allow_v4"]["element"] == UPSTREAM_IPS[0]
        assert by_set[f"{sets}_dyn_v4"]["element"] == UPSTREAM_IPS[0]
        assert 0 < by_set[f"{sets}_dyn_v4"]["expiresInS"] <= 360
        assert "s left" in kv(ctl(ctld, "explain", ip, UPSTREAM_IPS[0]).out)["kernel"]
        # The kernel agrees with what explain said about the addresses.
        assert ctld.topo.reaches(4, UPSTREAM_IPS[0]) and not ctld.topo.reaches(4, UPSTREAM_IPS[1])

        doc = ctl(ctld, "--json", "explain", "10.203.0.99", "a.test").ok().json()
        assert (doc["state"], doc["decision"], doc["layer"]) == ("absent", "deny", "dispatch")
        assert "subject" not in doc
        ctl(ctld, "explain", "not-an-ip", "a.test").failed(2, "400 ")
        ctl(ctld, "--json", "explain", "not-an-ip", "a.test").failed(2, "400 ")
        ctl(ctld, "explain", ip).failed(2, "NAME-OR-IP")
    finally:
        remove(ctld, uid)


# --------------------------------------------------------------------------- vault


def test_vault_seal_and_requests(ctld: Daemon, tmp_path: Path) -> None:
    uid = "ctl-vault"
    policy_file, vault_file, key_file = tmp_path / "p.json", tmp_path / "v.json", tmp_path / f"{KID}.key"
    policy_file.write_text(json.dumps(POLICY))
    vault_file.write_text(json.dumps(VAULT))
    key_file.write_bytes(KEY)
    seal = ("vault", "seal", "--uid", uid, "--policy-file", str(policy_file))
    try:
        # seal (local): human = the input string; --json = {"input", "kid"}.
        text = ctl(ctld, *seal, "--vault-file", str(vault_file), "--key-file", str(key_file)).ok().out
        assert SECRET not in text and json.loads(text)["osbEgressInput"] == 1
        doc = (
            ctl(ctld, "--json", *seal, "--vault-file", str(vault_file), "--key-file", str(key_file))
            .ok()
            .json()
        )
        assert set(doc) == {"input", "kid"} and doc["kid"] == KID and isinstance(doc["input"], str)
        assert ctl(ctld, "--json", *seal).ok().json()["kid"] is None
        out_file = tmp_path / "input.txt"
        r = ctl(
            ctld, *seal, "--vault-file", str(vault_file), "--key-file", str(key_file), "--out", str(out_file)
        )
        assert (r.code, r.out) == (0, "")
        ctl(ctld, *seal, "--vault-file", str(vault_file)).failed(2, "--key-file")

        # The sealed input opens in the daemon: the subject gets vault revision 1.
        bind(ctld, uid, 2, "--input-file", str(out_file))
        ctl(ctld, "send", "hook", "data-plane-ready", "--uid", uid).ok()
        assert subject(ctld, uid)["vaultRevision"] == 1

        # get: key/value metadata, never the value; --json = {"code", "body"}.
        r = ctl(ctld, "vault", "get", "--uid", uid).ok()
        fields = kv(r.out)
        assert fields["revision"] == "1" and fields["credentials.tok.sourceType"] == "inline"
        assert fields["bindings.b.auth.type"] == "bearer" and fields["bindings.b.match.hosts"] == "a.test"
        doc = ctl(ctld, "--json", "vault", "get", "--uid", uid).ok().json()
        assert doc["code"] == 200 and doc["body"]["revision"] == 1
        assert [c["name"] for c in doc["body"]["credentials"]] == ["tok"]
        doc = ctl(ctld, "--json", "vault", "get", "--uid", uid, "--path", "credentials/tok").ok().json()
        assert doc["body"]["name"] == "tok"
        doc = (
            ctl(ctld, "--json", "vault", "get", "--uid", uid, "--path", "bindings", "--suffix-only")
            .ok()
            .json()
        )
        assert [b["name"] for b in doc["body"]["bindings"]] == ["b"]

        # put (same content: 200 unchanged), patch (rev+1), delete, post (rev 1 again).
        body = tmp_path / "body.json"
        body.write_text(json.dumps(VAULT))
        r = ctl(ctld, "vault", "put", "--uid", uid, "--file", str(body)).ok()
        assert r.out.startswith("200 OK\n") and SECRET not in r.out
        patch = {
            "expectedRevision": 1,
            "credentials": {"replace": [{"name": "tok", "source": {"value": "x2"}}]},
        }
        doc = (
            ctl(ctld, "--json", "vault", "patch", "--uid", uid, "--file", "-", stdin=json.dumps(patch))
            .ok()
            .json()
        )
        assert doc["code"] == 200 and doc["body"]["revision"] == 2
        r = ctl(ctld, "vault", "patch", "--uid", uid, "--file", "-", stdin=json.dumps(patch))
        r.failed(1, "409 ")
        assert r.out.startswith("409 Conflict\n")
        r = ctl(ctld, "vault", "post", "--uid", uid, "--file", str(body)).failed(1, "409 ")
        assert (
            ctl(ctld, "--json", "vault", "post", "--uid", uid, "--file", str(body)).failed(1).json()["code"]
            == 409
        )
        assert ctl(ctld, "vault", "delete", "--uid", uid).ok().out == "204 No Content\n"
        doc = ctl(ctld, "--json", "vault", "get", "--uid", uid).failed(1, "404 ").json()
        assert doc["code"] == 404 and isinstance(doc["body"], str)
        r = ctl(ctld, "vault", "get", "--uid", uid).failed(1, "404 ")
        assert r.out.startswith("404 Not Found\n")
        doc = ctl(ctld, "--json", "vault", "post", "--uid", uid, "--file", str(body)).ok().json()
        assert doc["code"] == 201 and doc["body"]["revision"] == 1
        assert ctl(ctld, "--json", "vault", "delete", "--uid", uid).ok().json() == {"code": 204, "body": ""}
        assert subject(ctld, uid)["vaultRevision"] is None
    finally:
        remove(ctld, uid)
    assert SECRET not in ctld.log_text()


# --------------------------------------------------------------------------- ca


def test_ca_without_mitm_is_one_error_line(ctld: Daemon) -> None:
    for argv in (("ca",), ("ca", "--json"), ("--json", "ca")):
        r = ctl(ctld, *argv).failed(1, "GET /v1/mitm/ca: 404 mitm disabled")
        assert r.out == ""


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    "argv",
    [
        ("status",),
        ("subjects",),
        ("explain", "10.203.0.11", "a.test"),
        ("send", "set-binding", "--uid", "u", "--ip", "10.203.0.11", "--policy", "{}"),
        ("send", "hook", "runtime-ready", "--uid", "u"),
        ("send", "remove", "--uid", "u"),
        ("send", "raw", "--file", "-"),
        ("vault", "put", "--uid", "u", "--file", "-"),
        ("vault", "post", "--uid", "u", "--file", "-"),
        ("vault", "patch", "--uid", "u", "--file", "-"),
        ("vault", "get", "--uid", "u"),
        ("vault", "delete", "--uid", "u"),
        ("ca",),
    ],
)
@pytest.mark.parametrize("as_json", [False, True])
def test_unreachable_daemon_is_exit_3(ctld: Daemon, argv: tuple[str, ...], as_json: bool) -> None:
    # Nothing listens on PORT + 1 in the pod namespace: refused.
    json_flag = ("--json",) if as_json else ()
    r = ctl(ctld, *json_flag, *argv, port=PORT + 1, stdin="{}").failed(3, "cannot reach egressd")
    assert r.out == ""


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (("bogus",), "invalid choice"),
        (("status", "--timeout", "0"), "--timeout"),
        (("explain", "10.203.0.11"), "NAME-OR-IP"),
        (("send", "set-binding", "--uid", "u", "--ip", "10.203.0.300"), "--ip"),
        (("send", "hook", "before-delete", "--uid", "u"), "unknown hook"),
        (("send", "remove"), "--uid"),
        (("send", "raw", "--file", "/nonexistent/envelope.json"), "cannot read"),
        (("vault", "get", "--uid", "u", "--path", "secrets"), "--path"),
        (("vault", "seal", "--uid", "u", "--policy-file", "/nonexistent/p.json"), "cannot read"),
        (("ca", "extra"), "unrecognized arguments"),
    ],
)
def test_usage_errors_are_exit_2(ctld: Daemon, argv: tuple[str, ...], fragment: str) -> None:
    for json_flag in ((), ("--json",)):
        r = ctl(ctld, *json_flag, *argv).failed(2, fragment)
        assert r.out == ""
