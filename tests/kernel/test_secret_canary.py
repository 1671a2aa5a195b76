"""Secret canary everywhere (issue 13 item 6): a unique credential value per input path, then a
search of everything egressd produced. Oracle: a canary appears ONLY in the request the
upstream echo received (``upstream.jsonl``) -- and only if its path is one that must inject.

Input paths (one random canary each, ``canary-<path>-<hex>``):

* fleet proxy route: PUT (path id), PATCH (suffix-only + ``X-Fast-Sandbox-Uid``, via egressctl),
  a refused POST (409), a PATCH with a stale ``expectedRevision`` (409); pending pushes for a
  not-yet-registered uid: one replayed at SET_BINDING, one dropped as generation-stale, one
  truncated (replay fails, only logged), a pending ``/policy`` push (discarded while denying),
  one for a uid that never registers;
* sealed vault in the binding input (``EGRESSD_VAULT_KEYS_DIR``): a valid wrapper (via
  egressctl), and refused ones: bad tag, AAD of another uid, unknown kid (canary in the
  plaintext and in the wrapper's policy);
* policy error paths: invalid SET_BINDING policies, an invalid fleet ``/policy`` POST/PATCH on
  an active subject, an invalid sidecar ``/policy``;
* malformed bodies: truncated JSON (envelope, fleet vault, sidecar vault), a vault whose
  binding is invalid next to a credential holding the canary, an uncovered binding host, a
  value under a mistyped key, bodies over 1 MiB (actions, fleet vault, sidecar vault);
* sidecar vault (``/credential-vault`` on a sidecar with the MITM): PUT and PATCH, plus a write
  without the token (401).

Searched: every HTTP response (status line, headers, body) egressd gave during the test
(including /metrics, /healthz, actions/status, /v1/subjects, /v1/explain, every GET of the
vault and its sub-resources, /policy), every egressctl stdout/stderr (``vault get`` included),
the responses the sandbox received through the MITM (headers and body: the MITM redacts both,
docs/reference/behaviour.md §10; the upstream's deliberate base64 copy in the echo's ``seen`` is left out),
the daemon logs (the MITM child's
lines are re-logged there), and every file under the topology work dir (MITM confdirs,
credential-proxy socket dirs, key dir, always-rules dirs, sidecar policy file, logs), the
daemons' and MITM children's cwd (files changed during the test) and every regular file they
hold open. The only file left out is ``upstream.jsonl``, the oracle itself.

Nothing the test writes carries a canary to disk: bodies go to curl/egressctl on stdin.
Own topology (own namespaces and upstream), so the work dir holds only this module's files;
the fleet daemon runs first, then (it drops unknown sources in the pod) the sidecar.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from egressd.vault.sealed import build_wrapper, seal
from tests.kernel.sidecar import TOKEN, Sidecar
from tests.kernel.topology import REPO, UPSTREAM_IPS, Daemon, Topology, cleanup_stale, decode_echo, envelope

CTL = str(REPO / ".venv" / "bin" / "egressctl")
API = "api.example.test"
API_IP = UPSTREAM_IPS[4]  # 10.204.0.6 in the zone
PORT = 18080  # our own pod namespace: nothing else listens there
MITM_PORT = 18181
TABLE = "egc-fleet"
DPR = "sandbox.data-plane-ready"
KID = "k1"
POLICY = {"defaultAction": "deny", "egress": [{"action": "allow", "target": API}]}
MIB = 1 << 20

# Paths whose canary must reach the upstream (injected by the MITM); every other canary must
# appear nowhere at all.
INJECTED = ("fleet-put", "fleet-patch", "fleet-pending", "sealed", "sidecar-put", "sidecar-patch")
REFUSED = (
    "fleet-post-409",
    "fleet-patch-stale",
    "fleet-pending-stale",
    "fleet-pending-truncated",
    "fleet-pending-policy",
    "fleet-pending-never",
    "fleet-truncated",
    "fleet-binding-error",
    "fleet-uncovered",
    "fleet-mistyped-key",
    "fleet-over-limit",
    "fleet-absent-over-limit",
    "sealed-bad-tag",
    "sealed-aad",
    "sealed-unknown-kid",
    "policy-setbinding",
    "policy-setbinding-json",
    "policy-setbinding-idna",
    "policy-fleet-post",
    "policy-fleet-patch",
    "envelope-truncated",
    "envelope-over-limit",
    "sidecar-truncated",
    "sidecar-binding-error",
    "sidecar-over-limit",
    "sidecar-no-token",
    "sidecar-policy",
    "sidecar-policy-idna",
)
CANARY = {name: f"canary-{name}-{secrets.token_hex(8)}" for name in INJECTED + REFUSED}


def j(doc: object) -> bytes:
    return json.dumps(doc).encode()


def forms(value: str) -> list[bytes]:
    """The byte strings that count as the canary: raw, base64 and hex of it."""
    raw = value.encode()
    return [raw, base64.b64encode(raw), raw.hex().encode()]


def cred(name: str, canary: str) -> dict[str, Any]:
    return {"name": name, "source": {"type": "inline", "value": CANARY[canary]}}


def bearer(name: str, path: str, credential: str, host: str = API) -> dict[str, Any]:
    return {
        "name": name,
        "match": {"hosts": [host], "paths": [path]},
        "auth": {"type": "bearer", "credential": credential},
    }


def vault(name: str, canary: str, path: str = "/v1/*") -> dict[str, Any]:
    return {"credentials": [cred(name, canary)], "bindings": [bearer(name, path, name)]}


def over_limit(canary: str) -> bytes:
    # The canary at both ends: whatever part of a refused body someone kept, it has one.
    doc = json.dumps(vault("big", canary))
    return (doc[:-1] + ', "pad": "' + "x" * MIB + '", "tail": "' + CANARY[canary] + '"}').encode()


@dataclass
class Recorder:
    """Everything egressd said during the test: (label, bytes)."""

    seen: list[tuple[str, bytes]] = field(default_factory=list)

    def add(self, label: str, data: bytes | str) -> None:
        self.seen.append((label, data.encode() if isinstance(data, str) else data))


@dataclass
class Env:
    topo: Topology
    rec: Recorder
    started: float
    keys: Path
    key: bytes
    pids: set[int] = field(default_factory=set)  # daemons and MITM children, for the /proc scan
    extra_files: dict[str, bytes] = field(default_factory=dict)  # read while the process ran

    def http(
        self,
        ns: str,
        method: str,
        url: str,
        body: bytes | None = None,
        headers: tuple[str, ...] = (),
        *,
        label: str = "",
    ) -> tuple[int, str]:
        """curl inside ``ns``; the body goes over stdin, the whole answer into the recorder."""
        args = ["ip", "netns", "exec", ns, "curl", "-s", "-i", "-m", "15", "-X", method, "-H", "Expect:"]
        for h in headers:
            args += ["-H", h]
        if body is not None:
            args += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
        args += ["-w", "\n%{http_code}", url]
        r = subprocess.run(args, input=body, capture_output=True, timeout=30, check=False)
        out = r.stdout
        self.rec.add(f"http {method} {url} {label}", out + r.stderr)
        raw, _, code = out.rpartition(b"\n")
        _, _, text = raw.partition(b"\r\n\r\n")
        return (int(code) if code.strip().isdigit() else 0), text.decode(errors="replace")

    def fleet(self, method: str, path: str, body: bytes | None = None, *headers: str) -> tuple[int, str]:
        return self.http(self.topo.pod, method, f"http://127.0.0.1:{PORT}{path}", body, headers)

    def vault_url(self, uid: str, sub: str = "") -> str:
        return f"/v1/sandboxfleets/{uid}/egress/credential-vault{sub}"

    def act(self, doc: dict[str, Any] | bytes) -> tuple[int, str]:
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        return self.fleet("POST", "/_fastlet/v1/actions", body)

    def ctl(self, *args: str, stdin: bytes | None = None) -> tuple[int, str]:
        r = subprocess.run(
            ["ip", "netns", "exec", self.topo.pod, CTL, "--addr", f"127.0.0.1:{PORT}", *args],
            input=stdin,
            capture_output=True,
            timeout=30,
            check=False,
        )
        self.rec.add(f"egressctl {' '.join(args)}", r.stdout + r.stderr)
        return r.returncode, r.stdout.decode(errors="replace")

    def sandbox_https(self, ns: str, ca: Path, path: str, *headers: str) -> tuple[int, dict[str, Any], bytes]:
        """One HTTPS request from a sandbox namespace through the MITM: (code, echo, headers)."""
        args = ["ip", "netns", "exec", ns, "curl", "-s", "-i", "-m", "5", "--cacert", str(ca)]
        args += ["--resolve", f"{API}:443:{API_IP}", "-w", "\n%{http_code}"]
        for h in headers:
            args += ["-H", h]
        r = subprocess.run([*args, f"https://{API}{path}"], capture_output=True, timeout=20, check=False)
        raw, _, code = r.stdout.rpartition(b"\n")
        head, _, body = raw.partition(b"\r\n\r\n")
        # What the sandbox received: headers and body, both redacted by the MITM; the body is the
        # upstream's echo, searched without its ``seen`` field (the test upstream's deliberate
        # base64 copy of what it received, the oracle read below).
        self.rec.add(f"sandbox response headers {ns} {path}", head)
        plain = json.loads(body) if body.startswith(b"{") else {}
        self.rec.add(f"sandbox response body {ns} {path}", json.dumps({k: v for k, v in plain.items() if k != "seen"}))
        echo = decode_echo(body)
        return (int(code) if code.strip().isdigit() else 0), echo, head

    def snapshot_files(self, when: str) -> None:
        """Read every regular file of the work dir now: some go away with their process (the
        sidecar's policy file is removed at clean-up, sockets at shutdown)."""
        for path in _walk(self.topo.workdir):
            if path != self.topo.upstream_log:
                self.extra_files[f"{when}: {path}"] = path.read_bytes()

    def snapshot_proc(self, pid: int) -> None:
        """Remember the pid; read the regular files it holds open now (they may go away)."""
        self.pids.add(pid)
        for path in _open_files(pid):
            try:
                self.extra_files[f"open by {pid}: {path}"] = path.read_bytes()[: 64 * MIB]
            except OSError:
                continue


def _open_files(pid: int) -> list[Path]:
    out: list[Path] = []
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return out
    for fd in fds:
        try:
            target = Path(os.readlink(fd))
        except OSError:
            continue
        if target.is_absolute() and target.is_file() and not str(target).startswith(("/proc", "/dev")):
            out.append(target)
    return out


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _egressd_pids(proc: subprocess.Popen[bytes] | subprocess.Popen[str] | None) -> list[int]:
    """The daemon under ``ip netns exec`` (it execs, same pid) and its MITM children."""
    if proc is None:
        return []
    return [proc.pid, *_children(proc.pid)]


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ctopo() -> Iterator[Topology]:
    cleanup_stale()
    t = Topology(prefix=f"egc{os.getpid()}", sandboxes=4).up_()
    try:
        yield t
    finally:
        t.down()


@pytest.fixture
def env(ctopo: Topology) -> Env:
    keys = ctopo.workdir / "sealed-keys"
    keys.mkdir(exist_ok=True)
    key = secrets.token_bytes(32)
    (keys / f"{KID}.key").write_bytes(key)
    os.chmod(keys / f"{KID}.key", 0o400)
    return Env(ctopo, Recorder(), time.time(), keys, key)


def fleet_daemon(env: Env) -> Daemon:
    w = env.topo.workdir
    return Daemon(
        env.topo,
        table=TABLE,
        port=PORT,
        env={
            "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
            "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(MITM_PORT),
            "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(env.topo.tls_dir / "trust"),
            "EGRESSD_MITM_CONFDIR": str(w / "mitm-conf"),
            "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(w / "mitm-run" / "active.sock"),
            "EGRESSD_VAULT_KEYS_DIR": str(env.keys),
            "EGRESSD_LOG_FORMAT": "json",
            # Debug: the most the daemon would ever write to its log.
            "OPENSANDBOX_EGRESS_LOG_LEVEL": "debug",
        },
    )


def bind(env: Env, uid: str, sb: int, policy: object = POLICY, generation: int = 1) -> None:
    doc = envelope("SET_BINDING", uid, ip=Topology.sb_ip(sb), policy=policy, generation=generation)
    assert env.act(doc) == (200, "{}")
    assert env.act(envelope("LIFECYCLE_HOOK", uid, hook=DPR, generation=generation)) == (200, "{}")


def ctl_bind(env: Env, uid: str, sb: int, wrapper: dict[str, Any]) -> tuple[int, str]:
    """``egressctl send set-binding`` with the binding input on stdin (never in a file)."""
    args = ("send", "set-binding", "--uid", uid, "--ip", Topology.sb_ip(sb), "--input-file", "-")
    return env.ctl(*args, stdin=json.dumps(wrapper).encode())


def sealed_input(
    env: Env, uid: str, canary: str, *, aad_uid: str | None = None, kid: str = KID
) -> dict[str, Any]:
    plain = json.dumps(vault("tok", canary)).encode()
    return build_wrapper(POLICY, seal(plain, aad_uid or uid, kid, env.key))


def test_secret_canary_everywhere(env: Env) -> None:
    topo = env.topo
    d = fleet_daemon(env)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=30)
        for pid in _egressd_pids(d.proc):
            env.snapshot_proc(pid)
        fleet_paths(env)
        drive_fleet_traffic(env)
        fleet_reads(env)
        for pid in _egressd_pids(d.proc):
            env.snapshot_proc(pid)
        env.snapshot_files("fleet running")
    finally:
        if d.proc is not None:
            topo.stop(d.proc)
        d.nft("delete", "table", "inet", TABLE, check=False)
    sc = Sidecar(topo, sb=4).with_mitm()
    sc.env.update({"OPENSANDBOX_EGRESS_LOG_LEVEL": "debug"})
    sc.start()
    try:
        for pid in _egressd_pids(sc.proc):
            env.snapshot_proc(pid)
        sidecar_paths(env, sc)
        for pid in _egressd_pids(sc.proc):
            env.snapshot_proc(pid)
        env.snapshot_files("sidecar running")
        assert API in sc.policy_file.read_text()  # the persisted policy is in what was searched
    finally:
        sc.kill(signal.SIGTERM)
        sc.cleanup()
    check_oracle(env, d, sc)


# ---- fleet ----------------------------------------------------------------------------------


def fleet_paths(env: Env) -> None:

    # Pending pushes for "cn-pend" (not registered yet), in arrival order: generation-stale
    # (dropped at SET_BINDING generation 2), the good one, a truncated one (its replay fails and
    # is only logged), a /policy push (discarded: the binding input is authoritative).
    url = env.vault_url("cn-pend")
    stale = j(vault("tok", "fleet-pending-stale"))
    assert env.fleet("PUT", url, stale, "X-Fast-Sandbox-Generation: 1")[0] == 202
    assert env.fleet("PUT", url, j(vault("tok", "fleet-pending")), "X-Fast-Sandbox-Generation: 2")[0] == 202
    assert env.fleet("PUT", url, j(vault("tok", "fleet-pending-truncated"))[:-3])[0] == 202
    pending_policy = {
        "defaultAction": "deny",
        "egress": [{"action": "allow", "target": CANARY["fleet-pending-policy"] + ".test"}],
    }
    code, body = env.fleet("POST", "/v1/sandboxfleets/cn-pend/egress/policy", j(pending_policy))
    assert code == 202 and "pending" in body
    # A uid that never registers: the push expires in memory.
    assert env.fleet("PUT", env.vault_url("cn-never"), j(vault("tok", "fleet-pending-never")))[0] == 202
    # Over 1 MiB for an absent uid: refused, not cached.
    assert env.fleet("PUT", env.vault_url("cn-never"), over_limit("fleet-absent-over-limit"))[0] == 413

    # Policy error paths on SET_BINDING (nothing registered), and a truncated/over-limit envelope.
    for text in (
        json.dumps({"egress": [{"action": "allow", "target": CANARY["policy-setbinding"] + "/x"}]}),
        '{"egress":[{"action":"allow","target":"' + CANARY["policy-setbinding-json"],  # JSON syntax
        # Not valid IDNA 2008: the idna library's own reason quotes the label.
        json.dumps(
            {"egress": [{"action": "deny", "target": CANARY["policy-setbinding-idna"] + "\u2603.test"}]}
        ),
    ):
        assert env.act(envelope("SET_BINDING", "cn-bad", ip=Topology.sb_ip(1), policy=text))[0] == 400
    doc = envelope(
        "SET_BINDING", "cn-bad", ip=Topology.sb_ip(1), policy=json.dumps(vault("t", "envelope-truncated"))
    )
    assert env.act(j(doc)[:-4])[0] == 400
    big = envelope(
        "SET_BINDING", "cn-bad", ip=Topology.sb_ip(1), policy=over_limit("envelope-over-limit").decode()
    )
    assert env.act(big)[0] == 413

    # Sealed wrappers for "cn-seal": refused ones first (state untouched), then the good one
    # through egressctl (stdin), as an operator would send it.
    good = sealed_input(env, "cn-seal", "sealed")
    bad_tag = sealed_input(env, "cn-seal", "sealed-bad-tag")
    ct = bytearray(base64.b64decode(bad_tag["vault"]["ct"]))
    ct[-1] ^= 0x01
    bad_tag["vault"]["ct"] = base64.b64encode(bytes(ct)).decode()
    aad = sealed_input(env, "cn-seal", "sealed-aad", aad_uid="cn-other")
    unknown = sealed_input(env, "cn-seal", "sealed-unknown-kid", kid="k9")
    unknown["policy"] = {
        "defaultAction": "deny",
        "egress": [{"action": "allow", "target": CANARY["sealed-unknown-kid"] + ".test"}],
    }
    bad_tag["policy"] = {
        "defaultAction": "deny",
        "egress": [{"action": "allow", "target": CANARY["sealed-bad-tag"] + ".test"}],
    }
    for wrapper in (bad_tag, aad, unknown):
        code, out = ctl_bind(env, "cn-seal", 3, wrapper)
        assert code == 1 and out.startswith("400"), out
    assert (
        env.act(envelope("SET_BINDING", "cn-seal", ip=Topology.sb_ip(3), policy=json.dumps(unknown)))[0]
        == 400
    )
    code, out = ctl_bind(env, "cn-seal", 3, good)
    assert code == 0, out
    assert env.act(envelope("LIFECYCLE_HOOK", "cn-seal", hook=DPR)) == (200, "{}")

    # "cn-pend" registers at generation 2: the stale push is dropped, the good one replayed.
    bind(env, "cn-pend", 2, generation=2)
    code, body = env.fleet("GET", env.vault_url("cn-pend"))
    assert code == 200 and json.loads(body)["revision"] == 1, body
    code, body = env.fleet("GET", "/v1/sandboxfleets/cn-pend/egress/policy")
    assert code == 200 and CANARY["fleet-pending-policy"] not in body

    # "cn-put": active, then the proxy-route writes.
    bind(env, "cn-put", 1)
    url = env.vault_url("cn-put")
    assert env.fleet("PUT", url, j(vault("put", "fleet-put", "/put/*")))[0] == 201
    assert env.fleet("POST", url, j(vault("other", "fleet-post-409", "/post/*")))[0] == 409
    patch = {
        "credentials": {"add": [cred("patch", "fleet-patch")]},
        "bindings": {
            "add": [
                {
                    "name": "patch",
                    "match": {"hosts": [API], "paths": ["/patch/*"]},
                    "auth": {"type": "apiKey", "name": "X-Api-Key", "credential": "patch"},
                }
            ]
        },
    }
    stale_patch = {"expectedRevision": 7, "credentials": {"add": [cred("stale", "fleet-patch-stale")]}}
    assert env.fleet("PATCH", url, j(stale_patch))[0] == 409
    code, out = env.ctl("vault", "patch", "--uid", "cn-put", "--suffix-only", "--file", "-", stdin=j(patch))
    assert code == 0, out
    # Malformed vault bodies for an active subject.
    assert env.fleet("PUT", url, j(vault("put", "fleet-truncated"))[:-2])[0] == 400
    bad_binding = vault("put", "fleet-binding-error")
    bad_binding["bindings"][0]["match"]["hosts"] = ["not a host/"]
    assert env.fleet("PUT", url, j(bad_binding))[0] == 400
    assert (
        env.fleet(
            "PUT",
            url,
            j(vault("put", "fleet-uncovered") | {"bindings": [bearer("put", "/*", "put", "b.test")]}),
        )[0]
        == 400
    )
    mistyped = {
        "credentials": [{"name": "put", "source": {"type": "inline", "vlaue": CANARY["fleet-mistyped-key"]}}],
        "bindings": [],
    }
    assert env.fleet("PUT", url, j(mistyped))[0] == 400
    assert env.fleet("PUT", url, over_limit("fleet-over-limit"))[0] == 413
    # Invalid /policy edits on the active subject.
    bad = {"egress": [{"action": "allow", "target": "a*" + CANARY["policy-fleet-post"] + ".test"}]}
    assert env.fleet("POST", "/v1/sandboxfleets/cn-put/egress/policy", j(bad))[0] == 400
    bad_patch = [{"action": CANARY["policy-fleet-patch"], "target": "x.test"}]
    assert env.fleet("PATCH", "/policy", j(bad_patch), "X-Fast-Sandbox-Uid: cn-put")[0] == 400


def drive_fleet_traffic(env: Env) -> None:
    topo = env.topo
    ca = topo.workdir / "mitm-conf" / "mitmproxy-ca-cert.pem"
    for sb in (1, 2, 3):
        status, answers = topo.dig(sb, API)
        assert status == "NOERROR" and answers, (sb, status)
    for sb, path, name, header in (
        (1, "/put/x", "fleet-put", "Authorization"),
        (1, "/patch/x", "fleet-patch", "X-Api-Key"),
        (2, "/v1/x", "fleet-pending", "Authorization"),
        (3, "/v1/x", "sealed", "Authorization"),
    ):
        code, echo, head = env.sandbox_https(topo.sb(sb), ca, path)
        assert code == 200, (name, code)
        assert CANARY[name] in str(echo.get("headers", {}).get(header)), (name, echo)
        assert CANARY[name].encode() not in head, f"{name}: the echoed header was not redacted"


def fleet_reads(env: Env) -> None:
    for uid in ("cn-put", "cn-pend", "cn-seal"):
        for sub in ("", "/credentials", "/bindings"):
            code, body = env.fleet("GET", env.vault_url(uid, sub))
            assert code == 200, (uid, sub, body)
        for method in ("GET", "PUT"):  # sub-resources are GET-only (405 names what is allowed)
            env.fleet(method, env.vault_url(uid, "/credentials/tok"))
        env.fleet("GET", env.vault_url(uid, "/bindings/tok"))
        env.fleet("GET", f"/v1/sandboxfleets/{uid}/egress/policy")
    env.fleet("GET", env.vault_url("cn-put", "/credentials/put"))
    env.fleet("GET", env.vault_url("cn-put", "/credentials/patch"))
    env.fleet("GET", "/credential-vault/_active")
    for path in ("/metrics", "/healthz", "/_fastlet/v1/actions/status", "/v1/subjects", "/v1/mitm/ca"):
        assert env.fleet("GET", path)[0] == 200, path
    env.http(
        env.topo.pod,
        "GET",
        f"http://127.0.0.1:{PORT}/metrics",
        headers=("Accept: application/openmetrics-text",),
    )
    env.fleet("GET", f"/v1/explain?ip={Topology.sb_ip(1)}&target={API}")
    env.fleet("GET", f"/v1/explain?ip={Topology.sb_ip(1)}&target={API_IP}")
    for args in (
        ("status",),
        ("subjects",),
        ("explain", Topology.sb_ip(1), API),
        ("vault", "get", "--uid", "cn-put"),
        ("vault", "get", "--uid", "cn-seal", "--path", "credentials"),
        ("vault", "get", "--uid", "cn-pend", "--path", "credentials/tok"),
    ):
        env.ctl(*args)
        env.ctl("--json", *args)


# ---- sidecar --------------------------------------------------------------------------------


def sidecar_paths(env: Env, sc: Sidecar) -> None:
    url = f"http://127.0.0.1:{sc.port}"
    auth = f"OPENSANDBOX-EGRESS-AUTH: {TOKEN}"

    def call(method: str, path: str, body: bytes | None = None, token: bool = True) -> tuple[int, str]:
        return env.http(sc.ns, method, url + path, body, (auth,) if token else ())

    assert call("POST", "/policy", j(POLICY))[0] == 200  # persisted to the policy file (no canary)
    bad_policy = {"egress": [{"action": "allow", "target": CANARY["sidecar-policy"] + "/99"}]}
    assert call("POST", "/policy", j(bad_policy))[0] == 400
    bad_idna = [{"action": "allow", "target": CANARY["sidecar-policy-idna"] + "\u200d.test"}]
    assert call("PATCH", "/policy", j(bad_idna))[0] == 400
    assert call("PUT", "/credential-vault", j(vault("put", "sidecar-no-token")), token=False)[0] == 401
    assert call("PUT", "/credential-vault", j(vault("put", "sidecar-truncated"))[:-2])[0] == 400
    bad_binding = vault("put", "sidecar-binding-error")
    bad_binding["bindings"][0]["auth"] = {"type": "bearer", "credential": "missing"}
    assert call("PUT", "/credential-vault", j(bad_binding))[0] == 400
    assert call("PUT", "/credential-vault", over_limit("sidecar-over-limit"))[0] == 413
    code, body = call("PUT", "/credential-vault", j(vault("put", "sidecar-put", "/put/*")))
    assert code == 201, body
    patch = {
        "credentials": {"add": [cred("patch", "sidecar-patch")]},
        "bindings": {"add": [bearer("patch", "/patch/*", "patch")]},
    }
    assert call("PATCH", "/credential-vault", j(patch))[0] == 200
    for path in (
        "/credential-vault",
        "/credential-vault/credentials",
        "/credential-vault/bindings",
        "/credential-vault/credentials/put",
        "/credential-vault/bindings/patch",
        "/policy",
    ):
        assert call("GET", path)[0] == 200, path
    for path in ("/healthz", "/metrics"):
        assert call("GET", path, token=False)[0] == 200, path

    assert sc.dig(API)[0] == "NOERROR"
    ca = sc.mitm_confdir / "mitmproxy-ca-cert.pem"
    for path, name in (("/put/x", "sidecar-put"), ("/patch/x", "sidecar-patch")):
        code, echo, head = env.sandbox_https(sc.ns, ca, path)
        assert code == 200, (name, code)
        assert echo.get("headers", {}).get("Authorization") == f"Bearer {CANARY[name]}", echo
        assert CANARY[name].encode() not in head
    call("GET", "/metrics", token=False)


# ---- oracle ---------------------------------------------------------------------------------


def _walk(root: Path) -> Iterator[Path]:
    # Bounded: the work dir of one module; symlinks are not followed.
    for dirpath, _dirs, files in os.walk(root, followlinks=False):
        for f in files:
            p = Path(dirpath) / f
            if p.is_file() and not p.is_symlink():
                yield p


def _cwd_files(env: Env) -> dict[str, bytes]:
    """Files changed during the test in the processes' working directories (not .git/.venv)."""
    out: dict[str, bytes] = {}
    cwds = set()
    for pid in env.pids:
        try:
            cwds.add(Path(os.readlink(f"/proc/{pid}/cwd")))
        except OSError:
            continue
    cwds.add(Path.cwd())  # the daemons are gone by now; they inherited ours
    for cwd in cwds:
        for dirpath, dirs, files in os.walk(cwd, followlinks=False):
            dirs[:] = [x for x in dirs if x not in (".git", ".venv", "node_modules", "__pycache__")]
            for f in files:
                p = Path(dirpath) / f
                try:
                    if p.is_file() and p.stat().st_mtime >= env.started - 1:
                        out[str(p)] = p.read_bytes()[: 64 * MIB]
                except OSError:
                    continue
    return out


def _json_line(line: str) -> dict[str, Any]:
    try:
        doc = json.loads(line)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def check_oracle(env: Env, d: Daemon, sc: Sidecar) -> None:
    topo = env.topo
    upstream = topo.upstream_log.read_bytes()
    for name in INJECTED:
        assert CANARY[name].encode() in upstream, f"{name} was never injected: the search proves nothing"
    for name in REFUSED:
        assert CANARY[name].encode() not in upstream, f"{name} reached the upstream"

    # A list, not a dict: many answers share a label (every POST to the actions path).
    haystacks: list[tuple[str, bytes]] = list(env.rec.seen)
    for path in _walk(topo.workdir):
        if path == topo.upstream_log:
            continue  # the oracle: where injected canaries belong
        haystacks.append((f"file {path}", path.read_bytes()))
    haystacks += env.extra_files.items()
    haystacks += [(f"cwd {k}", v) for k, v in _cwd_files(env).items()]
    # The logs must exist and carry the events (else an empty log would pass).
    fleet_log = d.log_text()
    assert '"mitm.injected"' in fleet_log and '"pending.replayed"' in fleet_log, fleet_log[-3000:]
    assert '"mitm.injected"' in sc.log_text(), sc.log_text()[-3000:]
    # The pending paths went where they should: the stale push dropped unreplayed, the good one
    # applied (201), the truncated one failed (400, only logged), the /policy one discarded (202).
    replayed = [_json_line(ln) for ln in fleet_log.splitlines() if '"pending.replayed"' in ln]
    assert sorted(e.get("code", 0) for e in replayed) == [201, 202, 400], replayed
    assert any(label.startswith("file ") and label.endswith(".log") for label, _ in haystacks)

    leaks = [
        f"{name} in {label}"
        for name, value in CANARY.items()
        for label, data in haystacks
        if any(form in data for form in forms(value))
    ]
    print(f"secret canary: {len(CANARY)} canaries, {len(haystacks)} outputs and files searched")
    assert not leaks, "canary leaked:\n" + "\n".join(leaks)
    assert len(haystacks) > 100, sorted(label for label, _ in haystacks)  # the search covered what it claims
