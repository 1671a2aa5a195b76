"""Configuration from the environment and ``--flags`` (flags win). Pure: env and argv in, the
profile's config out.

Each subsystem declares its options next to its code, in a frozen config of its own
(issue 24 item 4): :mod:`egressd.commonconfig` (both profiles), :mod:`egressd.dnsproxy.config`,
:mod:`egressd.mitm.config`, :mod:`egressd.vault.config`, :mod:`egressd.kernel.config`,
:mod:`egressd.fleet.config` and :mod:`egressd.sidecar.config`. This loader composes them: one
argument parser over every declaration, an option of the other profile refused in one line,
then the chosen profile's :class:`~egressd.fleet.config.FleetConfig` or
:class:`~egressd.sidecar.config.SidecarConfig`. Like :mod:`egressd.main`, it may import both
profiles (their ``config`` modules only). docs/reference/configuration.md and
deploy/systemd/egressd.env.example are generated from :data:`OPTIONS`
(scripts/gen-config-docs.py)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from types import ModuleType

from egressd import commonconfig
from egressd.dnsproxy import config as dns_config
from egressd.fleet import config as fleet_config
from egressd.fleet.config import FleetConfig
from egressd.kernel import config as kernel_config
from egressd.mitm import config as mitm_config
from egressd.options import ConfigError, Option
from egressd.sidecar import config as sidecar_config
from egressd.sidecar.config import SidecarConfig
from egressd.vault import config as vault_config

__all__ = ["OPTIONS", "Config", "ConfigError", "build_arg_parser", "parse_config", "raw_settings"]

#: The configuration of the profile that runs.
Config = FleetConfig | SidecarConfig

#: Every subsystem that declares options, with its title in the reference (the order of
#: ``egressd --help`` and of docs/reference/configuration.md). Each module holds ``OPTIONS``;
#: its docstring introduces them in the reference.
SUBSYSTEMS: tuple[tuple[str, ModuleType], ...] = (
    ("Both profiles", commonconfig),
    ("DNS proxy", dns_config),
    ("MITM", mitm_config),
    ("Vaults", vault_config),
    ("Kernel (nft)", kernel_config),
    ("Fleet profile", fleet_config),
    ("Sidecar profile", sidecar_config),
)


def subsystem_options(module: ModuleType) -> tuple[Option, ...]:
    found: tuple[Option, ...] = module.OPTIONS
    return found


OPTIONS: tuple[Option, ...] = tuple(opt for _, module in SUBSYSTEMS for opt in subsystem_options(module))


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="egressd",
        description="Egress control plane for AI-agent sandboxes. Every flag also reads its environment variable.",
    )
    for title, module in SUBSYSTEMS:
        group = parser.add_argument_group(title)
        for opt in subsystem_options(module):
            default = f" (default {opt.default!r})" if opt.default not in (None, "") else ""
            # A test or benchmark switch is still accepted, but not offered.
            text = f"{opt.help}; env {opt.env}{default}" if opt.public else argparse.SUPPRESS
            group.add_argument(opt.flag, dest=opt.env, metavar="VALUE", help=text)
    return parser


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _ArgError(message)


def _flags(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_arg_parser()
    quiet = _Parser(prog=parser.prog, description=parser.description, add_help=True)
    for action in parser._actions:
        if action.dest == "help":
            continue
        quiet.add_argument(*action.option_strings, dest=action.dest, metavar="VALUE", help=action.help)
    try:
        return quiet.parse_args(list(argv))
    except _ArgError as exc:
        raise ConfigError(str(exc)) from None


def raw_settings(env: Mapping[str, str], argv: Sequence[str]) -> dict[str, str | None]:
    ns = _flags(argv)
    out: dict[str, str | None] = {}
    for opt in OPTIONS:
        flag_value = getattr(ns, opt.env)
        out[opt.env] = flag_value if flag_value is not None else env.get(opt.env, opt.default)
    return out


def given_settings(env: Mapping[str, str], argv: Sequence[str]) -> set[str]:
    """The variables set (a flag, or a non-empty environment value), defaults aside."""
    ns = _flags(argv)
    return {
        opt.env
        for opt in OPTIONS
        if getattr(ns, opt.env) is not None or (env.get(opt.env) or "").strip()
    }


def other_profile_problem(given: set[str], profile: str) -> str | None:
    """One line naming the first option set that only the other profile reads."""
    for opt in OPTIONS:
        if opt.profile not in ("both", profile) and opt.env in given:
            return (
                f"{opt.env}: a {opt.profile} option, but OPENSANDBOX_EGRESS_PROFILE is {profile} "
                f"(unset it, or run the {opt.profile} profile)"
            )
    return None


def parse_config(env: Mapping[str, str], argv: Sequence[str] = ()) -> Config:
    # The listeners and the early choices are checked first, in the order they always were,
    # so a configuration with several mistakes names the same one first; then subsystem by
    # subsystem.
    raw = raw_settings(env, argv)
    profile = commonconfig.load_profile(raw)
    problem = other_profile_problem(given_settings(env, argv), profile)
    if problem is not None:
        raise ConfigError(problem)
    http = commonconfig.load_http_listener(raw, profile)
    allow_non_loopback = fleet_config.check_http_listener(raw, http[0]) if profile == "fleet" else False
    dns_port = dns_config.load_listener(raw)[1]
    mode = sidecar_config.load_mode(raw)
    kernel_config.load_table(raw, profile)
    log_format = commonconfig.load_log_format(raw)
    mitm_port, workers = mitm_config.load_listeners(raw, profile, (http[1], dns_port))
    subsystems = (
        commonconfig.load(raw, http, log_format),
        dns_config.load(raw),
        mitm_config.load(raw, mitm_port, workers),
        vault_config.load(raw),
        kernel_config.load(raw, profile),
    )
    if profile == "fleet":
        return fleet_config.load(raw, allow_non_loopback, subsystems)
    return sidecar_config.load(raw, mode, subsystems)


def parse_fleet_config(env: Mapping[str, str], argv: Sequence[str] = ()) -> FleetConfig:
    """:func:`parse_config` with the fleet profile (``OPENSANDBOX_EGRESS_PROFILE`` set to it),
    typed as such: for tests and tools that need the fleet's own fields."""
    cfg = parse_config({**env, "OPENSANDBOX_EGRESS_PROFILE": "fleet"}, argv)
    assert isinstance(cfg, FleetConfig)
    return cfg


def parse_sidecar_config(env: Mapping[str, str], argv: Sequence[str] = ()) -> SidecarConfig:
    """:func:`parse_config` with the sidecar profile, typed as such (tests and tools)."""
    cfg = parse_config({**env, "OPENSANDBOX_EGRESS_PROFILE": "sidecar"}, argv)
    assert isinstance(cfg, SidecarConfig)
    return cfg

