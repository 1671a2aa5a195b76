"""The shared HTTP shell: a taken port is a one-line ListenError and leaves nothing running."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from egressd.web.serving import ListenError, start_http, wait_for_stop


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


async def test_malformed_requests_never_print_their_bytes(capfd: pytest.CaptureFixture[str]) -> None:
    """aiohttp's parser error quotes the request; only the kind of failure may be logged."""
    from structlog.testing import capture_logs

    from egressd.logsetup import guard_aiohttp_server_log

    guard_aiohttp_server_log()
    secret = "PLANTED-sk-serving-77"
    runner = await start_http(web.Application(), "127.0.0.1", 0)
    try:
        host, port = runner.addresses[0][:2]
        with capture_logs() as logs:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(
                b"PUT /credential-vault HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                + f'{{"credentials":[{{"value":"{secret}"}}]}}\r\n'.encode()
            )
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(4096), 5)
            writer.close()
            await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()
    assert answer.split(b" ", 2)[1] == b"400"  # (aiohttp echoes the bad bytes to their sender only)
    out, err = capfd.readouterr()
    assert secret not in out + err + repr(logs)
    assert any(entry.get("event") == "http.request_error" for entry in logs)
