#!/usr/bin/env python3
"""Upstream services for tests and demos, run inside the "upstream" network namespace.

HTTP echo servers on the given ports (dual-stack): every request is answered with a JSON
echo of what arrived, and one JSON line per request is appended to ``--log`` so tests can
prove that a connection never reached the upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import time
from pathlib import Path

from aiohttp import web


def _client_ip(request: web.Request) -> str:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    host = str(peer[0]) if peer else "?"
    return host.removeprefix("::ffff:")


def make_app(log_path: Path | None, port: int) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        record = {
            "ts": time.time(),
            "port": port,
            "client": _client_ip(request),
            "method": request.method,
            "path": request.path_qs,
            "host": request.host,
            "local": str(request.transport.get_extra_info("sockname")[0]).removeprefix("::ffff:")
            if request.transport
            else "?",
            "headers": dict(request.headers),
            "bodyBytes": len(body),
        }
        if log_path is not None:
            with log_path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
        return web.json_response(record)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


async def serve(ports: list[int], log_path: Path | None) -> None:
    runners = []
    for port in ports:
        runner = web.AppRunner(make_app(log_path, port), access_log=None)
        await runner.setup()
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::", port))
        sock.listen(128)
        await web.SockSite(runner, sock).start()
        runners.append(runner)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http-ports", default="80", help="comma-separated HTTP echo ports")
    parser.add_argument("--log", type=Path, help="append one JSON line per request here")
    args = parser.parse_args()
    ports = [int(p) for p in args.http_ports.split(",") if p.strip()]
    asyncio.run(serve(ports, args.log))


if __name__ == "__main__":
    main()
