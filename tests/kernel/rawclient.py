"""A client that goes away: one HTTP/1.1 POST over a raw socket, then a chosen way of leaving.

Run inside the daemon's namespace (``ip netns exec <pod> python rawclient.py ...``); it talks
to 127.0.0.1 only. Prints one JSON line: ``{"status": <int, 0 = no reply>, "body": <str>}``.

Modes:
  half-close    whole request, shutdown(SHUT_WR), read the reply to EOF
  close         whole request, close() at once (FIN), no read
  reset         whole request, close with SO_LINGER 0 (RST) at once, no read
  partial-close all but the last bytes of the body, close()
  partial-reset all but the last bytes of the body, RST
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time
from pathlib import Path

MODES = ("half-close", "close", "reset", "partial-close", "partial-reset")


def request(port: int, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def rst(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def read_to_eof(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionError):
        pass
    return data


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--path", default="/_fastlet/v1/actions")
    ap.add_argument("--body-file", type=Path, required=True)
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--timeout", type=float, default=10.0)
    args = ap.parse_args()
    data = request(args.port, args.path, args.body_file.read_bytes())
    sock = socket.create_connection(("127.0.0.1", args.port), timeout=args.timeout)
    status, body = 0, b""
    if args.mode.startswith("partial-"):
        sock.sendall(data[:-8])
        time.sleep(0.3)  # the partial body reaches the daemon's reader before the client leaves
        if args.mode == "partial-reset":
            rst(sock)
        else:
            sock.close()
    else:
        sock.sendall(data)
        if args.mode == "reset":
            rst(sock)
        elif args.mode == "close":
            sock.close()
        else:
            sock.shutdown(socket.SHUT_WR)
            raw = read_to_eof(sock, args.timeout)
            sock.close()
            if raw:
                head, _, body = raw.partition(b"\r\n\r\n")
                status = int(head.split(b" ", 2)[1])
    print(json.dumps({"status": status, "body": body.decode(errors="replace")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
