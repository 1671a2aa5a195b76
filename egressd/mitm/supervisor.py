"""The shared transparent mitmproxy as a supervised child process (``mitmdump`` + our addon).

Why a child and not a ``master.Master`` in a daemon thread (measured and tried, see docs/concepts/mitm.md,
"Where it sits"): mitmproxy calls ``sys.exit`` on start-up errors, keeps listeners open after
``shutdown()``, installs loop-wide task factories and exception handlers, and its TLS and
HTTP work would compete with the DNS proxy and the action handler for the daemon's GIL. A
child can be killed and restarted without touching enforcement state, its crash cannot take
the control plane down, and the vault reaches it only over a private unix socket.

The child dies with the daemon (``PR_SET_PDEATHSIG``). It is ready when the addon reports
``mitm.ready`` (its listener is bound); until then, and whenever it has died, :attr:`ready`
is False, ``/healthz`` answers 503 and intercepted connections are refused by the kernel
(nothing listens on the port): fail closed. It is restarted with a capped backoff.

The child's stdin is egressd's one-way channel to it: :meth:`MitmSupervisor.forget` queues
client addresses whose cached vault snapshot the child must drop (docs/reference/behaviour.md §14.9), written
as forget lines (:func:`egressd.mitm.protocol.forget_message`). The queue is bounded: past
:data:`FORGET_QUEUE_MAX` addresses it collapses into one "forget every client" line. The
child reports its cache size in ``mitm.cache`` events (``egressd_mitm_snapshot_cache_entries``).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from egressd.kernel.listeners import wildcard_listeners
from egressd.metrics import EgressMetrics
from egressd.mitm.handover import Listen, handover_env
from egressd.mitm.protocol import (
    CACHE_EVENT,
    CACHE_MAX_ENTRIES,
    CONNECTION_EVENT,
    FORGET_BATCH,
    READY_EVENT,
    forget_message,
)

log = structlog.get_logger("egressd.mitm")

_PR_SET_PDEATHSIG: Final = 1
_PR_SET_NO_NEW_PRIVS: Final = 38
_LINUX_CAPABILITY_VERSION_3: Final = 0x20080522
FORGET_QUEUE_MAX: Final = CACHE_MAX_ENTRIES  # more than the child can hold: forget everyone


@dataclass(frozen=True, slots=True)
class MitmOptions:
    port: int
    confdir: Path
    active_socket: Path
    upstream_trust_dir: Path | None  # None with ssl_insecure
    ssl_insecure: bool = False
    stream_large_bodies: str = "1m"
    lookup_timeout: float = 0.25
    # Per-subject listeners (host-uid subjects, docs/reference/behaviour.md §17), all bound from the start: a
    # subject's port then never waits for the child, and the kernel lets only its owner in.
    subject_ports: tuple[int, ...] = ()
    ignore_hosts: tuple[str, ...] = ()  # OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS (docs/reference/behaviour.md §16)
    tls_resume: bool = True  # EGRESSD_MITM_TLS_RESUME (egressd.mitmchild.tlsresume)
    body_redaction: bool = True  # EGRESSD_MITM_BODY_REDACTION (egressd.mitmchild.respbody)
    kernel_relay: bool = True  # EGRESSD_MITM_KERNEL_RELAY (egressd.mitmchild.splicerelay)
    vault_push: Path | None = None  # the narrowing sequence map (EGRESSD_MITM_VAULT_PUSH=on)
    # SO_MARK of the listeners the supervisor binds for the child (fleet: OWNER_MARK, §20.1).
    listen_mark: int | None = None
    name_check: bool = False  # EGRESSD_NAME_CHECK (docs/reference/behaviour.md §18)


def mitmdump_argv(opts: MitmOptions, python: str = sys.executable) -> list[str]:
    """The child's command line (pure; tested): the lean master of :mod:`egressd.mitmchild.runner`."""
    settings = [
        "mode=transparent",
        *(f"mode=transparent@{port}" for port in opts.subject_ports),
        f"listen_port={opts.port}",
        f"confdir={opts.confdir}",
        # Nothing reaches the upstream before the addon has decided: no eager connect, no
        # certificate sniffing (the leaf is minted from the SNI).
        "connection_strategy=lazy",
        "upstream_cert=false",
        "termlog_verbosity=warn",
        f"stream_large_bodies={opts.stream_large_bodies}",
    ]
    if opts.ssl_insecure or opts.upstream_trust_dir is None:
        settings.append("ssl_insecure=true")
    else:
        settings.append(f"ssl_verify_upstream_trusted_confdir={opts.upstream_trust_dir}")
    # mitmproxy's own pass-through option, one --set per pattern (a sequence option appends).
    settings += [f"ignore_hosts={pattern}" for pattern in opts.ignore_hosts]
    settings += [
        f"egressd_active_socket={opts.active_socket}",
        f"egressd_lookup_timeout_ms={round(opts.lookup_timeout * 1000)}",
        f"egressd_tls_resume={'true' if opts.tls_resume else 'false'}",
        f"egressd_body_redaction={'true' if opts.body_redaction else 'false'}",
        f"egressd_kernel_relay={'true' if opts.kernel_relay else 'false'}",
        f"egressd_vault_push={opts.vault_push or ''}",
        f"egressd_name_check={'true' if opts.name_check else 'false'}",
    ]
    argv = [python, "-m", "egressd.mitmchild.runner"]
    for setting in settings:
        argv += ["--set", setting]
    return argv


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _child_setup(gid: int | None) -> Callable[[], None]:
    """Runs in the forked child before exec.

    1. switch to group ``gid`` (if given; the only step that needs a capability, CAP_SETGID);
    2. drop every capability and set no_new_privs: the child keeps uid 0 (so it can read the
       root-owned interpreter, confdir and socket as their owner) but execs with an empty
       capability set. It parses untrusted TLS and HTTP: a compromise must not be able to
       touch the nft table (CAP_NET_ADMIN) or anything else privileged;
    3. die with the parent (set last: a credential change clears it).
    """

    def setup() -> None:
        if gid is not None:
            os.setgroups([])
            os.setgid(gid)
        libc = ctypes.CDLL(None, use_errno=True)
        header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
        data = (_CapData * 2)()
        if libc.capset(ctypes.byref(header), data) != 0:
            raise OSError(ctypes.get_errno(), "capset")
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return setup


class MitmSupervisor:
    def __init__(
        self,
        argv: Sequence[str],
        *,
        backoff: tuple[float, float] = (0.2, 5.0),
        gid: int | None = None,
        metrics: EgressMetrics | None = None,
        before_restart: Callable[[], None] | None = None,
        worker: int = 0,
        listen: Listen | None = None,
    ) -> None:
        """``gid``: run the child with this group id (and no supplementary groups). The sidecar
        profile exempts the MITM's own upstream connections from its 80/443 redirect by
        ``meta skgid``; the user id is kept so the interpreter and confdir stay readable.
        ``before_restart`` runs before every start but the first (the CA is re-checked and
        re-exported there); when it raises, no child is started and it is tried again after
        the backoff: nothing listens, so intercepted connections are refused (closed).
        ``worker``: this child's index among the workers (EGRESSD_MITM_WORKERS), the ``worker``
        label of its metrics; the gauges are registered by :class:`egressd.mitm.pool.MitmPool`.
        ``listen``: the child's listening ports, bound (and marked) here before each start and
        handed to it (:mod:`egressd.mitm.handover`): the child holds no capability, so it could
        not mark them itself; None: the child binds its own (tests)."""
        self.argv = list(argv)
        self.listen = listen
        self.worker = worker
        self._label = str(worker)
        self.backoff = backoff
        self.gid = gid
        self.metrics = metrics
        self.before_restart = before_restart
        self.ready = False
        self.cache_entries = 0  # as last reported by the running child (a new one starts empty)
        self._forget: set[str] = set()
        self._forget_all = False
        self._forget_wake = asyncio.Event()
        self.pid: int | None = None
        self.starts = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._became_ready = asyncio.Event()

    def forget(self, ips: Iterable[object] | None) -> None:
        """Tell the running child to drop these clients' vault snapshots (None: all of them).
        A client is an address, or a per-subject port's :func:`~egressd.feed.port_key`.

        Called synchronously at the mutation (subject removed or rebound, vault deleted or
        changed), after the sequence map's bump (:class:`egressd.mitm.seqmap.MitmMemory`, the
        change feed's subscriber); delivery is asynchronous, in order, and never blocks the
        caller. Without a running child there is nothing to forget: the next one starts with an
        empty cache.
        """
        ips = None if ips is None else list(ips)
        if self._proc is None:
            return
        if ips is None:
            self._forget_all = True
            self._forget.clear()
        elif not self._forget_all:
            self._forget.update(str(ip) for ip in ips)
            if len(self._forget) > FORGET_QUEUE_MAX:
                self._forget_all = True
                self._forget.clear()
        self._forget_wake.set()

    def _take_forgets(self) -> list[bytes]:
        if self._forget_all:
            lines = [forget_message(None)]
        else:
            ips = sorted(self._forget)
            lines = [forget_message(ips[i : i + FORGET_BATCH]) for i in range(0, len(ips), FORGET_BATCH)]
        self._forget_all = False
        self._forget.clear()
        self._forget_wake.clear()
        return lines

    async def _feed(self, proc: asyncio.subprocess.Process) -> None:
        """Write queued forgets to the child's stdin; drain() bounds what waits in the pipe
        (a stopped child makes the queue, not memory, grow, and the queue is capped)."""
        stdin = proc.stdin
        assert stdin is not None
        try:
            while True:
                await self._forget_wake.wait()
                for line in self._take_forgets():
                    stdin.write(line)
                await stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return  # the child died; its cache died with it

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._became_ready.wait(), timeout)
        except TimeoutError:
            return False
        return self.ready

    async def run(self) -> None:
        delay = self.backoff[0]
        while not self._stopping:
            proc = await self._start_child()
            if proc is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff[1])
                continue
            self._proc = proc
            self.pid = proc.pid
            log.info("mitm.started", pid=proc.pid, start=self.starts, worker=self.worker)
            feeder = asyncio.create_task(self._feed(proc))
            try:
                was_ready = await self._pump(proc)
                code = await proc.wait()
            finally:
                feeder.cancel()
                # Also when this task is cancelled: whatever was queued was for the dead
                # child's cache, and a child that is gone holds nothing (the next starts empty).
                self._take_forgets()
                self.cache_entries = 0
                self.ready = False
                self._became_ready.clear()
                self._proc = None
                self.pid = None  # the status report shows no pid for a worker that is down
            if self._stopping:
                break
            log.warning("mitm.exited", pid=proc.pid, code=code, restart_in_s=delay, worker=self.worker)
            await asyncio.sleep(delay)
            delay = self.backoff[0] if was_ready else min(delay * 2, self.backoff[1])

    async def _start_child(self) -> asyncio.subprocess.Process | None:
        """The CA check (before every start but the first), the listeners, then the child; None
        (logged, retried after the backoff) when one of them fails: nothing listens meanwhile."""
        if self.starts and self.before_restart is not None:
            try:
                self.before_restart()
            except Exception as exc:
                # One line, the reason only (CaError/ExportError never carry key material).
                log.error("mitm.restart_refused", error=str(exc)[:200])
                return None
        try:
            socks = await asyncio.to_thread(wildcard_listeners, self.listen.ports, mark=self.listen.mark) if self.listen else []
        except OSError as exc:
            # Somebody holds one of the worker's ports (a sandbox uid squatting it while the
            # child restarted): it receives nothing (docs/reference/behaviour.md §20.1); the child waits.
            log.error("mitm.listen_failed", error=exc.strerror or str(exc)[:200], worker=self.worker)
            return None
        self.starts += 1
        if self.metrics is not None:
            self.metrics.mitm_starts.inc(self._label)
        try:
            return await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_child_setup(self.gid),
                pass_fds=[s.fileno() for s in socks],
                env=handover_env(socks) if socks else None,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            # SubprocessError: the pre-exec set-up failed (e.g. no CAP_SETGID for the gid).
            log.error("mitm.spawn_failed", error=getattr(exc, "strerror", None) or str(exc)[:200])
            return None
        finally:
            for sock in socks:  # the child holds them now: its death frees the ports
                sock.close()

    async def _pump(self, proc: asyncio.subprocess.Process) -> bool:
        """Read the child's output until it closes; True once it reported ready."""
        assert proc.stdout is not None
        was_ready = False
        while True:
            try:
                raw = await proc.stdout.readuntil(b"\n")
            except asyncio.IncompleteReadError as exc:
                raw = exc.partial  # the child's last words without a newline
                if not raw:
                    return was_ready
            except asyncio.LimitOverrunError as exc:
                # A line over the stream limit: drop it, exactly it. (readline() raises a bare
                # ValueError after consuming the whole line in one case and only part of it in
                # the other, so the line after it could not be told from its remainder.)
                await _skip_line(proc.stdout, exc.consumed)
                continue
            line = raw.decode("utf-8", "replace").rstrip()
            event = _parse_event(line)
            if event is None:
                # mitmproxy's own warnings and error tracebacks: their messages can quote
                # traffic (an event repr with raw bytes), so only the kind is kept.
                if line.strip():
                    log.warning("mitm.output", pid=proc.pid, line=output_kind(line))
                continue
            event.pop("pid", None)  # ours; a clash would make the log call raise
            event.pop("worker", None)
            name = str(event.pop("event"))
            self._count(name, event)
            if name == CACHE_EVENT:
                # Not logged: it changes with traffic. Only the size is kept (a gauge).
                entries = event.get("entries")
                if isinstance(entries, int) and not isinstance(entries, bool) and entries >= 0:
                    self.cache_entries = entries
                continue
            if name == READY_EVENT:
                was_ready = True
                self.ready = True
                self._became_ready.set()
                log.info("mitm.ready", pid=proc.pid, worker=self.worker, **event)
            elif name in ("mitm.refused", "mitm.response_refused", "mitm.error"):
                log.warning(name, pid=proc.pid, **event)
            else:
                log.info(name, pid=proc.pid, **event)

    def _count(self, name: str, event: dict[str, object]) -> None:
        """The metrics a decision event feeds (requests by outcome, connections by decision)."""
        if self.metrics is None:
            return
        outcome = _OUTCOMES.get(name)
        if outcome is not None:
            self.metrics.mitm_requests.inc(self._label, outcome)
        elif name == CONNECTION_EVENT:
            # Only the known label values: the child parses untrusted traffic, and what it
            # writes must not be able to grow the metric without bound.
            labels = (str(event.get("protocol")), str(event.get("decision")))
            if labels in _CONNECTION_LABELS:
                self.metrics.mitm_connections.inc(self._label, *labels)

    async def stop(self) -> None:
        self._stopping = True
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()


_CONNECTION_LABELS: Final = frozenset(
    {
        ("tls", "decrypt"),
        ("tls", "passthrough"),
        ("http", "parse"),
        ("http", "passthrough"),
        # Refused by the name check (docs/reference/behaviour.md §18) before any upstream connection.
        ("tls", "refuse"),
        ("http", "refuse"),
        # Neither TLS nor HTTP (or a silent client of a server-first protocol), on a port the
        # name check covers: relayed where no name is needed, else refused.
        ("tcp", "passthrough"),
        ("tcp", "refuse"),
    }
)

_OUTCOMES: Final = {
    "mitm.injected": "injected",
    "mitm.pass": "pass",
    "mitm.refused": "refused",
    "mitm.error": "error",
}


_LOG_PREFIX: Final = re.compile(r"^(?:\[[^\]]*\])+\s*")


def output_kind(line: str) -> str:
    """A line of mitmproxy's own output, reduced to its kind: the ``[time][client]`` prefix and
    the text before the first ``:`` (``connection handler has crashed``, ``AssertionError``),
    capped. What follows a colon may be raw traffic."""
    prefix = _LOG_PREFIX.match(line)
    head = line[prefix.end() :] if prefix else line
    return (prefix.group(0) if prefix else "") + head.split(":", 1)[0][:160]


async def _skip_line(reader: asyncio.StreamReader, buffered: int) -> None:
    """Discard the rest of an over-long line whose first ``buffered`` bytes are readable."""
    while True:
        await reader.readexactly(buffered)
        try:
            await reader.readuntil(b"\n")
            return
        except asyncio.IncompleteReadError:
            return
        except asyncio.LimitOverrunError as exc:
            buffered = exc.consumed


def _parse_event(line: str) -> dict[str, object] | None:
    if not line.startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("event"), str)
        or not obj["event"].startswith("mitm.")
    ):
        return None
    return obj
