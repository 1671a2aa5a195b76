"""Start-up of the MITM side of the daemon, shared by both profiles: the CA (and its export,
``EGRESSD_MITM_CA_EXPORT_DIR``), the private ``_active`` unix socket the child reads vaults
from, and the supervised child itself."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import structlog
from aiohttp import web

from egressd.feed import Feed
from egressd.metrics import EgressMetrics
from egressd.mitm.active import Lookup, PortVaults, Verify, active_app
from egressd.mitm.ca import CaError, CaInfo, ensure_ca
from egressd.mitm.config import MitmConfig
from egressd.mitm.export import ExportError, check_separate, export_ca
from egressd.mitm.names import NameService
from egressd.mitm.pool import MitmPool
from egressd.mitm.seqmap import MitmMemory, SeqWriter, seq_path
from egressd.mitm.supervisor import MitmOptions

log = structlog.get_logger("egressd.mitm")


DEFAULT_SOCKET = Path("/run/opensandbox/credential-proxy/active.sock")


def _serving(path: Path) -> bool:
    """Whether a live process listens on the unix socket ``path`` (a stale file does not)."""
    if not path.exists():
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


class MitmStartupError(Exception):
    """One-line reason the MITM cannot start (the daemon refuses to start)."""


@dataclass
class CaKeeper:
    """The CA in use, and its exported copy. The child reads the CA from the confdir at every
    start, so the CA can only change then: :meth:`refresh` runs before each restart."""

    confdir: Path
    export_dir: Path | None
    ca: CaInfo

    def export(self) -> None:
        if self.export_dir is None:
            return
        written = export_ca(self.export_dir, self.ca.pem)
        if written:
            log.info(
                "mitm.ca_exported", dir=str(self.export_dir), files=written, fingerprint=self.ca.fingerprint
            )

    def refresh(self) -> None:
        """Re-check the confdir's CA (a replaced pinned CA, a deleted one regenerated) and keep
        the export in step. Raises CaError/ExportError: the child is then not started."""
        ca = ensure_ca(self.confdir)
        if ca.fingerprint != self.ca.fingerprint:
            log.warning("mitm.ca_changed", old=self.ca.fingerprint, new=ca.fingerprint, pinned=ca.pinned)
            self.ca = ca
        self.export()


@dataclass
class RunningMitm:
    keeper: CaKeeper
    supervisor: MitmPool  # the workers (EGRESSD_MITM_WORKERS), each supervised on its own
    active: web.AppRunner
    socket: Path
    seq: SeqWriter | None = None  # EGRESSD_MITM_VAULT_PUSH=on
    unsubscribe: Callable[[], None] | None = None  # from the daemon's change feed

    @property
    def ca(self) -> CaInfo:
        return self.keeper.ca

    def subscribe(self, feed: Feed) -> None:
        """The MITM memory subscribes to the daemon's change feed (:mod:`egressd.feed`): from
        now on every narrowing bumps the map, and a vault change tells the workers to forget.
        Called right after :func:`start_mitm`, before the caller awaits anything."""
        self.unsubscribe = feed.subscribe(MitmMemory(self.seq, self.supervisor.forget))

    async def close(self) -> None:
        if self.unsubscribe is not None:
            self.unsubscribe()
        if self.seq is not None:
            self.seq.close()
        await self.supervisor.stop()
        await self.active.cleanup()
        with contextlib.suppress(OSError):
            self.socket.unlink()


def _ca_keeper(cfg: MitmConfig) -> CaKeeper:
    """The CA pinned or generated in the confdir, exported when ``EGRESSD_MITM_CA_EXPORT_DIR``
    is set (MitmStartupError, one line, when either is unusable)."""
    try:
        ca = ensure_ca(cfg.confdir)
    except CaError as exc:
        raise MitmStartupError(f"mitm CA: {exc}") from None
    keeper = CaKeeper(cfg.confdir, cfg.ca_export_dir, ca)
    try:
        if keeper.export_dir is not None:
            check_separate(keeper.export_dir, cfg.confdir)
        keeper.export()
    except ExportError as exc:
        raise MitmStartupError(f"EGRESSD_MITM_CA_EXPORT_DIR: {exc}") from None
    return keeper


def _private_app(
    cfg: MitmConfig, lookup: Lookup, verify: Verify, by_port: PortVaults | None, names: NameService | None
) -> web.Application:
    """The private socket's routes; the name check's only when it is on, request rules' always
    (docs/reference/behaviour.md §18, §19)."""
    return active_app(lookup, verify, by_port, names, name_check=cfg.name_check)


async def start_mitm(
    cfg: MitmConfig,
    lookup: Lookup,
    verify: Verify,
    *,
    gid: int | None = None,
    metrics: EgressMetrics | None = None,
    by_port: PortVaults | None = None,
    listen_mark: int | None = None,
    names: NameService | None = None,
) -> RunningMitm:
    """CA, the private ``_active`` socket, then the supervised MITM workers (docs/reference/behaviour.md §10).
    ``lookup``/``verify`` (and ``by_port``, for the per-subject ports of host-uid subjects)
    answer the child's vault lookups (:mod:`egressd.mitm.active`); ``gid`` is the child's
    group id (the sidecar exempts the MITM's own traffic by it); ``listen_mark`` the workers'
    listeners' SO_MARK (the fleet's owner mark, docs/reference/behaviour.md §20.1); ``names`` answers the
    name check the workers run when ``cfg.name_check`` (docs/reference/behaviour.md §18)."""
    keeper = _ca_keeper(cfg)
    ca = keeper.ca
    trust: Path | None = None
    if not cfg.ssl_insecure:
        trust = cfg.upstream_trust_dir
        if not trust.is_dir():
            raise MitmStartupError(
                f"OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR: {trust} is not a directory"
            )
    sock = cfg.credential_proxy_socket
    try:
        sock.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(sock.parent, 0o700)
        if _serving(sock):
            # Another egressd answers there: taking its path over would let its MITM child ask
            # us for vaults (or ours ask it). The default path falls back to one of our own;
            # an explicitly configured one is a configuration error.
            if sock != DEFAULT_SOCKET:
                raise MitmStartupError(
                    f"OPENSANDBOX_CREDENTIAL_PROXY_SOCKET: {sock} is in use by another process"
                )
            sock = sock.with_name(f"active-{os.getpid()}.sock")
            log.warning("mitm.socket_in_use", default=str(DEFAULT_SOCKET), using=str(sock))
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
    except OSError as exc:
        raise MitmStartupError(f"OPENSANDBOX_CREDENTIAL_PROXY_SOCKET: {sock}: {exc.strerror}") from None
    active = web.AppRunner(_private_app(cfg, lookup, verify, by_port, names), access_log=None, handle_signals=False)
    await active.setup()
    try:
        await web.UnixSite(active, str(sock)).start()
        os.chmod(sock, 0o600)
    except OSError as exc:
        await active.cleanup()
        raise MitmStartupError(f"OPENSANDBOX_CREDENTIAL_PROXY_SOCKET: {sock}: {exc.strerror}") from None
    opts = _options(cfg, sock, trust, by_port.ports if by_port else (), listen_mark)
    seq = _sequence_map(cfg, sock)
    if seq is not None:
        opts = replace(opts, vault_push=seq.path)
    log.info("mitm.ca", fingerprint=ca.fingerprint, pinned=ca.pinned, confdir=str(ca.confdir))
    # keeper.refresh runs before every worker's restart: the CA can change only at a start.
    supervisor = MitmPool.build(opts, cfg.workers, gid=gid, metrics=metrics, before_restart=keeper.refresh)
    return RunningMitm(keeper, supervisor, active, sock, seq)


def _sequence_map(cfg: MitmConfig, sock: Path) -> SeqWriter | None:
    """The narrowing sequence map beside the socket (docs/reference/behaviour.md §10, "answered from memory"); None
    when off or when it cannot be made: the child then pulls on every lookup, as before."""
    if not cfg.vault_push:
        return None
    try:
        seq = SeqWriter(seq_path(sock))
    except OSError as exc:
        log.warning("mitm.vault_push_unavailable", error=exc.strerror or type(exc).__name__)
        return None
    seq.start_heartbeat()
    return seq


def _options(
    cfg: MitmConfig, sock: Path, trust: Path | None, subject_ports: tuple[int, ...], listen_mark: int | None
) -> MitmOptions:
    return MitmOptions(
        port=cfg.port,
        confdir=cfg.confdir,
        active_socket=sock,
        upstream_trust_dir=trust,
        ssl_insecure=cfg.ssl_insecure,
        subject_ports=subject_ports,
        ignore_hosts=cfg.ignore_hosts,
        tls_resume=cfg.tls_resume,
        listen_mark=listen_mark,
        body_redaction=cfg.body_redaction,
        kernel_relay=cfg.kernel_relay,
        name_check=cfg.name_check,
    )
