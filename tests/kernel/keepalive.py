"""A keep-alive TLS client in a sandbox for tests of what a policy change does to a connection
already open (tests/kernel/test_names_narrowing_cuts.py and the sidecar's)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.kernel.cdn import CDN_IP, requests
from tests.kernel.topology import Topology

# One TLS connection: GET, print the status, wait for the go file, GET again on the same
# connection, print what came back (a status, or the error that ended the connection).
KEEP_ALIVE = r"""
import json, socket, ssl, sys, time, os
ip, sni, ca, go = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
ctx = ssl.create_default_context(cafile=ca)
s = ctx.wrap_socket(socket.create_connection((ip, 443), timeout=5), server_hostname=sni)
def get(path):
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: {sni}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        body += chunk
    return int(head.split(b" ")[1])
print(json.dumps({"first": get("/first")}), flush=True)
deadline = time.monotonic() + 20
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(float(sys.argv[5]))
try:
    print(json.dumps({"second": get("/second")}), flush=True)
except Exception as exc:
    print(json.dumps({"second": type(exc).__name__}), flush=True)
"""


class KeepAlive:
    """The client above in sandbox ``sb``, started and read line by line."""

    def __init__(
        self, t: Topology, sb: int, sni: str, ca: Path, settle: float = 1.0, ip: str = CDN_IP
    ) -> None:
        self.go = t.workdir / f"go-{sni}-{time.monotonic_ns()}"
        argv = [sys.executable, "-c", KEEP_ALIVE, ip, sni, str(ca), str(self.go), str(settle)]
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", t.sb(sb), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        assert text, self.proc.stderr.read() if self.proc.stderr else ""
        doc: dict[str, Any] = json.loads(text)
        return doc

    def second(self) -> Any:
        self.go.write_text("go")
        try:
            return self.line()["second"]
        finally:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def second_reached(t: Topology, since: int, sni: str) -> bool:
    return any(
        r.get("path") == "/second" and sni in (r.get("sni"), r.get("host")) for r in requests(t, since)
    )
