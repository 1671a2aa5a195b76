"""The MITM child's entry point: a lean mitmproxy master with only what egressd needs.

``mitmdump`` loads 36 addons (playback, export, map-local, the flow dumper, …) and every flow
event is dispatched through all of them; measured, that dispatch was a quarter of the child's
CPU per request. This master loads: core (option checks), proxyserver + next_layer + tlsconfig
(the proxy itself), disable_h2c (refuses h2c upgrades, which would smuggle requests past the
hooks), errorcheck (start-up errors exit non-zero, so the supervisor restarts us), termlog (warnings
on stdout) and the egressd addon. There is no flow dumper at all (headers carry credentials), and
no ``config.yaml`` is read from the confdir.

Run as ``python -m egressd.mitm.runner --set name=value …`` (options of mitmproxy and of the
egressd addon, as built by :func:`egressd.mitm.supervisor.mitmdump_argv`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from mitmproxy import exceptions, master, options
from mitmproxy.addons import core, disable_h2c, errorcheck, next_layer, proxyserver, tlsconfig

from egressd.hygiene import disable_core_dumps
from egressd.mitm.addon import EgressInjector


def _settings(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    args = list(argv)
    while args:
        flag = args.pop(0)
        if flag != "--set" or not args:
            raise SystemExit(f"egressd-mitm: unexpected argument {flag!r} (only --set name=value)")
        out.append(args.pop(0))
    return out


async def _main(argv: Sequence[str]) -> int:
    logging.getLogger().setLevel(logging.INFO)
    for noisy in ("asyncio", "hpack"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    opts = options.Options()
    m = master.Master(opts, with_termlog=True)
    m.addons.add(
        core.Core(),
        disable_h2c.DisableH2C(),
        proxyserver.Proxyserver(),
        next_layer.NextLayer(),
        tlsconfig.TlsConfig(),
        EgressInjector(),
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
    await m.run()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    # exec reset the dumpable flag the daemon had: set it again before the CA key (loaded when
    # the options are set) or any vault snapshot is in this process (BEHAVIOUR 14.9).
    disable_core_dumps()
    return asyncio.run(_main(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
