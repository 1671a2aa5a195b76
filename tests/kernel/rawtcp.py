"""A raw TCP upstream and client for the name-check tests (docs/reference/behaviour.md §18): a
server-first service (a greeting on accept, then a line echo) and a client-first echo (of each
read) on
the upstream namespace's addresses, recording every accepted connection at accept, and a
sandbox-side client that can wait for the greeting, stay silent, or speak first."""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.kernel.cdn import CDN_IP
from tests.kernel.topology import Topology

BANNER_PORT = 2525  # server-first: "220 ..." on accept, then echoes lines
ECHO_PORT = 2222  # client-first: echoes lines

RAW_SERVER = r"""
import json, socket, sys, threading
log = sys.argv[1]
lock = threading.Lock()
def record(doc):
    with lock, open(log, "a") as fh:
        fh.write(json.dumps(doc) + "\n")
def serve(conn, port):
    try:
        if port == BANNER:
            conn.sendall(b"220 cdn.test ESMTP ready\r\n")
        f = conn.makefile("rb")
        while True:
            # The greeting service answers lines; the echo answers each read as it comes.
            line = f.readline() if port == BANNER else conn.recv(4096)
            if not line:
                return
            record({"event": "line", "port": port, "line": line.decode("latin-1")})
            conn.sendall(b"echo " + line)
    except OSError:
        return
    finally:
        conn.close()
def listen(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    while True:
        c, peer = s.accept()
        record({"event": "accept", "port": port, "peer": peer[0]})
        threading.Thread(target=serve, args=(c, port), daemon=True).start()
for p in (BANNER, ECHO):
    threading.Thread(target=listen, args=(p,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
""".replace("BANNER", str(BANNER_PORT)).replace("ECHO", str(ECHO_PORT))

# From the sandbox: connect; "greeted": read the server's first line before sending (a
# server-first client); else wait, then send; then read what comes back.
RAW_CLIENT = r"""
import json, socket, sys, time
ip, port, greeted, wait, send, read_s = (
    sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", float(sys.argv[4]), sys.argv[5], float(sys.argv[6])
)
out = {"connected": False, "got": "", "error": None, "t": None}
t0 = time.monotonic()
data = b""
try:
    s = socket.create_connection((ip, port), timeout=4)
    out["connected"] = True
    s.settimeout(read_s)
    if greeted:
        while b"\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        out["t"] = round(time.monotonic() - t0, 3)
    time.sleep(wait)
    if send:
        s.sendall(send.encode("latin-1").decode("unicode_escape").encode("latin-1"))
        want = data.count(b"\n") + 1
        while data.count(b"\n") < want:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
except socket.timeout:
    pass
except Exception as exc:
    out["error"] = type(exc).__name__
out["got"] = data.decode("latin-1")
print(json.dumps(out))
"""


def start_raw_server(t: Topology) -> None:
    """The raw server in ``t``'s upstream namespace (stopped with the topology)."""
    log = t.workdir / "raw.jsonl"
    log.touch()
    t.spawn(t.up, sys.executable, "-c", RAW_SERVER, str(log), ready_line="ready")


def raw_records(t: Topology) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (t.workdir / "raw.jsonl").read_text().splitlines() if ln.strip()]


def raw(
    t: Topology,
    port: int,
    *,
    sb: int = 1,
    ip: str = CDN_IP,
    greeted: bool = False,
    wait: float = 0.0,
    send: str = "",
    read_s: float = 3.0,
) -> dict[str, Any]:
    """One raw TCP connection from sandbox ``sb`` to ``ip``:``port`` (``send``: Python escapes
    allowed; ``greeted``: read the server's greeting line first; ``wait``: stay silent first)."""
    args = ["1" if greeted else "0", str(wait), send, str(read_s)]
    r = t.ns(t.sb(sb), sys.executable, "-c", RAW_CLIENT, ip, str(port), *args, check=False, timeout=30)
    doc: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return doc
