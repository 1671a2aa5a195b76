"""``egressd`` entry point: configuration, start-up order (BEHAVIOUR §3 "Startup"), serving, shutdown."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import time
from collections.abc import Sequence

import structlog
from aiohttp import web

from egressd.actionhandler.control import ControlPlane
from egressd.config import Config, ConfigError, parse_config
from egressd.dnsproxy.budget import query_budget
from egressd.dnsproxy.forwarder import Forwarder
from egressd.dnsproxy.server import DnsProxy
from egressd.dnsproxy.upstreams import upstreams_or_system
from egressd.fleet.proxyroute import ProxyRouteAPI
from egressd.fleet.server import FleetHTTP
from egressd.fleet.visibility import fleet_visibility
from egressd.fleetnft.builder import TableConfig
from egressd.fleetnft.selftest import SelfTestError, bridge_report, run_selftest
from egressd.hygiene import disable_core_dumps
from egressd.kernel.applier import KernelTransactions, NftError
from egressd.kernel.conntrack import flush_source
from egressd.logsetup import configure
from egressd.metrics import EgressMetrics
from egressd.mitm.service import MitmStartupError, start_mitm
from egressd.policy import AlwaysRulesError, load_always_rules
from egressd.policy.reload import AlwaysRulesReloader
from egressd.subject.refresh import LeaseRefresher
from egressd.vault.sealed import KeyDirError, KeyStore
from egressd.web.serving import ListenError, start_http, wait_for_stop

log = structlog.get_logger("egressd")


class StartupError(Exception):
    """One-line reason start-up was refused."""


def table_config(cfg: Config) -> TableConfig:
    return TableConfig(
        table=cfg.nft_table,
        dns_port=cfg.dns_port,
        mitm=cfg.mitm_transparent,
        mitm_port=cfg.mitm_port,
        block_doh_443=cfg.block_doh_443,
        doh_blocklist=cfg.doh_blocklist,
        max_leases=cfg.max_leases,
        deny_reject=cfg.deny_reject,
    )


async def run_fleet(cfg: Config, stop: asyncio.Event | None = None) -> None:
    try:
        always = load_always_rules(cfg.always_rules_dir)
    except AlwaysRulesError as exc:
        raise StartupError(f"always-rules: {exc}") from None

    metrics = EgressMetrics()
    tx = KernelTransactions(metrics)
    try:
        try:
            tx.run_sync(lambda: run_selftest(tx._cmd, tx._batch, table_prefix=cfg.nft_table))
        except SelfTestError as exc:
            raise StartupError(str(exc)) from None
        bridges = bridge_report()
        log.info("kernel.selftest_passed", bridge=bridges.describe())
        if bridges.bypass_risk and not cfg.allow_bridge_bypass:
            raise StartupError(
                f"{bridges.failing_sysctls()} is not 1 on a bridge with non-isolated ports: bridged "
                "sandbox-to-sandbox traffic would bypass enforcement (set it to 1, isolate the ports, or "
                "EGRESSD_ALLOW_BRIDGE_BYPASS=1)"
            )

        try:
            keys = KeyStore(cfg.vault_keys_dir)
        except KeyDirError as exc:
            raise StartupError(f"vault keys: {exc}") from None
        control = ControlPlane(
            table_config(cfg),
            tx,
            always=always,
            metrics=metrics,
            conntrack_flush=flush_source,
            keys=keys,
            pending_ttl=cfg.pending_push_ttl,
            max_leases=cfg.max_leases,
            max_rules=cfg.max_rules,
            vault_limits=cfg.vault_limits,
        )
        proxy = ProxyRouteAPI(control, max_rules=cfg.max_rules)
        visibility = fleet_visibility(
            cfg, metrics, lambda: tx.list_counters(cfg.nft_table), lambda: list(control.registry)
        )
        control.listeners += [visibility.audit, visibility.drops]
        metrics.pending_pushes.collect_from(lambda: {(): float(control.pending_pushes.count())})
        metrics.subjects.collect_from(control.state_counts)
        metrics.nft_rules.collect_from(control.rules_count)
        try:
            await control.reset_table()
        except NftError as exc:
            raise StartupError(f"cannot reset nft table {cfg.nft_table}: {exc}") from None
        log.info(
            "egress.loaded",
            **{"opensandbox.event": "egress.loaded"},
            profile="fleet",
            table=cfg.nft_table,
            always_deny=len(always.deny),
            always_allow=len(always.allow),
        )

        upstreams = upstreams_or_system(cfg.dns_upstreams)
        forwarder = Forwarder(upstreams, cfg.dns_upstream_timeout)
        dns = DnsProxy(
            control,
            forwarder,
            metrics,
            lease_bounds=(cfg.dns_lease_min, cfg.dns_lease_max),
            budget=query_budget(cfg.dns_qps_per_subject),
            events=visibility.events,
        )
        try:
            await dns.start(cfg.dns_host, cfg.dns_port)
        except OSError as exc:
            raise StartupError(
                f"cannot listen for DNS on {cfg.dns_host}:{cfg.dns_port}: {exc.strerror}"
            ) from None
        log.info(
            "dns.listening", addr=f"{cfg.dns_host}:{cfg.dns_port}", upstreams=[str(u) for u in upstreams]
        )
        reloader = AlwaysRulesReloader(
            cfg.always_rules_dir, always, control.set_always_rules, interval=cfg.always_reload_interval
        )
        refresher = LeaseRefresher(
            control.uid_for, control.leases, control.renew_leases, interval=cfg.refresh_interval
        )
        background = [
            asyncio.create_task(reloader.run()),
            asyncio.create_task(refresher.run()),
            asyncio.create_task(_sweep_pending(control)),
        ]
        mitm = None
        if cfg.mitm_transparent:
            try:
                mitm = await start_mitm(
                    cfg, control.vault_for_ip, control.destination_verified, metrics=metrics
                )
            except MitmStartupError as exc:
                raise StartupError(str(exc)) from None
        if mitm is not None:
            background.append(asyncio.create_task(mitm.supervisor.run()))
            control.forget_snapshots = mitm.supervisor.forget

        def mitm_health() -> str | None:
            if mitm is not None and not mitm.supervisor.ready:
                return "mitmproxy not ready"
            return None

        http = FleetHTTP(
            control,
            metrics,
            extra_health=mitm_health,
            status_extra=lambda: {"bridgeNfCallIptables": bridges.nf_call_iptables},
            proxy=proxy,
            mitm_ca=lambda: (mitm.ca.pem, mitm.ca.fingerprint) if mitm else None,
            before_scrape=visibility.before_scrape,
            annotate_subjects=visibility.drops.annotate,
        )
        runner: web.AppRunner | None = None
        try:
            visibility.start()
            try:
                runner = await start_http(http.app(), cfg.http_host, cfg.http_port)
            except ListenError as exc:
                raise StartupError(str(exc)) from None
            log.info("http.listening", addr=f"{cfg.http_host}:{cfg.http_port}", instance_id=http.instance_id)
            # Start-up objects never die: keep them out of the cyclic GC's full collections,
            # and collect less often (tail latency of actions and DNS answers).
            gc.collect()
            gc.freeze()
            gc.set_threshold(10_000, 50, 100)
            await wait_for_stop(stop)
            log.info("shutdown", reason="signal", table_kept=cfg.nft_table)
        finally:
            # The HTTP side first: no new action, and the ones in flight finish (bounded,
            # BEHAVIOUR 14.10) while everything they may touch (MITM, kernel) is still up.
            if runner is not None:
                await runner.cleanup()
            if mitm is not None:
                await mitm.close()
            await control.close()
            for task in background:
                task.cancel()
            await dns.close()
            forwarder.close()
            await visibility.close()
    finally:
        await tx.close()


async def _sweep_pending(control: ControlPlane, interval: float = 10.0) -> None:
    """Expired pending pushes are dropped (BEHAVIOUR §4: swept every 10 s)."""
    while True:
        await asyncio.sleep(interval)
        control.pending_pushes.sweep(time.monotonic())


def main(argv: Sequence[str] | None = None) -> int:
    # First, before the configuration (token) is parsed and long before any vault or key is
    # read: no core dump and no same-uid /proc/<pid>/mem reader (BEHAVIOUR 14.9). Both
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
    configure(cfg.log_format)
    if cfg.profile == "sidecar":
        from egressd.sidecar.run import main as run_sidecar_main

        return run_sidecar_main(cfg)
    try:
        asyncio.run(run_fleet(cfg))
    except StartupError as exc:
        print(f"egressd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
