"""The MITM child's entry point: a lean mitmproxy master with only what egressd needs.

``mitmdump`` loads 36 addons (playback, export, map-local, the flow dumper, …) and every flow
event is dispatched through all of them; measured, that dispatch was a quarter of the child's
CPU per request. This master loads: core (option checks), proxyserver (with the indexed
self-connect check of :mod:`egressd.mitmchild.selfconnect`) + next_layer + tlsconfig (the proxy
itself), upstream TLS session resumption (:mod:`egressd.mitmchild.tlsresume`), disable_h2c (refuses
h2c upgrades, which would smuggle requests past the hooks), errorcheck (start-up errors exit non-zero, so the supervisor restarts us), termlog (warnings
on stdout) and egressd's addons, one per concern as mitmproxy's own (:func:`egress_addons`:
the client's vault, interception §16, injection §10, responses, readiness), with the streamed-response guards of
:mod:`egressd.mitmchild.streampatch` (abort, HTTP/2 backpressure) installed first. There is no flow dumper at all (headers carry credentials), and
no ``config.yaml`` is read from the confdir.

Run as ``python -m egressd.mitmchild.runner --set name=value …`` (options of mitmproxy and of the
egressd addons, as built by :func:`egressd.mitm.supervisor.mitmdump_argv`).

Besides mitmproxy, two small tasks (docs/reference/behaviour.md §14.9): stdin carries egressd's *forget* lines
(clients whose vault snapshot the cache must drop now: subject removed or rebound, vault
deleted), and a ``mitm.cache`` event reports the cache size whenever it changed, so egressd
can export it (``egressd_mitm_snapshot_cache_entries``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, Final

from mitmproxy import ctx, exceptions, master, options
from mitmproxy.addons import core, errorcheck, next_layer, tlsconfig

from egressd.hygiene import disable_core_dumps
from egressd.kernel.listeners import raise_fd_limit
from egressd.mitm.protocol import CACHE_EVENT, READY_EVENT, parse_forget
from egressd.mitmchild import streampatch
from egressd.mitmchild.handover import adopt, listen_on_adopted
from egressd.mitmchild.injection import Injection
from egressd.mitmchild.interception import Interception
from egressd.mitmchild.names import NameGate
from egressd.mitmchild.requestgate import RequestGate
from egressd.mitmchild.responses import Responses
from egressd.mitmchild.selfconnect import IndexedProxyserver
from egressd.mitmchild.shared import emit
from egressd.mitmchild.splicerelay import SpliceRelay
from egressd.mitmchild.tlsresume import TlsResumption
from egressd.mitmchild.upgrades import OnlyWebSocketUpgrades
from egressd.mitmchild.vaults import VaultLookup

CACHE_REPORT_INTERVAL_S: Final = 0.5
_STDIN_LINE_LIMIT: Final = 1 << 20


def _settings(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    args = list(argv)
    while args:
        flag = args.pop(0)
        if flag != "--set" or not args:
            raise SystemExit(f"egressd-mitm: unexpected argument {flag!r} (only --set name=value)")
        out.append(args.pop(0))
    return out


class Ready:
    """Start-up done: the start-up objects frozen, and the supervisor told the listeners are bound."""

    def running(self) -> None:
        # Start-up objects live forever: keep them out of full collections, which otherwise
        # pause every flow for 60-130 ms every couple of seconds under load (measured).
        gc.collect()
        gc.freeze()
        server = ctx.master.addons.get("proxyserver")
        if server is not None and server.listen_addrs():
            emit(READY_EVENT, listen=[list(a)[:2] for a in server.listen_addrs()])


def egress_addons(vaults: VaultLookup) -> list[Any]:
    """egressd's addons, in hook order: each hook is handled by one of them."""
    names = NameGate(vaults)
    requests = RequestGate(vaults)
    relay = SpliceRelay()
    return [
        vaults,
        names,
        Interception(vaults, names, requests, relay),
        relay,
        Injection(vaults, names, requests),
        Responses(),
        Ready(),
    ]


class _CacheReport:
    """Emits ``mitm.cache`` when the size (or the eviction count) differs from the last report."""

    def __init__(self, vaults: VaultLookup) -> None:
        self.vaults = vaults
        self.last: tuple[int, int] | None = None

    def __call__(self) -> None:
        client = self.vaults.client
        now = (len(client.cache), client.evictions) if client is not None else (0, 0)
        if now != self.last:
            self.last = now
            emit(CACHE_EVENT, entries=now[0], evictions=now[1])

    async def run(self) -> None:
        while True:
            self()
            await asyncio.sleep(CACHE_REPORT_INTERVAL_S)


async def _follow_forgets(
    vaults: VaultLookup, report: _CacheReport, resumption: TlsResumption | None = None
) -> None:
    """Apply egressd's forget lines from stdin until it closes (run stand-alone: no stdin)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=_STDIN_LINE_LIMIT)
    try:
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    except (ValueError, OSError):  # a terminal or a regular file: nobody sends forgets
        return
    while True:
        try:
            line = await reader.readline()
        except ValueError:  # over the limit: not a line egressd writes, so forget everyone
            line = b"?\n"
        if not line:
            return
        forget = parse_forget(line)
        if resumption is not None:  # a forgotten client's upstream TLS sessions go too
            resumption.forget(forget)
        client = vaults.client
        if client is not None:
            client.forget(forget)
        report()  # at once: egressd (and its tests) see the drop without waiting a period


async def _main(argv: Sequence[str]) -> int:
    # Listen on the sockets egressd bound and marked for us (docs/reference/behaviour.md §20.1), before
    # any option can make mitmproxy start a server.
    listen_on_adopted(adopt(os.environ))
    logging.getLogger().setLevel(logging.INFO)
    streampatch.install()  # abort a refused streamed body; HTTP/2 client backpressure
    for noisy in ("asyncio", "hpack"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    opts = options.Options()
    m = master.Master(opts, with_termlog=True)
    vaults = VaultLookup()
    resumption = TlsResumption()
    m.addons.add(
        core.Core(),
        OnlyWebSocketUpgrades(),
        IndexedProxyserver(),
        next_layer.NextLayer(),
        tlsconfig.TlsConfig(),
        resumption,  # after tlsconfig: it offers a session on the SSL.Connection tlsconfig built
        *egress_addons(vaults),
        errorcheck.ErrorCheck(),
    )
    try:
        opts.set(*_settings(argv))
    except exceptions.OptionsError as exc:
        print(f"egressd-mitm: {exc}", file=sys.stderr)
        return 1
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, m.shutdown)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    report = _CacheReport(vaults)
    tasks = [
        asyncio.create_task(report.run()),
        asyncio.create_task(_follow_forgets(vaults, report, resumption)),
    ]
    try:
        await m.run()
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # exec reset the dumpable flag the daemon had: set it again before the CA key (loaded when
    # the options are set) or any vault snapshot is in this process (docs/reference/behaviour.md §14.9).
    disable_core_dumps()
    raise_fd_limit()
    return asyncio.run(_main(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
