"""An egressd sidecar inside one sandbox namespace of a throwaway topology (tests only).

The sidecar owns the sandbox's namespace: it runs there (``ip netns exec sbN egressd``) and
so does the "app" (curl, dig, python via ``ip netns exec``). Its API is reached on
127.0.0.1 inside the sandbox (loopback is always accepted) or, like a real SDK client, from
the pod namespace at the sandbox's address.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.kernel.topology import DNS_UPSTREAM, REPO, VENV_PY, Topology

TOKEN = "sidecar-test-token-91f2"
TABLE = "opensandbox"


@dataclass
class Sidecar:
    topo: Topology
    sb: int = 1
    token: str | None = TOKEN
    port: int = 18080
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[str] | None = None
    prefix: tuple[str, ...] = ()  # e.g. setpriv …: exec'd in turn, so proc.pid is egressd's

    @property
    def ns(self) -> str:
        return self.topo.sb(self.sb)

    @property
    def policy_file(self) -> Path:
        return self.topo.workdir / f"sidecar-sb{self.sb}-policy.json"

    @property
    def log(self) -> Path:
        return self.topo.workdir / f"sidecar-sb{self.sb}.log"

    @property
    def endpoint(self) -> str:
        """Where a client outside the sandbox (in the pod namespace) reaches the API."""
        return f"{self.topo.sb_ip(self.sb)}:{self.port}"

    def full_env(self) -> dict[str, str]:
        rules = self.topo.workdir / "sidecar-rules"
        rules.mkdir(exist_ok=True)
        env = {
            "OPENSANDBOX_EGRESS_PROFILE": "sidecar",
            "OPENSANDBOX_EGRESS_HTTP_ADDR": f"0.0.0.0:{self.port}",
            "OPENSANDBOX_EGRESS_POLICY_FILE": str(self.policy_file),
            "OPENSANDBOX_EGRESS_DNS_UPSTREAM": f"{DNS_UPSTREAM}:53",
            "OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT": "2",
            "EGRESSD_ALWAYS_RULES_DIR": str(rules),
            "EGRESSD_LOG_FORMAT": "json",
        }
        if self.token is not None:
            env["OPENSANDBOX_EGRESS_TOKEN"] = self.token
        env.update(self.env)
        return env

    def with_mitm(self, port: int = 18081) -> Sidecar:
        """Transparent MITM on, trusting the upstream's test CA (vault writes then succeed)."""
        self.env.update(
            {
                "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
                "OPENSANDBOX_EGRESS_MITMPROXY_PORT": str(port),
                "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(self.topo.tls_dir / "trust"),
                "EGRESSD_MITM_CONFDIR": str(self.mitm_confdir),
                "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(
                    self.topo.workdir / f"sidecar-run-sb{self.sb}" / "a.sock"
                ),
            }
        )
        return self

    @property
    def mitm_confdir(self) -> Path:
        return self.topo.workdir / f"sidecar-mitm-sb{self.sb}"

    def command(self) -> list[str]:
        return [str(REPO / ".venv" / "bin" / "egressd")]

    def start(self, wait: bool = True) -> Sidecar:
        self.proc = self.topo.spawn(self.ns, *self.prefix, *self.command(), env=self.full_env(), log=self.log)
        if wait:
            self.wait_ready()
        return self

    def run_to_exit(self, *prefix: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
        """Run egressd in the foreground (for start-up refusals)."""
        import os

        return subprocess.run(
            ["ip", "netns", "exec", self.ns, *prefix, *self.command()],
            env={**os.environ, **self.full_env()},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"egressd exited {self.proc.returncode}: {self.log_text()[-2000:]}")
            if self.api("GET", "/healthz")[0] == 200:
                return
            time.sleep(0.05)
        raise RuntimeError("sidecar not ready: " + self.log_text()[-2000:])

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            self.topo.stop(self.proc, sig)
            self.proc = None

    def cleanup(self) -> None:
        self.kill(signal.SIGKILL)
        self.topo.ns(self.ns, "nft", "delete", "table", "inet", TABLE, check=False)
        self.policy_file.unlink(missing_ok=True)

    # ---- API (from inside the sandbox, over loopback) -----------------------------------------

    def api(
        self,
        method: str,
        path: str,
        body: object = None,
        *,
        raw: str | None = None,
        token: str | None = "default",
    ) -> tuple[int, str]:
        args = ["curl", "-s", "-m", "10", "-w", "\n%{http_code}", "-X", method]
        tok = self.token if token == "default" else token
        if tok is not None:
            args += ["-H", f"OPENSANDBOX-EGRESS-AUTH: {tok}"]
        data = raw if raw is not None else (None if body is None else json.dumps(body))
        if data is not None:
            f = self.topo.workdir / f"sidecar-body-{self.sb}.json"
            f.write_text(data)
            args += ["-H", "Content-Type: application/json", "--data-binary", f"@{f}"]
        args.append(f"http://127.0.0.1:{self.port}{path}")
        r = self.topo.ns(self.ns, *args, check=False)
        text, _, code = r.stdout.rpartition("\n")
        try:
            return int(code), text
        except ValueError:
            return 0, r.stdout

    def policy(self) -> dict[str, Any]:
        code, text = self.api("GET", "/policy")
        assert code == 200, text
        return dict(json.loads(text))

    def set_policy(self, policy: object) -> None:
        code, text = self.api("POST", "/policy", policy)
        assert code == 200, text

    def patch(self, rules: list[dict[str, str]]) -> None:
        code, text = self.api("PATCH", "/policy", rules)
        assert code == 200, text

    def table_exists(self) -> bool:
        return self.topo.ns(self.ns, "nft", "list", "table", "inet", TABLE, check=False).returncode == 0

    # ---- the app, in the same namespace -------------------------------------------------------

    def curl(self, url: str, timeout: float = 1.0) -> int:
        return self.topo.curl(self.sb, url, timeout)

    def reaches(self, ip: str, port: int = 80, timeout: float = 1.0) -> bool:
        return self.topo.reaches(self.sb, ip, port, timeout)

    def dig(
        self, name: str, qtype: str = "A", *, server: str = DNS_UPSTREAM, tcp: bool = False
    ) -> tuple[str, list[str]]:
        return self.topo.dig(self.sb, name, qtype, server=server, tcp=tcp)

    def curl_by_name(self, url: str, timeout: float = 2.0) -> int:
        """curl with getaddrinfo resolution through a resolv.conf naming the upstream
        (bind-mounted in a private mount namespace; the host's file is untouched)."""
        resolv = self.topo.workdir / "sidecar-resolv.conf"
        resolv.write_text(f"nameserver {DNS_UPSTREAM}\noptions timeout:2 attempts:1\n")
        script = (
            f"mount --bind {resolv} /etc/resolv.conf && "
            f"curl -s -o /dev/null -w '%{{http_code}}' --connect-timeout {timeout} -m {timeout + 2} {url}"
        )
        r = self.topo.ns(self.ns, "unshare", "-m", "sh", "-c", script, check=False, timeout=timeout + 15)
        try:
            return int(r.stdout.strip() or 0)
        except ValueError:
            return 0

    def python(self, code: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return self.topo.ns(self.ns, str(VENV_PY), "-c", code, check=False, timeout=timeout)
