"""MITM start-up: the private socket is never shared with another live egressd."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import egressd.mitm.service as service
from egressd.config import parse_config
from egressd.mitm.config import MitmConfig
from egressd.mitm.service import MitmStartupError, start_mitm


def _cfg(tmp_path: Path, sock: Path) -> MitmConfig:
    return parse_config(
        {
            "OPENSANDBOX_EGRESS_PROFILE": "fleet",
            "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
            "EGRESSD_MITM_CONFDIR": str(tmp_path / "conf"),
            "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(tmp_path),
            "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(sock),
        }
    ).mitm


async def _listener(path: Path) -> asyncio.AbstractServer:
    path.parent.mkdir(parents=True, exist_ok=True)
    return await asyncio.start_unix_server(lambda r, w: w.close(), path=str(path))


async def test_an_explicit_socket_in_use_refuses_start(tmp_path: Path) -> None:
    sock = tmp_path / "run" / "a.sock"
    other = await _listener(sock)
    try:
        with pytest.raises(MitmStartupError, match="in use by another process"):
            await start_mitm(_cfg(tmp_path, sock), lambda ip: None, lambda c, h, d: False)
        assert sock.exists(), "the other process's socket is left alone"
    finally:
        other.close()
        await other.wait_closed()


async def test_the_default_socket_in_use_falls_back_to_our_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = tmp_path / "run" / "active.sock"
    monkeypatch.setattr(service, "DEFAULT_SOCKET", default)
    other = await _listener(default)
    try:
        mitm = await start_mitm(_cfg(tmp_path, default), lambda ip: None, lambda c, h, d: False)
        try:
            assert mitm.socket != default and mitm.socket.parent == default.parent and mitm.socket.exists()
            assert f"egressd_active_socket={mitm.socket}" in " ".join(mitm.supervisor.argv)
        finally:
            await mitm.close()
        assert default.exists() and not mitm.socket.exists()
    finally:
        other.close()
        await other.wait_closed()


async def test_a_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    sock = tmp_path / "run" / "a.sock"
    sock.parent.mkdir(parents=True)
    sock.write_text("")  # left behind by a killed daemon: nothing listens
    mitm = await start_mitm(_cfg(tmp_path, sock), lambda ip: None, lambda c, h, d: False)
    try:
        assert mitm.socket == sock and sock.is_socket()
    finally:
        await mitm.close()
