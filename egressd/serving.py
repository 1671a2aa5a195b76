"""What both profiles' shells do the same way: bind the HTTP API, wait for SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web


class ListenError(Exception):
    """One-line reason the HTTP listener could not be bound."""


async def start_http(app: web.Application, host: str, port: int) -> web.AppRunner:
    """The running site's runner (the caller cleans it up); :class:`ListenError` if the address
    cannot be bound (nothing is left running then)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except OSError as exc:
        await runner.cleanup()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return runner


async def wait_for_stop(stop: asyncio.Event | None = None) -> None:
    """Until ``stop`` is set, or SIGTERM/SIGINT arrives."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
