"""Start-up, serving and shutdown of the sidecar profile (the thin shell around the engine).

Order: always-rules and initial policy (pure checks) -> kernel self-test -> table for the
initial policy -> DNS proxy -> HTTP. Any failure before serving is a one-line refusal: the
sidecar never runs without enforcement. On SIGTERM/SIGINT the table is deleted (§13).
"""

from __future__ import annotations

import asyncio
import ipaddress
import sys
from collections.abc import Callable

import structlog
from aiohttp import web

from egressd.config import Config
from egressd.dnsproxy.budget import query_budget
from egressd.dnsproxy.forwarder import Forwarder
from egressd.dnsproxy.server import DnsProxy
from egressd.dnsproxy.upstreams import Upstream, upstreams_or_system
from egressd.kernel.applier import KernelTransactions, NftError
from egressd.metrics import EgressMetrics
from egressd.mitm.service import MitmStartupError, RunningMitm, start_mitm
from egressd.policy import AlwaysRulesError, load_always_rules, rule_cap_problem
from egressd.policy.reload import AlwaysRulesReloader
from egressd.sidecar.engine import SidecarEngine
from egressd.sidecar.flows import cut_disallowed
from egressd.sidecar.http import SidecarHTTP, VaultPrerequisites
from egressd.sidecar.persist import InitialPolicyError, choose_initial, read_text
from egressd.sidecar.visibility import SidecarDrops, sidecar_events
from egressd.sidecarnft.ruleset import MITM_GID, Mode, SidecarTable
from egressd.sidecarnft.selftest import SelfTestError, check_net_admin, check_setgid_for_mitm, run_selftest
from egressd.subject.model import IPAddress
from egressd.vault.store import VaultSnapshot
from egressd.web.serving import ListenError, start_http, wait_for_stop

log = structlog.get_logger("egressd.sidecar")


class SidecarStartupError(Exception):
    """One-line reason start-up was refused."""


def table_for(cfg: Config, upstreams: tuple[Upstream, ...]) -> SidecarTable:
    mode: Mode = "dns" if cfg.mode == "dns" else "dns+nft"
    return SidecarTable(
        mitm_port=cfg.mitm_port if cfg.mitm_transparent else None,
        table=cfg.nft_table,
        dns_port=cfg.dns_port,
        mode=mode,
        block_doh_443=cfg.block_doh_443,
        doh_blocklist=cfg.doh_blocklist,
        resolvers=tuple(sorted({ipaddress.ip_address(u.host) for u in upstreams}, key=str)),
        max_leases=cfg.max_leases,
        deny_reject=cfg.deny_reject,
    )


async def run_sidecar(
    cfg: Config,
    stop: asyncio.Event | None = None,
    *,
    mitm_ready: Callable[[], bool] = lambda: False,
) -> None:
    """Run until ``stop`` (or SIGTERM/SIGINT); ``mitm_ready`` gates vault writes (§6 412)."""
    try:
        always = load_always_rules(cfg.always_rules_dir)
    except AlwaysRulesError as exc:
        raise SidecarStartupError(f"always-rules: {exc}") from None
    file_text, file_problem = read_text(cfg.policy_file)
    try:
        initial = choose_initial(file_text, file_problem, cfg.rules)
    except InitialPolicyError as exc:
        raise SidecarStartupError(str(exc)) from None
    if initial.warning:
        log.warning("policy.initial_fallback", reason=initial.warning, path=str(cfg.policy_file))
    problem = rule_cap_problem(initial.policy, cfg.max_rules)
    if problem is not None:
        raise SidecarStartupError(f"initial policy ({initial.source}): {problem}")

    upstreams = upstreams_or_system(cfg.dns_upstreams)
    table = table_for(cfg, upstreams)
    metrics = EgressMetrics()
    tx = KernelTransactions(metrics)
    drops = SidecarDrops(metrics, lambda: tx.list_counters(cfg.nft_table))
    engine = SidecarEngine(
        table,
        tx,
        initial.policy,
        always=always,
        persist_path=cfg.policy_file,
        cut_flows=cut_disallowed,
        carry_dropped=drops.carried,
    )
    # Only a requested stop deletes the table (§13). A start-up failure or a crash leaves it
    # enforcing: the sandbox stays closed until a sidecar serves again.
    graceful = False
    metrics.nft_rules.collect_from(lambda: {(): float(engine.rules_installed)})
    try:
        try:
            check_net_admin()
            if cfg.mitm_transparent:
                check_setgid_for_mitm()
            tx.run_sync(lambda: run_selftest(tx._cmd, table_prefix=cfg.nft_table, dns_port=cfg.dns_port))
        except SelfTestError as exc:
            raise SidecarStartupError(str(exc)) from None
        try:
            await engine.install()
        except NftError as exc:
            raise SidecarStartupError(f"cannot install nft table {cfg.nft_table}: {exc}") from None
        log.info("policy.initial", source=initial.source, mode=cfg.mode)

        forwarder = Forwarder(upstreams, cfg.dns_upstream_timeout)
        events = sidecar_events(cfg, metrics, forwarder)
        dns = DnsProxy(
            engine,
            forwarder,
            metrics,
            lease_bounds=(cfg.dns_lease_min, cfg.dns_lease_max),
            budget=query_budget(cfg.dns_qps_per_subject),
            events=events,
        )
        # The output-hook redirect always lands on loopback, and a UDP socket bound to the
        # wildcard would answer from the app's own address instead of 127.0.0.1, which the
        # redirect's conntrack entry does not recognise (the app drops the answer). So the
        # sidecar listens on loopback only, whatever host EGRESSD_DNS_ADDR names.
        try:
            await dns.start("127.0.0.1", cfg.dns_port)
        except OSError as exc:
            raise SidecarStartupError(
                f"cannot listen for DNS on 127.0.0.1:{cfg.dns_port}: {exc.strerror}"
            ) from None
        dns_addrs = [f"127.0.0.1:{cfg.dns_port}"]
        try:
            await dns.start("::1", cfg.dns_port)
            dns_addrs.append(f"[::1]:{cfg.dns_port}")
        except OSError as exc:
            # No IPv6 loopback in this namespace: v6 DNS cannot be redirected here either.
            log.warning("dns.no_ipv6_loopback", error=exc.strerror)
        log.info("dns.listening", addr=dns_addrs, upstreams=[str(u) for u in upstreams])
        reloader = AlwaysRulesReloader(
            cfg.always_rules_dir, always, engine.set_always_rules, interval=cfg.always_reload_interval
        )
        background = [asyncio.create_task(reloader.run())]
        mitm: RunningMitm | None = None
        http: SidecarHTTP | None = None
        if cfg.mitm_transparent:

            def vault_lookup(ip: IPAddress) -> VaultSnapshot | None:
                # One sandbox per namespace: every client of the MITM is this sandbox.
                store = http.vault if http is not None else None
                return store.snapshot() if store is not None else None

            try:
                mitm = await start_mitm(
                    cfg, vault_lookup, engine.destination_verified, gid=MITM_GID, metrics=metrics
                )
            except MitmStartupError as exc:
                raise SidecarStartupError(str(exc)) from None
            background.append(asyncio.create_task(mitm.supervisor.run()))
            running = mitm
            mitm_ready = lambda: running.supervisor.ready  # noqa: E731
        prerequisites = VaultPrerequisites(
            token_set=cfg.token is not None,
            mitm_transparent=cfg.mitm_transparent,
            ssl_insecure=cfg.mitm_ssl_insecure,
            mode=cfg.mode,
            mitm_ready=mitm_ready,
        )

        def mitm_health() -> str | None:
            # Like the fleet: with transparent MITM on, healthy means the MITM is ready too.
            return "mitmproxy not ready" if cfg.mitm_transparent and not mitm_ready() else None

        http = SidecarHTTP(
            engine,
            metrics,
            token=cfg.token,
            max_rules=cfg.max_rules,
            prerequisites=prerequisites,
            extra_health=mitm_health,
            mitm_ca=(lambda: (mitm.ca.pem, mitm.ca.fingerprint)) if mitm is not None else None,
            # One sandbox per namespace: every cached client holds this one vault.
            vault_changed=(lambda: mitm.supervisor.forget(None)) if mitm is not None else None,
            vault_limits=cfg.vault_limits,
            before_scrape=drops.refresh,
        )
        runner: web.AppRunner | None = None
        try:
            if events.webhook is not None:
                events.webhook.start()
            try:
                runner = await start_http(http.app(), cfg.http_host, cfg.http_port)
            except ListenError as exc:
                raise SidecarStartupError(str(exc)) from None
            log.info("http.listening", addr=f"{cfg.http_host}:{cfg.http_port}", profile="sidecar")
            await wait_for_stop(stop)
            # §13: a stop deletes the table. EGRESSD_SIDECAR_KEEP_TABLE keeps it, so a
            # supervisor's SIGTERM-then-start restart never leaves the sandbox open.
            graceful = not cfg.sidecar_keep_table
            log.info(
                "shutdown",
                reason="signal",
                table=cfg.nft_table,
                table_deleted=graceful,
            )
        finally:
            # The HTTP side first: no new action, and the ones in flight finish (bounded,
            # BEHAVIOUR 14.10) while everything they may touch (MITM, kernel) is still up.
            if runner is not None:
                await runner.cleanup()
            if mitm is not None:
                await mitm.close()
            for task in background:
                task.cancel()
            await dns.close()
            if events.webhook is not None:
                await events.webhook.close()
            forwarder.close()
    finally:
        if graceful:
            try:
                await engine.shutdown()
            except NftError as exc:
                log.error("shutdown.table_delete_failed", table=cfg.nft_table, error=str(exc)[:200])
        await tx.close()


def main(cfg: Config) -> int:
    """Profile entry point for :func:`egressd.main.main`: exit code, one-line errors."""
    try:
        asyncio.run(run_sidecar(cfg))
    except SidecarStartupError as exc:
        print(f"egressd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
