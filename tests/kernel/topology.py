"""Throwaway network-namespace topology for kernel tests.

    sandboxes (sb1..sbN)            pod (egressd runs here)              upstream
    eth0 10.203.0.1x ---- vhN -- br0 10.203.0.1 | uplink 10.204.0.1 ---- eth0 10.204.0.2..9
         fd00:203::1x             fd00:203::1  | fd00:204::1             fd00:204::2..9

With ``routed=True`` there is no bridge: each sandbox has its own veth, the pod puts the
gateway addresses (/32, /128) on every ``vhN`` and routes each sandbox address (/32, /128) to
its veth (the Kata/TAP-like shape). Sandbox-to-sandbox traffic then crosses the pod's
prerouting, nat and forward hooks like upstream traffic.

Nothing is created in the root namespace: veth pairs are created with both ends directly
inside our namespaces, no namespace has a default route, and the upstream only routes back
to the sandbox subnet. Everything is removed in :meth:`Topology.down`, also after failures;
stale namespaces of a killed run (owner pid gone) are removed on the next start.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VENV_PY = REPO / ".venv" / "bin" / "python"
STATE_DIR = Path("/tmp/egressd-test-netns")

SB_NET = "10.203.0"
UP_NET = "10.204.0"
GATEWAY = f"{SB_NET}.1"
GATEWAY6 = "fd00:203::1"
UPSTREAM_IPS = [f"{UP_NET}.{i}" for i in range(2, 10)]
UPSTREAM_IPS6 = [f"fd00:204::{i}" for i in range(2, 10)]
DNS_UPSTREAM = f"{UP_NET}.2"

# The upstream's authoritative zone (scripts/fleet_upstream.py --zone).
ZONE: list[dict[str, object]] = [
    {"name": "a.test", "type": "A", "value": f"{UP_NET}.2", "ttl": 30},
    {"name": "b.test", "type": "A", "value": f"{UP_NET}.3", "ttl": 30},
    {"name": "www.a.test", "type": "CNAME", "value": "chain.test", "ttl": 30},
    {"name": "chain.test", "type": "CNAME", "value": "deep.test", "ttl": 30},
    {"name": "deep.test", "type": "A", "value": f"{UP_NET}.4", "ttl": 30},
    {"name": "example.test", "type": "A", "value": f"{UP_NET}.5", "ttl": 30},
    {"name": "api.example.test", "type": "A", "value": f"{UP_NET}.6", "ttl": 30},
    # The upstream offers HTTP/2 to SNIs starting with "h2." (scripts/upstream_streams.py).
    {"name": "h2.example.test", "type": "A", "value": f"{UP_NET}.6", "ttl": 30},
    {"name": "x.y.example.test", "type": "A", "value": f"{UP_NET}.7", "ttl": 30},
    {"name": "blocked-ip.test", "type": "A", "value": f"{UP_NET}.8", "ttl": 30},
    {"name": "short.test", "type": "A", "value": f"{UP_NET}.9", "ttl": 0},
    {"name": "v6.test", "type": "AAAA", "value": "fd00:204::2", "ttl": 30},
    {"name": "secret-exfil.test", "type": "A", "value": f"{UP_NET}.3", "ttl": 30},
    # évil.test as its A-label (docs/reference/behaviour.md §14.3): resolvable, so only a policy can block it.
    {"name": "xn--vil-9la.test", "type": "A", "value": f"{UP_NET}.3", "ttl": 30},
    # 3000 addresses for one name, the first an upstream (docs/reference/behaviour.md §14.4 x 14.5: an answer of
    # a few thousand records over TCP is learned up to the cap in one transaction).
    *(
        {"name": "big.test", "type": "A", "value": v, "ttl": 30}
        for v in [f"{UP_NET}.2"] + [f"10.210.{i // 250}.{i % 250 + 1}" for i in range(2999)]
    ),
    # One name, several addresses (lease-cap trimming, docs/reference/behaviour.md §14.4).
    {"name": "multi.test", "type": "A", "value": f"{UP_NET}.5", "ttl": 30},
    {"name": "multi.test", "type": "A", "value": f"{UP_NET}.6", "ttl": 30},
    {"name": "multi.test", "type": "A", "value": f"{UP_NET}.7", "ttl": 30},
]


def sh(
    *args: str, check: bool = True, timeout: float = 20, input_: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), check=check, capture_output=True, text=True, timeout=timeout, input=input_
    )


def netns_list() -> list[str]:
    out = sh("ip", "-j", "netns", "list", check=False).stdout.strip()
    if not out:
        return []
    return [n["name"] for n in json.loads(out)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_netns_processes(ns: str) -> None:
    pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def cleanup_stale() -> None:
    """Remove namespaces left by test runs whose owner process is gone."""
    if not STATE_DIR.is_dir():
        return
    for owner in STATE_DIR.glob("*.owner"):
        prefix = owner.stem
        try:
            pid = int(owner.read_text().strip())
        except ValueError:
            pid = -1
        if pid > 0 and _pid_alive(pid):
            continue
        for ns in netns_list():
            if ns.startswith(prefix + "-"):
                kill_netns_processes(ns)
                sh("ip", "netns", "del", ns, check=False)
        owner.unlink(missing_ok=True)


@dataclass
class Topology:
    prefix: str
    sandboxes: int = 3
    routed: bool = False
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="egressd-topo-")))
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    # Another upstream (same command line as scripts/fleet_upstream.py) and its zone, for
    # topologies of their own (tests/kernel/test_names_on_wire.py's CDN).
    upstream_script: Path | None = None
    zone: list[dict[str, object]] | None = None
    # The upstream's plain-HTTP and TLS ports.
    http_ports: str = "80,8080,853"
    https_ports: str = "443"

    @property
    def pod(self) -> str:
        return f"{self.prefix}-pod"

    @property
    def up(self) -> str:
        return f"{self.prefix}-up"

    def sb(self, i: int) -> str:
        return f"{self.prefix}-sb{i}"

    @staticmethod
    def sb_ip(i: int) -> str:
        return f"{SB_NET}.{10 + i}"

    @staticmethod
    def sb_ip6(i: int) -> str:
        return f"fd00:203::{10 + i:x}"

    @property
    def upstream_log(self) -> Path:
        return self.workdir / "upstream.jsonl"

    @property
    def tls_dir(self) -> Path:
        """The upstream's test CA (``ca.pem``) and its hashed trust directory (``trust/``)."""
        return self.workdir / "upstream-tls"

    def ns(
        self, ns: str, *cmd: str, check: bool = True, timeout: float = 20
    ) -> subprocess.CompletedProcess[str]:
        return sh("ip", "netns", "exec", ns, *cmd, check=check, timeout=timeout)

    # ---- build / teardown ------------------------------------------------------------------

    def up_(self) -> Topology:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{self.prefix}.owner").write_text(str(os.getpid()))
        root_links_before = sh("ip", "-o", "link", "show").stdout
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        # Safety invariant: the root namespace did not gain a link.
        assert sh("ip", "-o", "link", "show").stdout.count("\n") == root_links_before.count("\n")
        return self

    def _add_ns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.created.append(name)
        self.ns(name, "ip", "link", "set", "lo", "up")

    def _build(self) -> None:
        pod, up = self.pod, self.up
        self._add_ns(pod)
        self._add_ns(up)

        def p(*c: str) -> subprocess.CompletedProcess[str]:
            return self.ns(pod, *c)

        p("sysctl", "-qw", "net.ipv4.ip_forward=1")
        p("sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
        if not self.routed:
            p("ip", "link", "add", "br0", "type", "bridge")
            p("ip", "addr", "add", f"{GATEWAY}/24", "dev", "br0")
            p("ip", "addr", "add", f"{GATEWAY6}/64", "dev", "br0", "nodad")
            p("ip", "link", "set", "br0", "up")
            # Bridged sandbox-to-sandbox frames must traverse the inet forward hook.
            p("sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1")
            p("sysctl", "-qw", "net.bridge.bridge-nf-call-ip6tables=1")

        sh("ip", "link", "add", "uplink", "netns", pod, "type", "veth", "peer", "name", "eth0", "netns", up)
        p("ip", "addr", "add", f"{UP_NET}.1/24", "dev", "uplink")
        p("ip", "addr", "add", "fd00:204::1/64", "dev", "uplink", "nodad")
        p("ip", "link", "set", "uplink", "up")

        def u(*c: str) -> subprocess.CompletedProcess[str]:
            return self.ns(up, *c)

        for ip in UPSTREAM_IPS:
            u("ip", "addr", "add", f"{ip}/24", "dev", "eth0")
        for ip in UPSTREAM_IPS6:
            u("ip", "addr", "add", f"{ip}/64", "dev", "eth0", "nodad")
        u("ip", "link", "set", "eth0", "up")
        u("ip", "route", "add", f"{SB_NET}.0/24", "via", f"{UP_NET}.1")
        u("ip", "-6", "route", "add", "fd00:203::/64", "via", "fd00:204::1")

        for i in range(1, self.sandboxes + 1):
            self.add_sandbox(i)

        log = self.upstream_log
        log.touch()
        zone = self.workdir / "zone.json"
        zone.write_text(json.dumps({"records": ZONE if self.zone is None else self.zone}))
        self.spawn(
            up,
            str(VENV_PY),
            str(self.upstream_script or REPO / "scripts" / "fleet_upstream.py"),
            "--http-ports",
            self.http_ports,
            "--https-ports",
            self.https_ports,
            "--tls-dir",
            str(self.tls_dir),
            "--tls-ips",
            ",".join(UPSTREAM_IPS + UPSTREAM_IPS6),
            "--log",
            str(log),
            "--zone",
            str(zone),
            ready_line="ready",
        )

    def add_sandbox(self, i: int) -> None:
        sb = self.sb(i)
        self._add_ns(sb)
        sh(
            "ip",
            "link",
            "add",
            f"vh{i}",
            "netns",
            self.pod,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            sb,
        )

        def p(*c: str) -> subprocess.CompletedProcess[str]:
            return self.ns(self.pod, *c)

        def s(*c: str) -> subprocess.CompletedProcess[str]:
            return self.ns(sb, *c)

        vh = f"vh{i}"
        if self.routed:
            p("ip", "addr", "add", f"{GATEWAY}/32", "dev", vh)
            p("ip", "addr", "add", f"{GATEWAY6}/128", "dev", vh, "nodad")
            p("ip", "link", "set", vh, "up")
            p("ip", "route", "add", f"{self.sb_ip(i)}/32", "dev", vh)
            p("ip", "-6", "route", "add", f"{self.sb_ip6(i)}/128", "dev", vh)
            s("ip", "addr", "add", f"{self.sb_ip(i)}/32", "dev", "eth0")
            s("ip", "addr", "add", f"{self.sb_ip6(i)}/128", "dev", "eth0", "nodad")
            s("ip", "link", "set", "eth0", "up")
            s("ip", "route", "add", GATEWAY, "dev", "eth0")
            s("ip", "-6", "route", "add", GATEWAY6, "dev", "eth0")
        else:
            p("ip", "link", "set", vh, "master", "br0")
            p("ip", "link", "set", vh, "up")
            s("ip", "addr", "add", f"{self.sb_ip(i)}/24", "dev", "eth0")
            s("ip", "addr", "add", f"{self.sb_ip6(i)}/64", "dev", "eth0", "nodad")
            s("ip", "link", "set", "eth0", "up")
        s("ip", "route", "add", "default", "via", GATEWAY)
        s("ip", "-6", "route", "add", "default", "via", GATEWAY6)

    def spawn(
        self,
        ns: str,
        *cmd: str,
        env: dict[str, str] | None = None,
        ready_line: str | None = None,
        log: Path | None = None,
    ) -> subprocess.Popen[str]:
        out = open(log, "a") if log else subprocess.PIPE  # noqa: SIM115
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *cmd],
            stdout=out if ready_line is None else subprocess.PIPE,
            stderr=out if log else subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.procs.append(proc)
        if ready_line is not None:
            assert proc.stdout is not None
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                line = proc.stdout.readline()
                if ready_line in line:
                    break
                if not line and proc.poll() is not None:
                    raise RuntimeError(f"{cmd[0]} exited early in {ns}")
            else:
                raise RuntimeError(f"{cmd[0]} not ready in {ns}")
        return proc

    def stop(self, proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> None:
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if proc in self.procs:
            self.procs.remove(proc)

    def down(self) -> None:
        for proc in list(self.procs):
            with contextlib.suppress(Exception):
                self.stop(proc)
        for ns in reversed(self.created):
            kill_netns_processes(ns)
            sh("ip", "netns", "del", ns, check=False)
        self.created.clear()
        (STATE_DIR / f"{self.prefix}.owner").unlink(missing_ok=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- traffic ---------------------------------------------------------------------------

    def curl(self, sb: int, url: str, timeout: float = 1.0, extra: Sequence[str] = ()) -> int:
        """HTTP status from sandbox ``sb`` (0 = no connection)."""
        r = self.ns(
            self.sb(sb),
            "curl",
            *extra,
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--connect-timeout",
            str(timeout),
            "-m",
            str(timeout + 1),
            url,
            check=False,
            timeout=timeout + 10,
        )
        try:
            return int(r.stdout.strip() or 0)
        except ValueError:
            return 0

    def reaches(self, sb: int, ip: str, port: int = 80, timeout: float = 1.0) -> bool:
        host = f"[{ip}]" if ":" in ip else ip
        if port == 443:  # the upstream speaks TLS there (its test CA is not what matters here)
            return self.curl(sb, f"https://{host}/probe", timeout, extra=("-k",)) == 200
        return self.curl(sb, f"http://{host}:{port}/probe", timeout) == 200

    def upstream_requests(self) -> list[dict[str, Any]]:  # JSON records
        lines = self.upstream_log.read_text().splitlines()
        return [json.loads(ln) for ln in lines if ln.strip()]

    def upstream_queries(self) -> list[str]:
        """Names the upstream DNS server was asked for."""
        return [str(r["dns"]) for r in self.upstream_requests() if "dns" in r]

    def dig(
        self, sb: int, name: str, qtype: str = "A", *, server: str = GATEWAY, tcp: bool = False, tries: int = 1
    ) -> tuple[str, list[str]]:
        """(status, answers) of a real dig from sandbox ``sb`` to the gateway's port 53."""
        args = ["dig", f"@{server}", name, qtype, "+time=2", f"+tries={tries}", "+noall", "+comments", "+answer"]
        if tcp:
            args.append("+tcp")
        out = self.ns(self.sb(sb), *args, check=False, timeout=15).stdout
        status = "TIMEOUT"
        answers: list[str] = []
        for line in out.splitlines():
            if "status:" in line:
                status = line.split("status:", 1)[1].split(",", 1)[0].strip()
            elif line and not line.startswith(";"):
                answers.append(line.split()[-1])
        return status, answers


@dataclass
class Daemon:
    """An egressd process in the pod namespace, driven over its loopback HTTP port."""

    topo: Topology
    table: str
    port: int = 18080
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[str] | None = None
    log: Path | None = None
    prefix: tuple[str, ...] = ()  # e.g. setpriv …: exec'd in turn, so proc.pid is egressd's

    def start(self, wait: bool = True, extra_args: Sequence[str] = ()) -> Daemon:
        rules = self.topo.workdir / "rules"
        rules.mkdir(exist_ok=True)
        self.log = self.topo.workdir / f"egressd-{self.table}.log"
        env = {
            "OPENSANDBOX_EGRESS_PROFILE": "fleet",
            "OPENSANDBOX_EGRESS_HTTP_ADDR": f"127.0.0.1:{self.port}",
            "EGRESSD_NFT_TABLE": self.table,
            "EGRESSD_ALWAYS_RULES_DIR": str(rules),
            "EGRESSD_DNS_ADDR": "0.0.0.0:15353",
            "OPENSANDBOX_EGRESS_DNS_UPSTREAM": f"{DNS_UPSTREAM}:53",
            "OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT": "2",
            # One MITM child unless a test asks for more (tests/kernel/test_mitm_workers.py):
            # the tests that find "the" child by its parent assume one. EGRESSD_TEST_MITM_WORKERS
            # runs the others with more (e.g. tests/kernel/test_uid_subjects.py with 2).
            "EGRESSD_MITM_WORKERS": os.environ.get("EGRESSD_TEST_MITM_WORKERS", "1"),
            **self.env,
        }
        self.proc = self.topo.spawn(
            self.topo.pod,
            *self.prefix,
            str(REPO / ".venv" / "bin" / "egressd"),
            *extra_args,
            env=env,
            log=self.log,
        )
        if wait:
            self.wait_ready()
        return self

    @contextlib.contextmanager
    def running(self, timeout: float = 30) -> Iterator[Daemon]:
        """Started (readiness awaited), then stopped by PID and its table deleted, also on failure."""
        self.start(wait=False)
        try:
            self.wait_ready(timeout=timeout)
            yield self
        finally:
            if self.proc is not None:
                self.topo.stop(self.proc)
            self.nft("delete", "table", "inet", self.table, check=False)

    def wait_ready(self, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"egressd exited {self.proc.returncode}: {self.log_text()[-2000:]}")
            if self.get("/healthz")[0] == 200:
                return
            time.sleep(0.05)
        raise RuntimeError("egressd not ready: " + self.log_text()[-2000:])

    def log_text(self) -> str:
        return self.log.read_text() if self.log and self.log.exists() else ""

    def _curl(self, *args: str) -> tuple[int, str]:
        r = self.topo.ns(self.topo.pod, "curl", "-s", "-m", "10", "-w", "\n%{http_code}", *args, check=False)
        body, _, code = r.stdout.rpartition("\n")
        try:
            return int(code), body
        except ValueError:
            return 0, r.stdout

    def get(self, path: str) -> tuple[int, str]:
        return self._curl(f"http://127.0.0.1:{self.port}{path}")

    def post(self, body: dict[str, object] | str) -> tuple[int, str]:
        data = body if isinstance(body, str) else json.dumps(body)
        path = self.topo.workdir / "body.json"
        path.write_text(data)
        return self._curl(
            "-X",
            "POST",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            f"@{path}",
            f"http://127.0.0.1:{self.port}/_fastlet/v1/actions",
        )

    def status(self) -> dict[str, object]:
        code, body = self.get("/_fastlet/v1/actions/status")
        assert code == 200, body
        return dict(json.loads(body))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            self.topo.stop(self.proc, sig)
            self.proc = None

    def nft(self, *args: str, check: bool = True) -> str:
        return self.topo.ns(self.topo.pod, "nft", *args, check=check).stdout

    def table_json(self) -> list[dict[str, object]]:
        out = self.nft("-j", "list", "table", "inet", self.table)
        return list(json.loads(out)["nftables"])

    def object_names(self) -> set[str]:
        names = set()
        for item in self.table_json():
            for kind in ("set", "map", "chain"):
                if kind in item:
                    names.add(str(item[kind]["name"]))  # type: ignore[index]
        return names

    def map_keys(self, name: str) -> set[str]:
        for item in self.table_json():
            m = item.get("map")
            if isinstance(m, dict) and m.get("name") == name:
                elems = m.get("elem", [])
                return {str(e[0]) if isinstance(e, list) else str(e) for e in elems}
        return set()


# Asks the kernel for the nf_tables ruleset generation (NFT_MSG_GETGEN -> NFTA_GEN_ID). The
# generation grows by one per committed transaction and not for an aborted one, so its step
# over an action counts the transactions that action committed.
_GENID_SCRIPT = """
import socket, struct
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)
s.bind((0, 0))
s.send(struct.pack("=IHHII", 20, (10 << 8) | 16, 1, 1, 0) + bytes(4))
buf = s.recv(65536)
off = 20
while off + 4 <= len(buf):
    ln, kind = struct.unpack_from("=HH", buf, off)
    if kind & 0x3FFF == 1:
        print(struct.unpack_from(">I", buf, off + 4)[0])
        break
    off += (ln + 3) & ~3
"""


def nft_genid(topo: Topology, ns: str) -> int:
    """The nf_tables generation of namespace ``ns`` (read in a child, never via setns here)."""
    return int(topo.ns(ns, str(VENV_PY), "-c", _GENID_SCRIPT).stdout)


def nft_set_elements(topo: Topology, ns: str, table: str, name: str) -> set[str]:
    """The elements of an interval set as nft prints them: bare hosts and ``addr/len``."""
    out = json.loads(topo.ns(ns, "nft", "-j", "list", "set", "inet", table, name).stdout)
    for item in out["nftables"]:
        if "set" in item:
            got = set()
            for e in item["set"].get("elem", []):
                if isinstance(e, str):
                    got.add(e)
                elif isinstance(e, dict) and "prefix" in e:
                    got.add(f"{e['prefix']['addr']}/{e['prefix']['len']}")
                else:
                    got.add(json.dumps(e))  # a range or anything else: never expected
            return got
    raise AssertionError(f"no set {name} in {table}")


def envelope(
    op: str,
    uid: str,
    *,
    rid: str = "r1",
    aid: str = "a1",
    ip: str | None = None,
    gateway: str | None = GATEWAY,
    policy: object = "__absent__",
    hook: str | None = None,
    generation: int = 1,
) -> dict[str, object]:
    env: dict[str, object] = {
        "apiVersion": "sandbox.fast.io/actions/v1",
        "operation": op,
        "sandbox": {"uid": uid},
        "revision": {"runtimeInstanceId": rid, "attachmentId": aid, "specGeneration": generation},
    }
    if ip is not None:
        net: dict[str, object] = {"ip": ip, "hostVeth": f"vh-{uid}"}
        if gateway is not None:
            net["gateway"] = gateway
        env["attachment"] = {"network": net}
    if policy != "__absent__":
        env["binding"] = {
            "input": policy if policy is None or isinstance(policy, str) else json.dumps(policy)
        }
    if hook is not None:
        env["hook"] = {"name": hook}
    return env


def decode_echo(text: str | bytes) -> dict[str, Any]:
    """The upstream's JSON echo (scripts/fleet_upstream.py) with ``headers`` and ``body`` as the
    upstream received them: taken from its base64 ``seen`` field, since the MITM redacts the
    credential strings from the plain fields on the way back (docs/reference/behaviour.md §10)."""
    try:
        echo = json.loads(text) if text[:1] in ("{", b"{") else {}
    except ValueError:
        return {}
    if not isinstance(echo, dict):
        return {}
    seen = echo.get("seen")
    if isinstance(seen, str):
        echo.update(json.loads(base64.b64decode(seen)))
    return echo


def quote(s: str) -> str:
    return urllib.parse.quote(s)
