"""The MITM child's upstream TLS session resumption (``egressd_tls_resume``; docs/reference/behaviour.md §10).

A mitmproxy addon, loaded after ``tlsconfig`` (which builds the upstream ``SSL.Connection``):
``client_connected`` records the client's epoch (:class:`~egressd.mitmchild.resume.SessionKey`),
``tls_start_server`` offers a session of :class:`~egressd.mitmchild.resume.SessionCache` for the
connection's key, ``tls_established_server`` remembers the verified connection, and the first
complete response on it stores a copy of its session: in TLS 1.3 the server's tickets arrive after
the handshake, before the response. The keying rules are in :mod:`egressd.mitmchild.resume`.

Fail closed: any error here leaves the connection to mitmproxy's own full, verified handshake;
a failed upstream handshake drops the key's sessions. Off: nothing is offered or stored.
"""

from __future__ import annotations

import time
from typing import Any, Final

from mitmproxy import connection, ctx, http, tls
from mitmproxy.addonmanager import Loader
from mitmproxy.proxy import server_hooks
from OpenSSL import SSL

from egressd.feed import port_key
from egressd.mitm.seqmap import SLOTS, SeqReader, slot_of
from egressd.mitmchild.resume import SessionCache, SessionKey
from egressd.mitmchild.shared import address_of, emit, ip_of, listen_port

OPTION: Final = "egressd_tls_resume"
_TRACKED_MAX: Final = 65536  # established upstream connections waiting for their session
_EXPIRE_EVERY_S: Final = 30.0
_MAP_OPTION: Final = "egressd_vault_push"  # the vault lookup's option: egressd's sequence map


def _open_map(path: str) -> SeqReader | None:
    if not path:
        return None
    try:
        return SeqReader(path)
    except OSError as exc:  # then the local forget counts are the epoch
        emit("mitm.error", hook="configure", error=f"tls resume map: {type(exc).__name__}")
        return None


def client_key(client: connection.Client, shared_port: int | None) -> str | None:
    """The sandbox behind a client connection, as egressd names it in its bumps and forgets."""
    listen = listen_port(client, shared_port)
    return port_key(listen) if listen is not None else ip_of(client.peername)


class TlsResumption:
    def __init__(self, clock: Any = time.monotonic, seq: SeqReader | None = None) -> None:
        self.enabled = True
        self.shared_port: int | None = None
        self.cache: SessionCache[tuple[SSL.Context, SSL.Session]] = SessionCache()
        self.clock = clock
        self.seq = seq
        self._tracked: dict[str, tuple[SessionKey, Any]] = {}  # server connection id -> (key, SSL.Connection)
        self._epochs: dict[str, tuple[int, ...]] = {}  # client connection id -> its epoch at the start
        # Forget lines seen, for all clients and per slot (a hash, so bounded): the epoch
        # without the map, and on top of it with one.
        self._forgot_all = 0
        self._forgot = [0] * SLOTS
        self._expired_at = 0.0

    def load(self, loader: Loader) -> None:
        loader.add_option(OPTION, bool, True, "resume upstream TLS sessions per sandbox, SNI and address")

    def configure(self, updated: set[str]) -> None:
        if "listen_port" in updated:
            self.shared_port = ctx.options.listen_port
        if OPTION in updated:
            self.enabled = bool(getattr(ctx.options, OPTION))
        if _MAP_OPTION in updated:
            # Epochs of another map are not comparable: start afresh.
            if self.seq is not None:
                self.seq.close()
            self.seq = _open_map(getattr(ctx.options, _MAP_OPTION))
            self.cache.forget(None)
            self._tracked.clear()
            self._epochs.clear()
        # A changed verification setting or trust store invalidates what was verified before.
        if updated & {
            OPTION,
            "ssl_insecure",
            "ssl_verify_upstream_trusted_confdir",
            "ssl_verify_upstream_trusted_ca",
        }:
            self.cache.forget(None)
            self._tracked.clear()

    def forget(self, clients: list[str] | None) -> None:
        """egressd's forget line (docs/reference/behaviour.md §14.9): the subject behind these clients is gone or
        rebound, so the next sandbox with the same address or port must not get its sessions.
        Connections that start from now on have a newer epoch (without the map, the only one
        that moves; with it, egressd moved the slot already)."""
        self.cache.forget(clients)
        if clients is None:
            self._forgot_all += 1
            self._tracked.clear()
        else:
            gone = set(clients)
            for client in gone:
                self._forgot[slot_of(client)] += 1
            for sid in [s for s, (key, _) in self._tracked.items() if key.client in gone]:
                del self._tracked[sid]

    def _epoch(self, client: str) -> tuple[int, ...] | None:
        local = (self._forgot_all, self._forgot[slot_of(client)])
        if self.seq is None:
            return local
        value = self.seq.value(client)
        return None if value is None else (value, *local)

    def client_connected(self, client: connection.Client) -> None:
        """The epoch is taken when the client connection starts: whatever this connection
        stores later belongs to that epoch, also when a removal comes in between."""
        if len(self._epochs) >= _TRACKED_MAX:
            return  # no epoch: nothing is offered or stored for this connection
        try:
            key = client_key(client, self.shared_port)
            epoch = self._epoch(key) if key is not None else None
            if epoch is not None:
                self._epochs[client.id] = epoch
        except Exception as exc:
            emit("mitm.error", hook="client_connected", error=type(exc).__name__)

    def client_disconnected(self, client: connection.Client) -> None:
        self._epochs.pop(client.id, None)

    def _key(self, data: tls.TlsData) -> SessionKey | None:
        server = data.conn
        if not isinstance(server, connection.Server):
            return None
        client = client_key(data.context.client, self.shared_port)
        epoch = self._epochs.get(data.context.client.id)
        address = address_of(server.address)
        if client is None or epoch is None or address is None or not server.sni or data.is_dtls:
            return None
        verify = not ctx.options.ssl_insecure
        trust = (
            f"{ctx.options.ssl_verify_upstream_trusted_confdir}|{ctx.options.ssl_verify_upstream_trusted_ca}"
            if verify
            else ""
        )
        return SessionKey(
            client=client, sni=server.sni, address=address, verify=verify, trust=trust, epoch=epoch
        )

    def tls_start_server(self, data: tls.TlsData) -> None:
        if not self.enabled or data.ssl_conn is None:
            return
        try:
            key = self._key(data)
            stored = self.cache.take(key, self.clock()) if key is not None else None
            # pyOpenSSL refuses a session of another context; a new context (changed options)
            # simply starts without one.
            if stored is not None and stored[0] is data.ssl_conn.get_context():
                data.ssl_conn.set_session(stored[1])
        except Exception as exc:  # the full handshake stays, verified as always
            emit("mitm.error", hook="tls_start_server", error=type(exc).__name__)

    def tls_established_server(self, data: tls.TlsData) -> None:
        if not self.enabled or data.ssl_conn is None or len(self._tracked) >= _TRACKED_MAX:
            return
        try:
            key = self._key(data)
            if key is not None:
                self._tracked[data.conn.id] = (key, data.ssl_conn)
        except Exception as exc:
            emit("mitm.error", hook="tls_established_server", error=type(exc).__name__)

    def tls_failed_server(self, data: tls.TlsData) -> None:
        try:
            key = self._key(data)
            if key is not None:
                self.cache.drop(key)
        except Exception as exc:
            emit("mitm.error", hook="tls_failed_server", error=type(exc).__name__)

    def response(self, flow: http.HTTPFlow) -> None:
        """The first complete response on a verified upstream connection stores its session
        (TLS 1.3 tickets come before it); later ones on the same connection do nothing."""
        tracked = self._tracked.pop(flow.server_conn.id, None)
        if tracked is None or not self.enabled:
            return
        key, ssl_conn = tracked
        try:
            session = snapshot_session(ssl_conn)
            now = self.clock()
            if session is not None:
                self.cache.put(key, (ssl_conn.get_context(), session), now)
            if now - self._expired_at >= _EXPIRE_EVERY_S:
                self._expired_at = now
                self.cache.expire(now)
        except Exception as exc:
            emit("mitm.error", hook="tls_session", error=type(exc).__name__)

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._tracked.pop(data.server.id, None)  # no complete response: nothing is stored


def snapshot_session(ssl_conn: SSL.Connection) -> SSL.Session | None:
    """A copy of the connection's current session (serialised and parsed again; in memory only).

    OpenSSL marks the live session not resumable when the upstream ends the connection without
    close_notify, which most servers do after the response (TLS 1.3 no longer asks for that,
    RFC 8446 §6.1) and which would leave nothing to resume. The copy is taken at the first
    complete response, from the verified handshake and the tickets that followed it."""
    live = ssl_conn.get_session()
    if live is None:
        return None
    # pyOpenSSL has no session copy; its cffi binding (which mitmproxy uses too) has i2d/d2i.
    lib, ffi = vars(SSL)["_lib"], vars(SSL)["_ffi"]
    size = lib.i2d_SSL_SESSION(live._session, ffi.NULL)
    if size <= 0:
        return None
    buf = ffi.new("unsigned char[]", size)
    if lib.i2d_SSL_SESSION(live._session, ffi.new("unsigned char **", buf)) != size:
        return None
    ptr = lib.d2i_SSL_SESSION(ffi.NULL, ffi.new("const unsigned char **", buf), size)
    if ptr == ffi.NULL:
        return None
    copy = SSL.Session.__new__(SSL.Session)
    copy._session = ffi.gc(ptr, lib.SSL_SESSION_free)
    copy._context = live._context
    return copy
