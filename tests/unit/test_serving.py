"""The shared HTTP shell: a taken port is a one-line ListenError and leaves nothing running."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from egressd.serving import ListenError, start_http, wait_for_stop


async def test_taken_port_is_one_line_and_nothing_keeps_running() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        with pytest.raises(ListenError) as info:
            await start_http(web.Application(), "127.0.0.1", port)
    assert str(info.value).startswith(f"cannot listen on 127.0.0.1:{port}: ") and "\n" not in str(info.value)


async def test_serves_until_stopped() -> None:
    runner = await start_http(web.Application(), "127.0.0.1", 0)
    try:
        assert runner.addresses
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stop.set)
        await asyncio.wait_for(wait_for_stop(stop), 2)
    finally:
        await runner.cleanup()
