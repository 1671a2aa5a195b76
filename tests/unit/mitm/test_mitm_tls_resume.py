"""Upstream TLS session resumption in the MITM child (egressd.mitmchild.resume, egressd.mitmchild.tlsresume)
and the indexed self-connect check (egressd.mitmchild.selfconnect)."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import ssl
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import connection
from mitmproxy.proxy import context as mcontext
from mitmproxy.test import taddons
from OpenSSL import SSL

from egressd.config import ConfigError, parse_config
from egressd.mitm import seqmap
from egressd.mitm.protocol import forget_message
from egressd.mitm.supervisor import MitmOptions, mitmdump_argv
from egressd.mitmchild import runner, tlsresume
from egressd.mitmchild.resume import SessionCache, SessionKey
from egressd.mitmchild.selfconnect import LOCAL_NAMES, SELF_CONNECT_ERROR, IndexedProxyserver, ListenIndex
from egressd.mitmchild.tlsresume import TlsResumption, snapshot_session

K = SessionKey(
    client="10.203.0.11",
    sni="api.example.test",
    address=("10.204.0.6", 443),
    verify=True,
    trust="t",
    epoch=(0, 0),
)


# ---- the cache ------------------------------------------------------------------------------


def test_a_session_is_handed_out_once_newest_first() -> None:
    cache: SessionCache[str] = SessionCache()
    cache.put(K, "s1", 0.0)
    cache.put(K, "s2", 1.0)
    assert cache.take(K, 2.0) == "s2"
    assert cache.take(K, 2.0) == "s1"
    assert cache.take(K, 2.0) is None
    assert len(cache) == 0


@pytest.mark.parametrize(
    "other",
    [
        SessionKey("10.203.0.12", K.sni, K.address, K.verify, K.trust, K.epoch),  # another sandbox
        SessionKey("port:16300", K.sni, K.address, K.verify, K.trust, K.epoch),  # a host-uid subject
        SessionKey(K.client, "other.example.test", K.address, K.verify, K.trust, K.epoch),  # another SNI
        SessionKey(K.client, K.sni, ("10.204.0.7", 443), K.verify, K.trust, K.epoch),  # the upstream moved
        SessionKey(K.client, K.sni, ("10.204.0.6", 8443), K.verify, K.trust, K.epoch),  # another port
        SessionKey(K.client, K.sni, K.address, False, "", K.epoch),  # verification off
        SessionKey(K.client, K.sni, K.address, True, "another trust store", K.epoch),
        SessionKey(K.client, K.sni, K.address, K.verify, K.trust, (1, 0)),  # a newer epoch
    ],
)
def test_no_session_crosses_a_key_field(other: SessionKey) -> None:
    cache: SessionCache[str] = SessionCache()
    cache.put(K, "s", 0.0)
    assert cache.take(other, 0.0) is None
    assert cache.take(K, 0.0) == "s", "the owner's session is still there"


def test_an_unverified_session_never_reaches_a_verified_handshake() -> None:
    cache: SessionCache[str] = SessionCache()
    unverified = SessionKey(K.client, K.sni, K.address, False, "", K.epoch)
    cache.put(unverified, "insecure", 0.0)
    assert cache.take(K, 0.0) is None
    cache.put(K, "verified", 0.0)
    assert cache.take(unverified, 0.0) == "insecure"


def test_sessions_expire() -> None:
    cache: SessionCache[str] = SessionCache(ttl=10.0)
    cache.put(K, "s", 100.0)
    assert cache.take(K, 110.0) is None
    cache.put(K, "s", 100.0)
    assert cache.take(K, 99.0) is None, "a clock that went back does not resume either"
    cache.put(K, "old", 0.0)
    cache.put(K, "new", 5.0)
    cache.expire(12.0)
    assert len(cache) == 1
    assert cache.take(K, 12.0) == "new"


def test_bounds_per_key_and_in_all() -> None:
    cache: SessionCache[int] = SessionCache(max_keys=3, per_key=2)
    for i in range(5):
        cache.put(K, i, 0.0)
    assert len(cache) == 2
    assert [cache.take(K, 0.0), cache.take(K, 0.0), cache.take(K, 0.0)] == [4, 3, None]
    keys = [SessionKey(f"10.203.0.{i}", K.sni, K.address, True, "t", K.epoch) for i in range(5)]
    for i, key in enumerate(keys):
        cache.put(key, i, 0.0)
    assert len(cache) == 3
    assert [cache.take(k, 0.0) for k in keys] == [None, None, 2, 3, 4], "least recently stored go first"


def test_forget_drops_only_the_named_clients() -> None:
    cache: SessionCache[str] = SessionCache()
    other = SessionKey("10.203.0.12", K.sni, K.address, True, "t", K.epoch)
    port = SessionKey("port:16300", K.sni, K.address, True, "t", K.epoch)
    for key in (K, other, port):
        cache.put(key, key.client, 0.0)
    cache.forget(["10.203.0.11", "port:16300"])
    assert (cache.take(K, 0.0), cache.take(port, 0.0), cache.take(other, 0.0)) == (None, None, "10.203.0.12")
    cache.put(K, "s", 0.0)
    cache.forget(None)
    assert len(cache) == 0
    cache.put(K, "s", 0.0)
    cache.drop(K)
    assert cache.take(K, 0.0) is None


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        SessionCache(ttl=0)
    with pytest.raises(ValueError, match="positive"):
        SessionCache(per_key=0)


# ---- the addon --------------------------------------------------------------------------------


class _FakeConn:
    """What the addon touches of a pyOpenSSL connection."""

    def __init__(self, ctx: object, session: object = None) -> None:
        self.ctx, self.session = ctx, session
        self.offered: object = None

    def get_context(self) -> object:
        return self.ctx

    def set_session(self, session: object) -> None:
        self.offered = session

    def get_session(self) -> object:
        return self.session


def _data(
    client_ip: str, sni: str, address: tuple[str, int], ssl_conn: object, client_port: int = 40000
) -> Any:
    client = connection.Client(
        peername=(client_ip, client_port), sockname=("10.204.0.6", 443), timestamp_start=0.0
    )
    server = connection.Server(address=address, sni=sni)
    ctx: Any = mcontext.Context(client, None)  # type: ignore[arg-type]  # no options needed here
    ctx.server = server
    data: Any = type("TlsDataStub", (), {})()
    data.conn, data.context, data.ssl_conn, data.is_dtls = server, ctx, ssl_conn, False
    return data


def _data_on(a: TlsResumption, *args: Any) -> Any:
    """``_data`` of a client connection the addon saw start (so it has its epoch)."""
    data = _data(*args)
    a.client_connected(data.context.client)
    return data


def _flow_for(data: Any) -> Any:
    flow: Any = type("FlowStub", (), {})()
    flow.server_conn = data.conn
    return flow


@pytest.fixture
def addon(monkeypatch: pytest.MonkeyPatch) -> Iterator[TlsResumption]:
    monkeypatch.setattr(tlsresume, "snapshot_session", lambda conn: conn.get_session())
    monkeypatch.setattr(tlsresume, "emit", lambda *a, **kw: None)
    a = TlsResumption(clock=lambda: 1000.0)
    with taddons.context(a) as tctx:  # type: ignore[no-untyped-call]
        tctx.options.update(listen_port=18081, ssl_verify_upstream_trusted_confdir="/trust")
        yield a


def _handshake(a: TlsResumption, ctx: object, client: str, session: object, port: int = 40000) -> _FakeConn:
    """One upstream connection: start (maybe offered a session), established, one response."""
    conn = _FakeConn(ctx, session)
    data = _data_on(a, client, "api.example.test", ("10.204.0.6", 443), conn, port)
    a.tls_start_server(data)
    a.tls_established_server(data)
    a.response(_flow_for(data))
    return conn


def test_the_same_sandbox_resumes_and_another_does_not(addon: TlsResumption) -> None:
    ctx = object()
    first = _handshake(addon, ctx, "10.203.0.11", "ticket-1")
    assert first.offered is None
    second = _handshake(addon, ctx, "10.203.0.11", "ticket-2")
    assert second.offered == "ticket-1"
    stranger = _handshake(addon, ctx, "10.203.0.12", "ticket-3")
    assert stranger.offered is None, "a session never crosses sandboxes"
    assert _handshake(addon, ctx, "10.203.0.11", None).offered == "ticket-2"


def test_a_per_subject_port_is_its_own_client(addon: TlsResumption) -> None:
    """Host-uid subjects share the host's address; the listener port names the sandbox."""
    ctx = object()
    key_shared = addon._key(
        _data_on(addon, "10.0.0.1", "api.example.test", ("10.204.0.6", 443), _FakeConn(ctx))
    )
    assert key_shared is not None and key_shared.client == "10.0.0.1"
    data = _data_on(addon, "10.0.0.1", "api.example.test", ("10.204.0.6", 443), _FakeConn(ctx))
    data.context.client.proxy_mode = type("Mode", (), {"custom_listen_port": 16300})()
    key_port = addon._key(data)
    assert key_port is not None and key_port.client == "port:16300"


def test_no_session_from_a_connection_without_a_verified_handshake(addon: TlsResumption) -> None:
    ctx = object()
    conn = _FakeConn(ctx, "ticket")
    data = _data_on(addon, "10.203.0.11", "api.example.test", ("10.204.0.6", 443), conn)
    addon.tls_start_server(data)
    addon.response(_flow_for(data))  # no tls_established_server: never stored
    addon.server_disconnected(type("D", (), {"server": data.conn})())
    assert len(addon.cache) == 0


def test_a_failed_upstream_handshake_drops_the_keys_sessions(addon: TlsResumption) -> None:
    ctx = object()
    _handshake(addon, ctx, "10.203.0.11", "ticket")
    failed = _data_on(addon, "10.203.0.11", "api.example.test", ("10.204.0.6", 443), _FakeConn(ctx))
    addon.tls_failed_server(failed)
    assert len(addon.cache) == 0


def test_a_session_of_another_context_is_not_offered(addon: TlsResumption) -> None:
    _handshake(addon, object(), "10.203.0.11", "ticket")
    assert _handshake(addon, object(), "10.203.0.11", None).offered is None


def test_verification_settings_are_part_of_the_key_and_a_change_clears_the_cache(
    addon: TlsResumption,
) -> None:
    ctx = object()
    data = _data_on(addon, "10.203.0.11", "api.example.test", ("10.204.0.6", 443), _FakeConn(ctx))
    verified = addon._key(data)
    _handshake(addon, ctx, "10.203.0.11", "ticket")
    from mitmproxy import ctx as mctx

    mctx.options.update(ssl_insecure=True)  # type: ignore[no-untyped-call]
    assert len(addon.cache) == 0
    insecure = addon._key(data)
    assert verified is not None and insecure is not None
    assert (verified.verify, insecure.verify, insecure.trust) == (True, False, "")


def test_off_offers_and_stores_nothing(addon: TlsResumption) -> None:
    from mitmproxy import ctx as mctx

    mctx.options.update(egressd_tls_resume=False)  # type: ignore[no-untyped-call]
    ctx = object()
    _handshake(addon, ctx, "10.203.0.11", "ticket")
    assert len(addon.cache) == 0
    key = addon._key(_data_on(addon, "10.203.0.11", "api.example.test", ("10.204.0.6", 443), _FakeConn(ctx)))
    assert key is not None
    stored: Any = (ctx, "x")
    addon.cache.put(key, stored, 1000.0)
    assert _handshake(addon, ctx, "10.203.0.11", None).offered is None


def test_forget_reaches_the_sessions(addon: TlsResumption) -> None:
    ctx = object()
    _handshake(addon, ctx, "10.203.0.11", "a")
    _handshake(addon, ctx, "10.203.0.12", "b")
    addon.forget(["10.203.0.11"])
    assert _handshake(addon, ctx, "10.203.0.11", None).offered is None
    assert _handshake(addon, ctx, "10.203.0.12", None).offered == "b"


def test_a_session_stored_after_the_forget_does_not_reach_the_next_tenant(addon: TlsResumption) -> None:
    """Review of issue 16: a connection of the removed subject A that began before the forget
    line and completes its handshake (and first response) after it stored its session under
    A's address; B, registered on that address next, resumed it. A's epoch is older now."""
    ctx = object()
    a_conn = _FakeConn(ctx, "A-ticket")
    a = _data_on(addon, "10.203.0.11", "api.example.test", ("10.204.0.6", 443), a_conn, 40000)
    addon.tls_start_server(a)
    addon.forget(["10.203.0.11"])  # egressd removed A
    addon.tls_established_server(a)
    addon.response(_flow_for(a))
    b_conn = _FakeConn(ctx, None)
    b = _data_on(addon, "10.203.0.11", "api.example.test", ("10.204.0.6", 443), b_conn, 40001)
    addon.tls_start_server(b)
    assert b_conn.offered is None


@pytest.mark.parametrize("forgotten", [["10.203.0.11"], None])
def test_without_the_map_forget_lines_move_the_epoch(
    addon: TlsResumption, forgotten: list[str] | None
) -> None:
    """A session stored under the old epoch after the forget (the cache forgot what it held
    then) is not offered to a connection that started after it; another client's forget
    changes nothing for this one."""
    ctx = object()
    _handshake(addon, ctx, "10.203.0.11", "a")
    addon.forget(["10.203.0.12"])
    assert _handshake(addon, ctx, "10.203.0.11", "a2").offered == "a", "another client's forget"
    old = addon._key(_data_on(addon, "10.203.0.11", "api.example.test", ("10.204.0.6", 443), _FakeConn(ctx)))
    assert old is not None
    addon.forget(forgotten)
    stale: Any = (ctx, "stale")
    addon.cache.put(old, stale, 1000.0)
    assert _handshake(addon, ctx, "10.203.0.11", None).offered is None


@pytest.fixture
def seq_map(tmp_path: Path) -> Iterator[tuple[seqmap.SeqWriter, seqmap.SeqReader]]:
    writer = seqmap.SeqWriter(tmp_path / "active.seq")
    reader = seqmap.SeqReader(str(writer.path))
    try:
        yield writer, reader
    finally:
        reader.close()
        writer.close()


def test_with_the_map_a_bump_ends_the_epoch_before_any_forget_line(
    addon: TlsResumption, seq_map: tuple[seqmap.SeqWriter, seqmap.SeqReader]
) -> None:
    """A worker whose forget line has not arrived yet: egressd bumped the client's slot
    synchronously at the removal, so the next tenant's connection has a newer epoch."""
    writer, reader = seq_map
    addon.seq = reader
    ctx = object()
    _handshake(addon, ctx, "10.203.0.11", "A-ticket")
    _handshake(addon, ctx, "10.203.0.12", "other")
    assert _handshake(addon, ctx, "10.203.0.11", "A-ticket-2").offered == "A-ticket", "same epoch resumes"
    writer.bump(["10.203.0.11"])  # the removal of A; no forget line reaches this worker
    assert _handshake(addon, ctx, "10.203.0.11", None).offered is None, "B does not get A's session"
    assert _handshake(addon, ctx, "10.203.0.12", None).offered == "other"


def test_with_the_map_a_session_stored_after_the_bump_stays_in_the_old_epoch(
    addon: TlsResumption, seq_map: tuple[seqmap.SeqWriter, seqmap.SeqReader]
) -> None:
    writer, reader = seq_map
    addon.seq = reader
    ctx = object()
    a = _data_on(addon, "10.203.0.11", "api.example.test", ("10.204.0.6", 443), _FakeConn(ctx, "A"))
    addon.tls_start_server(a)
    writer.bump(["10.203.0.11"])
    addon.tls_established_server(a)
    addon.response(_flow_for(a))
    assert len(addon.cache) == 1
    assert _handshake(addon, ctx, "10.203.0.11", None).offered is None


def test_an_unreadable_map_offers_and_stores_nothing(
    addon: TlsResumption, seq_map: tuple[seqmap.SeqWriter, seqmap.SeqReader]
) -> None:
    _, reader = seq_map
    addon.seq = reader
    reader.close()  # reads as None: no epoch, so no resumption (closed)
    ctx = object()
    _handshake(addon, ctx, "10.203.0.11", "ticket")
    assert len(addon.cache) == 0
    assert _handshake(addon, ctx, "10.203.0.11", None).offered is None


def test_a_connection_the_addon_did_not_see_start_does_not_resume(addon: TlsResumption) -> None:
    ctx = object()
    _handshake(addon, ctx, "10.203.0.11", "ticket")
    unseen = _FakeConn(ctx)
    addon.tls_start_server(_data("10.203.0.11", "api.example.test", ("10.204.0.6", 443), unseen))
    assert unseen.offered is None
    data = _data_on(addon, "10.203.0.11", "api.example.test", ("10.204.0.6", 443), _FakeConn(ctx))
    assert data.context.client.id in addon._epochs
    addon.client_disconnected(data.context.client)
    assert data.context.client.id not in addon._epochs


def test_an_error_leaves_the_full_handshake(addon: TlsResumption) -> None:
    class Broken(_FakeConn):
        def set_session(self, session: object) -> None:
            raise SSL.Error("boom")

    ctx = object()
    _handshake(addon, ctx, "10.203.0.11", "ticket")
    broken = Broken(ctx)
    addon.tls_start_server(
        _data_on(addon, "10.203.0.11", "api.example.test", ("10.204.0.6", 443), broken)
    )  # no raise
    assert broken.offered is None


async def test_the_child_forgets_sessions_with_the_snapshots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "emit", lambda *a, **kw: None)
    r, w = os.pipe()
    monkeypatch.setattr(sys, "stdin", os.fdopen(r, "rb", buffering=0))
    resumption = TlsResumption()
    resumption.cache.put(K, (object(), "s"), 0.0)  # type: ignore[arg-type]
    injector: Any = type("I", (), {"client": None})()
    task = asyncio.create_task(runner._follow_forgets(injector, runner._CacheReport(injector), resumption))
    try:
        os.write(w, forget_message([K.client]))
        for _ in range(200):
            if not len(resumption.cache):
                break
            await asyncio.sleep(0.01)
        assert len(resumption.cache) == 0
    finally:
        os.close(w)
        await asyncio.wait_for(task, 5)


# ---- the real thing: OpenSSL resumes from the copy --------------------------------------------


def _tls_server(tmp_path: Path, n: int) -> tuple[int, list[bool], Path]:
    """A loopback TLS server that answers, then closes without close_notify (as most do)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "t.test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(1).not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("t.test")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    pem, kpem = tmp_path / "c.pem", tmp_path / "k.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    kpem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    sctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    sctx.load_cert_chain(str(pem), str(kpem))
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen()
    reused: list[bool] = []

    def serve() -> None:
        with ls:
            for _ in range(n):
                c, _ = ls.accept()
                with sctx.wrap_socket(c, server_side=True) as s:
                    s.recv(100)
                    reused.append(bool(s.session_reused))
                    s.sendall(b"ok")

    threading.Thread(target=serve, daemon=True).start()
    return ls.getsockname()[1], reused, pem


@pytest.mark.parametrize("copy", [True, False])
def test_openssl_resumes_from_the_copy_not_from_the_live_session(tmp_path: Path, copy: bool) -> None:
    port, reused, pem = _tls_server(tmp_path, 3)
    cctx = SSL.Context(SSL.TLS_CLIENT_METHOD)
    cctx.load_verify_locations(str(pem))
    cctx.set_verify(SSL.VERIFY_PEER)
    session = None
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            # pyOpenSSL needs a blocking socket; the receive timeout still bounds every read.
            sock.setblocking(True)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 5, 0))
            conn = SSL.Connection(cctx, sock)
            conn.set_tlsext_host_name(b"t.test")
            if session is not None:
                conn.set_session(session)
            conn.set_connect_state()
            conn.do_handshake()
            conn.sendall(b"hi")
            assert conn.recv(100) == b"ok"
            taken = snapshot_session(conn) if copy else conn.get_session()
            with pytest.raises((SSL.SysCallError, SSL.ZeroReturnError)):
                while conn.recv(100):
                    pass
            session = taken
    for _ in itertools.repeat(None, 100):
        if len(reused) == 3:
            break
        threading.Event().wait(0.02)
    assert reused == ([False, True, True] if copy else [False, False, False])


# ---- the self-connect index -------------------------------------------------------------------


def _mitmproxy_rule(listeners: list[tuple[str, int, str]], host: str, port: int, transport: str) -> bool:
    """mitmproxy 12's Proxyserver.server_connect walk, as written there."""
    return any(
        port == lport and host in ("localhost", "127.0.0.1", "::1", lhost) and transport == ltransport
        for lhost, lport, ltransport in listeners
    )


def test_the_index_answers_as_mitmproxys_walk() -> None:
    listeners = [
        ("0.0.0.0", 18081, "tcp"),
        ("::", 18081, "tcp"),
        ("10.203.0.1", 16300, "tcp"),
        ("::1", 53, "udp"),
    ]
    index = ListenIndex(listeners)
    hosts = ["0.0.0.0", "::", "10.203.0.1", "10.204.0.6", "localhost", *LOCAL_NAMES]
    for host, port, transport in itertools.product(hosts, [18081, 16300, 53, 443], ["tcp", "udp"]):
        assert index.self_connect(host, port, transport) == _mitmproxy_rule(
            listeners, host, port, transport
        ), (
            host,
            port,
            transport,
        )


# ---- configuration ----------------------------------------------------------------------------


def test_the_knob_defaults_on_and_reaches_the_child(tmp_path: Path) -> None:
    assert parse_config({}).mitm.tls_resume is True
    assert parse_config({"EGRESSD_MITM_TLS_RESUME": "off"}).mitm.tls_resume is False
    assert parse_config({}, ["--mitm-tls-resume", "off"]).mitm.tls_resume is False
    with pytest.raises(ConfigError, match="EGRESSD_MITM_TLS_RESUME"):
        parse_config({"EGRESSD_MITM_TLS_RESUME": "maybe"})
    on = mitmdump_argv(MitmOptions(1, tmp_path, tmp_path / "s", None))
    off = mitmdump_argv(MitmOptions(1, tmp_path, tmp_path / "s", None, tls_resume=False))
    assert "egressd_tls_resume=true" in on
    assert "egressd_tls_resume=false" in off


class _Servers:
    """What IndexedProxyserver reads of mitmproxy's server list."""

    def __init__(self, listeners: list[tuple[str, int, str]]) -> None:
        self.is_updating = False
        self.listeners = listeners
        self.walks = 0

    def __iter__(self) -> Iterator[Any]:
        self.walks += 1
        for host, port, transport in self.listeners:
            yield type(
                "S",
                (),
                {"listen_addrs": [(host, port)], "mode": type("M", (), {"transport_protocol": transport})},
            )()


def _connect(p: Any, host: str, port: int) -> str | None:
    server = connection.Server(address=(host, port))
    p.server_connect(type("D", (), {"server": server, "client": None})())
    return server.error


def test_the_indexed_proxyserver_refuses_self_connects_and_follows_listener_changes() -> None:
    p: Any = IndexedProxyserver()
    assert p.name == "proxyserver", "mitmproxy and the addon look it up by this name"
    fake = _Servers([("0.0.0.0", 18081, "tcp")])
    p.servers = fake
    assert _connect(p, "127.0.0.1", 18081) == SELF_CONNECT_ERROR
    assert _connect(p, "10.204.0.6", 443) is None
    assert _connect(p, "10.204.0.6", 443) is None
    assert fake.walks == 1, "one walk, then the index answers"
    fake.listeners.append(("0.0.0.0", 16300, "tcp"))
    p._servers_changed()  # mitmproxy's `changed` signal
    assert _connect(p, "localhost", 16300) == SELF_CONNECT_ERROR
    fake.is_updating = True  # while servers change: mitmproxy's own walk (on the real list)
    p.servers = type("Empty", (), {"is_updating": True, "__iter__": lambda self: iter(())})()
    assert _connect(p, "127.0.0.1", 16300) is None


def test_the_child_reads_the_map_egressd_vault_push_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from egressd.mitmchild.vaults import VaultLookup

    monkeypatch.setattr(tlsresume, "emit", lambda *a, **kw: None)
    writer = seqmap.SeqWriter(tmp_path / "active.seq")
    resumption, injector = TlsResumption(), VaultLookup()
    try:
        with taddons.context(resumption, injector) as tctx:  # type: ignore[no-untyped-call]
            assert resumption.seq is None
            tctx.options.update(egressd_vault_push=str(writer.path))
            assert resumption.seq is not None
            writer.bump(["10.203.0.11"])
            assert resumption._epoch("10.203.0.11") == (1, 0, 0)
            tctx.options.update(egressd_vault_push=str(tmp_path / "missing"))
            assert resumption.seq is None, "an unreadable map: the local counts are the epoch"
    finally:
        writer.close()
