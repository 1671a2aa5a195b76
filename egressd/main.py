"""``egressd`` entry point: process hygiene, configuration, logging, then the chosen profile
(egressd.fleet.run, egressd.sidecar.run: start-up order per docs/reference/actions-protocol.md §3 "Startup")."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from egressd.config import ConfigError, parse_config
from egressd.fleet.config import FleetConfig
from egressd.fleet.run import StartupError, run_fleet, table_config
from egressd.hygiene import disable_core_dumps
from egressd.lifecycle import run_profile
from egressd.logsetup import configure

# The fleet's wiring lives in egressd.fleet.run; its names stay importable from here.
__all__ = ["StartupError", "main", "run_fleet", "table_config"]


def main(argv: Sequence[str] | None = None) -> int:
    # First, before the configuration (token) is parsed and long before any vault or key is
    # read: no core dump and no same-uid /proc/<pid>/mem reader (docs/reference/behaviour.md §14.9). Both
    # profiles run in this process.
    disable_core_dumps()
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        from egressd.config import build_arg_parser

        build_arg_parser().print_help()
        return 0
    try:
        cfg = parse_config(os.environ, args)
    except ConfigError as exc:
        print(f"egressd: {exc}", file=sys.stderr)
        return 2
    configure(cfg.common.log_format, cfg.common.log_level, cfg.common.log_fields)
    if isinstance(cfg, FleetConfig):
        return run_profile(run_fleet(cfg))
    from egressd.sidecar.run import run_sidecar

    return run_profile(run_sidecar(cfg))


if __name__ == "__main__":
    sys.exit(main())
