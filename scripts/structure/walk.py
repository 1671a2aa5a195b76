"""Walk one SET_BINDING, one data-plane-ready LIFECYCLE_HOOK and one DNS answer through a real
fleet egressd of TREE, recording the egressd functions called (traced_egressd.py).

    python3 walk.py TREE OUTDIR [--reps 3] [--settle 0.3]

Topology (everything in our own namespaces egwalk<pid>-{pod,up,sb1}; nothing in the root
namespace; removed on any exit):

    sb1 10.203.0.11 --veth-- pod br0 10.203.0.1 (egressd) | uplink 10.204.0.1 --veth-- up 10.204.0.2..9

The upstream (TREE/scripts/fleet_upstream.py) serves a zone: warm.allowed.test and
q<k>.allowed.test, each its own address. Sequence:

  warm-up: SET_BINDING uid "warm" (ip 10.203.0.11 = sb1, policy P), data-plane-ready "warm",
           dig @10.203.0.1 warm.allowed.test from sb1
  idle:    <reps> windows with no request (the periodic-task noise floor)
  rep k:   window[SET_BINDING uid "w<k>" (ip 10.203.0.<11+k>, policy P)]
           window[LIFECYCLE_HOOK sandbox.data-plane-ready uid "w<k>"]
           window[dig @10.203.0.1 q<k>.allowed.test from sb1 (subject "warm")]

A window = SIGUSR1 (recorder on) .. request (response received) .. settle .. SIGUSR2 (off).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
P = f"egwalk{os.getpid()}"
POD, UP, SB1 = f"{P}-pod", f"{P}-up", f"{P}-sb1"
CREATED: list[str] = []
PROCS: list[subprocess.Popen] = []
PORT = 18080
GW = "10.203.0.1"
POLICY = {
    "defaultAction": "deny",
    "egress": [
        {"action": "allow", "target": "*.allowed.test"},
        {"action": "allow", "target": "10.204.0.9"},
    ],
}
DPR = "sandbox.data-plane-ready"


def sh(*a: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(a), check=check, capture_output=True, text=True, timeout=timeout)


def ns(n: str, *a: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return sh("ip", "netns", "exec", n, *a, check=check, timeout=timeout)


def cleanup() -> None:
    for p in PROCS:
        with contextlib.suppress(Exception):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
    for n in reversed(CREATED):
        for pid in sh("ip", "netns", "pids", n, check=False).stdout.split():
            with contextlib.suppress(Exception):
                os.kill(int(pid), signal.SIGKILL)
        sh("ip", "netns", "del", n, check=False)
    CREATED.clear()
    PROCS.clear()


def add_ns(n: str) -> None:
    sh("ip", "netns", "add", n)
    CREATED.append(n)
    ns(n, "ip", "link", "set", "lo", "up")


def build() -> None:
    root_links = sh("ip", "-o", "link", "show").stdout.count("\n")
    add_ns(POD)
    add_ns(UP)
    add_ns(SB1)
    ns(POD, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    ns(POD, "ip", "link", "add", "br0", "type", "bridge")
    ns(POD, "ip", "addr", "add", f"{GW}/24", "dev", "br0")
    ns(POD, "ip", "link", "set", "br0", "up")
    ns(POD, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1")
    sh("ip", "link", "add", "uplink", "netns", POD, "type", "veth", "peer", "name", "eth0", "netns", UP)
    ns(POD, "ip", "addr", "add", "10.204.0.1/24", "dev", "uplink")
    ns(POD, "ip", "link", "set", "uplink", "up")
    for i in range(2, 10):
        ns(UP, "ip", "addr", "add", f"10.204.0.{i}/24", "dev", "eth0")
    ns(UP, "ip", "link", "set", "eth0", "up")
    ns(UP, "ip", "route", "add", "10.203.0.0/24", "via", "10.204.0.1")
    sh("ip", "link", "add", "vh1", "netns", POD, "type", "veth", "peer", "name", "eth0", "netns", SB1)
    ns(POD, "ip", "link", "set", "vh1", "master", "br0")
    ns(POD, "ip", "link", "set", "vh1", "up")
    ns(SB1, "ip", "addr", "add", "10.203.0.11/24", "dev", "eth0")
    ns(SB1, "ip", "link", "set", "eth0", "up")
    ns(SB1, "ip", "route", "add", "default", "via", GW)
    assert sh("ip", "-o", "link", "show").stdout.count("\n") == root_links, "root namespace gained a link"


def spawn(n: str, *cmd: str, env: dict[str, str] | None = None, log: Path) -> subprocess.Popen:
    out = open(log, "a")  # noqa: SIM115
    p = subprocess.Popen(["ip", "netns", "exec", n, *cmd], stdout=out, stderr=out, env={**os.environ, **(env or {})})
    PROCS.append(p)
    return p


def curl(*a: str) -> tuple[int, str]:
    r = ns(POD, "curl", "-s", "-m", "10", "-w", "\n%{http_code}", *a, check=False)
    body, _, code = r.stdout.rpartition("\n")
    try:
        return int(code), body
    except ValueError:
        return 0, r.stdout


def envelope(op: str, uid: str, *, ip: str | None = None, policy: object = "__absent__", hook: str | None = None) -> dict:
    env: dict[str, object] = {  # as tests/kernel/topology.py envelope()
        "apiVersion": "sandbox.fast.io/actions/v1",
        "operation": op,
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": "r1", "attachmentId": "a1", "specGeneration": 1},
    }
    if ip is not None:
        env["attachment"] = {"network": {"ip": ip, "hostVeth": f"vh-{uid}", "gateway": GW}}
    if policy != "__absent__":
        env["binding"] = {"input": json.dumps(policy)}
    if hook is not None:
        env["hook"] = {"name": hook}
    return env


def post(work: Path, body: dict) -> tuple[int, str]:
    f = work / "body.json"
    f.write_text(json.dumps(body))
    return curl("-X", "POST", "-H", "Content-Type: application/json", "--data-binary", f"@{f}",
                f"http://127.0.0.1:{PORT}/_fastlet/v1/actions")


def dig(name: str) -> str:
    return ns(SB1, "dig", f"@{GW}", name, "A", "+time=2", "+tries=1", "+short", check=False, timeout=15).stdout.strip()


class Recorder:
    def __init__(self, walkdir: Path, pid: int, settle: float) -> None:
        self.dir, self.pid, self.settle = walkdir, pid, settle
        self.n = 0

    def _wait_state(self, want: str) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError):
                if (self.dir / "state").read_text() == want:
                    return
            time.sleep(0.005)
        raise RuntimeError(f"recorder never reached {want!r}")

    def window(self, action) -> tuple[object, dict]:
        os.kill(self.pid, signal.SIGUSR1)
        self._wait_state("on")
        result = action()
        time.sleep(self.settle)
        os.kill(self.pid, signal.SIGUSR2)
        self.n += 1
        self._wait_state(f"off {self.n}")
        return result, json.loads((self.dir / f"window-{self.n}.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("tree", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--settle", type=float, default=0.3)
    a = ap.parse_args()
    tree = a.tree.resolve()
    py = tree / ".venv" / "bin" / "python"
    assert py.exists(), py
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="egwalk-"))
    walkdir = work / "rec"
    walkdir.mkdir()
    atexit.register(lambda: shutil.rmtree(work, ignore_errors=True))
    atexit.register(cleanup)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda *_: sys.exit(130))

    build()
    reps = a.reps
    zone = [{"name": "warm.allowed.test", "type": "A", "value": "10.204.0.2", "ttl": 30}]
    zone += [{"name": f"q{k}.allowed.test", "type": "A", "value": f"10.204.0.{2 + k}", "ttl": 30} for k in range(1, reps + 1)]
    (work / "zone.json").write_text(json.dumps({"records": zone}))
    spawn(UP, str(py), str(tree / "scripts" / "fleet_upstream.py"), "--http-ports", "80",
          "--zone", str(work / "zone.json"), "--log", str(work / "upstream.jsonl"), log=work / "upstream.out")
    for _ in range(150):
        if "ready" in (work / "upstream.out").read_text():
            break
        time.sleep(0.1)
    else:
        raise RuntimeError("upstream not ready: " + (work / "upstream.out").read_text()[-2000:])

    rules = work / "rules"
    rules.mkdir()
    env = {  # as tests/kernel/topology.py Daemon.start
        "OPENSANDBOX_EGRESS_PROFILE": "fleet",
        "OPENSANDBOX_EGRESS_HTTP_ADDR": f"127.0.0.1:{PORT}",
        "EGRESSD_NFT_TABLE": "egwalk",
        "EGRESSD_ALWAYS_RULES_DIR": str(rules),
        "EGRESSD_DNS_ADDR": "0.0.0.0:15353",
        "OPENSANDBOX_EGRESS_DNS_UPSTREAM": "10.204.0.2:53",
        "OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT": "2",
        "EGRESSD_MITM_WORKERS": "1",
        "WALK_DIR": str(walkdir),
    }
    dlog = work / "egressd.log"
    spawn(POD, str(py), str(HERE / "traced_egressd.py"), env=env, log=dlog)
    deadline = time.monotonic() + 60
    while curl(f"http://127.0.0.1:{PORT}/healthz")[0] != 200:
        if time.monotonic() > deadline or PROCS[-1].poll() is not None:
            raise RuntimeError("egressd not ready: " + dlog.read_text()[-3000:])
        time.sleep(0.1)
    pid = int((walkdir / "pid").read_text())
    src = [ln for ln in dlog.read_text().splitlines() if ln.startswith("walk: egressd from")]
    print(src[0] if src else "walk: (egressd path not logged)", file=sys.stderr)
    rec = Recorder(walkdir, pid, a.settle)

    def must(code_body: tuple[int, str], what: str) -> None:
        assert code_body[0] == 200, f"{what}: {code_body}"

    # warm-up
    must(post(work, envelope("SET_BINDING", "warm", ip="10.203.0.11", policy=POLICY)), "warm SET_BINDING")
    must(post(work, envelope("LIFECYCLE_HOOK", "warm", hook=DPR)), "warm DPR")
    got = dig("warm.allowed.test")
    assert got == "10.204.0.2", f"warm dig: {got!r}"
    time.sleep(1.0)

    results: dict[str, list] = {"idle": [], "set_binding": [], "hook": [], "dns": []}
    for _ in range(reps):
        _, w = rec.window(lambda: time.sleep(0.05))
        results["idle"].append(w)
    for k in range(1, reps + 1):
        r, w = rec.window(lambda k=k: post(work, envelope("SET_BINDING", f"w{k}", ip=f"10.203.0.{11 + k}", policy=POLICY)))
        must(r, f"SET_BINDING w{k}")
        results["set_binding"].append(w)
        r, w = rec.window(lambda k=k: post(work, envelope("LIFECYCLE_HOOK", f"w{k}", hook=DPR)))
        must(r, f"DPR w{k}")
        results["hook"].append(w)
        r, w = rec.window(lambda k=k: dig(f"q{k}.allowed.test"))
        assert r == f"10.204.0.{2 + k}", f"dig q{k}: {r!r}"
        results["dns"].append(w)
        time.sleep(0.3)
    q = [json.loads(ln).get("dns") for ln in (work / "upstream.jsonl").read_text().splitlines() if ln.strip()]
    out = {"tree": str(tree), "egressd": src[0] if src else None, "settle": a.settle, "upstream_queries": q,
           "windows": results}
    (a.out / "raw.json").write_text(json.dumps(out))
    shutil.copy(dlog, a.out / "egressd.log")
    print(f"walk: {sum(len(v) for v in results.values())} windows written to {a.out / 'raw.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        cleanup()
