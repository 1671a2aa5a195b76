"""Start-up, serving and shutdown of the sidecar profile (the thin shell around the engine).

Order: always-rules and initial policy (pure checks) -> kernel self-test -> table for the
initial policy -> DNS proxy -> HTTP. Any failure before serving is a one-line refusal: the
sidecar never runs without enforcement. On SIGTERM/SIGINT the table is deleted (§13); everything else stops in the shutdown order both
profiles share (egressd.lifecycle.Running).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable
from functools import partial

import structlog

from egressd.addr import IPAddress
from egressd.commonconfig import ignored_settings
from egressd.dnsproxy.budget import query_budget
from egressd.dnsproxy.forwarder import Forwarder
from egressd.dnsproxy.server import DnsProxy
from egressd.dnsproxy.upstreams import Upstream, upstreams_or_system
from egressd.engine.selftest import Probes, SelfTestError, run_selftest
from egressd.events.dns import DnsEvents
from egressd.feed import Feed
from egressd.kernel.applier import KernelTransactions, NftError
from egressd.kernel.renewal import LeaseRenewal
from egressd.lifecycle import Running, StartupError
from egressd.metrics import EgressMetrics
from egressd.mitm.names import NameReport, NameService
from egressd.mitm.requests import RequestRefusals
from egressd.mitm.service import MitmStartupError, RunningMitm, start_mitm
from egressd.policy import AlwaysRules, AlwaysRulesError, load_always_rules, rule_cap_problem
from egressd.policy.reload import AlwaysRulesReloader
from egressd.policy.requests import intercepted_ports, set_intercepted_ports
from egressd.sidecar.config import SidecarConfig
from egressd.sidecar.engine import SidecarEngine
from egressd.sidecar.http import SidecarHTTP, VaultPrerequisites
from egressd.sidecar.persist import Initial, InitialPolicyError, choose_initial, read_text
from egressd.sidecar.visibility import SidecarDrops, sidecar_events
from egressd.sidecarnft.ruleset import MITM_GID, Mode, SidecarTable
from egressd.sidecarnft.selftest import check_net_admin, check_setgid_for_mitm, selftest_probes
from egressd.vault.snapshot import VaultSnapshot
from egressd.web.serving import ListenError, start_http, wait_for_stop
from egressd.web.transport import VaultTransport

log = structlog.get_logger("egressd.sidecar")


class SidecarStartupError(StartupError):
    """One-line reason start-up was refused."""


def table_for(
    cfg: SidecarConfig, upstreams: tuple[Upstream, ...], renewal: LeaseRenewal = LeaseRenewal.READD
) -> SidecarTable:
    mode: Mode = "dns" if cfg.mode == "dns" else "dns+nft"
    return SidecarTable(
        mitm_extra_ports=cfg.mitm.extra_ports if cfg.mitm.transparent else (),
        nameserver_exempt=cfg.kernel.nameserver_exempt,
        renew_by_replace=renewal is LeaseRenewal.REPLACE,
        mitm_port=cfg.mitm.port if cfg.mitm.transparent else None,
        table=cfg.kernel.nft_table,
        dns_port=cfg.dns.port,
        mode=mode,
        block_doh_443=cfg.kernel.block_doh_443,
        doh_blocklist=cfg.kernel.doh_blocklist,
        resolvers=tuple(sorted({ipaddress.ip_address(u.host) for u in upstreams}, key=str)),
        max_leases=cfg.kernel.max_leases,
        deny_reject=cfg.kernel.deny_reject,
        name_check=cfg.mitm.quic_guard,
    )


async def run_sidecar(
    cfg: SidecarConfig,
    stop: asyncio.Event | None = None,
    *,
    mitm_ready: Callable[[], bool] = lambda: False,
) -> None:
    """Run until ``stop`` (or SIGTERM/SIGINT); ``mitm_ready`` gates vault writes (§6 412)."""
    always, initial = _initial_policy(cfg)
    upstreams = upstreams_or_system(cfg.dns.upstreams)
    table = table_for(cfg, upstreams)
    metrics = EgressMetrics()
    metrics.constant_labels = cfg.common.metric_labels
    tx = KernelTransactions(metrics)
    drops = SidecarDrops(metrics, lambda: tx.list_counters(cfg.kernel.nft_table))
    engine = SidecarEngine(
        table,
        tx,
        initial.policy,
        always=always,
        persist_path=cfg.policy_file,
        cut_flows=True,
        probes=partial(selftest_probes, cmd=tx.run_script_sync, elements=tx.set_elements_sync, dns_port=cfg.dns.port),
        carry_dropped=drops.carried,
        feed=Feed(),  # the daemon's one change feed: the MITM's memory subscribes (_start_mitm)
    )
    # Only a requested stop deletes the table (§13). A start-up failure or a crash leaves it
    # enforcing: the sandbox stays closed until a sidecar serves again.
    graceful = False
    metrics.nft_rules.collect_from(lambda: {(): float(engine.rules_installed)})
    running = Running(tx)
    try:
        renewal = _check_kernel(cfg, tx, engine.backend.probes)
        engine.table = table_for(cfg, upstreams, renewal)
        log.info("kernel.selftest_passed", lease_renewal=renewal.value)
        for note in ignored_settings(cfg.mitm, cfg.vault):
            log.warning("config.ignored", reason=note)
        try:
            await engine.install()
        except NftError as exc:
            raise SidecarStartupError(f"cannot install nft table {cfg.kernel.nft_table}: {exc}") from None
        log.info("policy.initial", source=initial.source, mode=cfg.mode)
        events = await _start_dns(cfg, engine, metrics, upstreams, running)
        running.spawn(_reloader(cfg, always, engine).run())
        http: SidecarHTTP | None = None

        def vault_lookup(ip: IPAddress) -> VaultSnapshot | None:
            # One sandbox per namespace: every client of the MITM is this sandbox.
            store = http.vault if http is not None else None
            return store.snapshot() if store is not None else None

        names = NameReport(drops.names, events.refused_on_wire)  # the MITM's name check (§18)
        requests = RequestRefusals(drops.names, events.refused_request)  # request rules (§19)
        mitm = await _start_mitm(cfg, engine, metrics, vault_lookup, running, names, requests)
        if mitm is not None:
            mitm_ready = lambda: mitm.supervisor.ready  # noqa: E731
        http = _http(cfg, engine, metrics, mitm, mitm_ready, drops)
        graceful = await _serve(cfg, http, running, stop)
    finally:
        await running.close(partial(_delete_table, cfg, engine) if graceful else None)


def _reloader(cfg: SidecarConfig, always: AlwaysRules, engine: SidecarEngine) -> AlwaysRulesReloader:
    return AlwaysRulesReloader(
        cfg.common.always_rules_dir, always, engine.set_always_rules, interval=cfg.common.always_reload_interval
    )


def _initial_policy(cfg: SidecarConfig) -> tuple[AlwaysRules, Initial]:
    """The always-rules and the policy to start with; pure checks, before any kernel work."""
    # Request rules only where the MITM judges them (docs/reference/behaviour.md §19): else 400;
    # mode dns redirects nothing to it.
    set_intercepted_ports(intercepted_ports(cfg.mitm.transparent and cfg.mode != "dns", cfg.mitm.extra_ports))
    try:
        always = load_always_rules(cfg.common.always_rules_dir)
    except AlwaysRulesError as exc:
        raise SidecarStartupError(f"always-rules: {exc}") from None
    file_text, file_problem = read_text(cfg.policy_file)
    try:
        initial = choose_initial(file_text, file_problem, cfg.rules)
    except InitialPolicyError as exc:
        raise SidecarStartupError(str(exc)) from None
    if initial.warning:
        log.warning("policy.initial_fallback", reason=initial.warning, path=str(cfg.policy_file))
    problem = rule_cap_problem(initial.policy, cfg.common.max_rules)
    if problem is not None:
        raise SidecarStartupError(f"initial policy ({initial.source}): {problem}")
    return always, initial


def _check_kernel(
    cfg: SidecarConfig, tx: KernelTransactions, probes: Callable[[str], Probes[LeaseRenewal]]
) -> LeaseRenewal:
    try:
        check_net_admin()
        if cfg.mitm.transparent:
            check_setgid_for_mitm()
        return tx.run_sync(
            lambda: run_selftest(
                tx.run_script_sync,
                NftError,
                cfg.kernel.nft_table,
                probes,
            )
        )
    except SelfTestError as exc:
        raise SidecarStartupError(str(exc)) from None


async def _start_dns(
    cfg: SidecarConfig,
    engine: SidecarEngine,
    metrics: EgressMetrics,
    upstreams: tuple[Upstream, ...],
    running: Running,
) -> DnsEvents:
    forwarder = running.forwarder = Forwarder(upstreams, cfg.dns.upstream_timeout)
    events = sidecar_events(cfg.common, metrics, forwarder)
    if events.webhook is not None:
        # The deny webhook's worker; events queued after its close are dropped (docs/reference/behaviour.md §15).
        events.webhook.start()
        running.stoppers.append(events.webhook.close)
    dns = running.dns = DnsProxy(
        engine.asker,
        forwarder,
        metrics,
        on_resolved=engine.learn,  # DNS-to-kernel: answers join the dyn sets before the reply
        lease_bounds=(cfg.dns.lease_min, cfg.dns.lease_max),
        budget=query_budget(cfg.dns.qps_per_subject),
        events=events,
    )
    # The output-hook redirect always lands on loopback, and a UDP socket bound to the
    # wildcard would answer from the app's own address instead of 127.0.0.1, which the
    # redirect's conntrack entry does not recognise (the app drops the answer). So the
    # sidecar listens on loopback only, whatever host EGRESSD_DNS_ADDR names.
    try:
        await dns.start("127.0.0.1", cfg.dns.port)
    except OSError as exc:
        raise SidecarStartupError(
            f"cannot listen for DNS on 127.0.0.1:{cfg.dns.port}: {exc.strerror}"
        ) from None
    dns_addrs = [f"127.0.0.1:{cfg.dns.port}"]
    try:
        await dns.start("::1", cfg.dns.port)
        dns_addrs.append(f"[::1]:{cfg.dns.port}")
    except OSError as exc:
        # No IPv6 loopback in this namespace: v6 DNS cannot be redirected here either.
        log.warning("dns.no_ipv6_loopback", error=exc.strerror)
    log.info("dns.listening", addr=dns_addrs, upstreams=[str(u) for u in upstreams])
    return events


async def _start_mitm(
    cfg: SidecarConfig,
    engine: SidecarEngine,
    metrics: EgressMetrics,
    vault_lookup: Callable[[IPAddress], VaultSnapshot | None],
    running: Running,
    report: NameReport,
    requests: RequestRefusals,
) -> RunningMitm | None:
    if not cfg.mitm.transparent:
        return None
    names = NameService(
        lambda q: engine.check_name(q.wire, q.name, q.dst, q.port),
        report,
        policy_of=lambda client, listen: engine.request_policy(),
        request_report=requests,
    )
    try:
        mitm = await start_mitm(
            cfg.mitm,
            vault_lookup,
            engine.destination_verified_until,
            gid=MITM_GID,
            metrics=metrics,
            names=names,
        )
    except MitmStartupError as exc:
        raise SidecarStartupError(str(exc)) from None
    mitm.subscribe(engine.feed)  # before anything else is awaited: no narrowing goes unseen
    running.supervise(mitm)
    return mitm


def _http(
    cfg: SidecarConfig,
    engine: SidecarEngine,
    metrics: EgressMetrics,
    mitm: RunningMitm | None,
    mitm_ready: Callable[[], bool],
    drops: SidecarDrops,
) -> SidecarHTTP:
    prerequisites = VaultPrerequisites(
        token_set=cfg.token is not None,
        mitm_transparent=cfg.mitm.transparent,
        ssl_insecure=cfg.mitm.ssl_insecure,
        mode=cfg.mode,
        mitm_ready=mitm_ready,
    )

    def mitm_health() -> str | None:
        # Like the fleet: with transparent MITM on, healthy means the MITM is ready too.
        return "mitmproxy not ready" if cfg.mitm.transparent and not mitm_ready() else None

    return SidecarHTTP(
        engine,
        metrics,
        token=cfg.token,
        max_rules=cfg.common.max_rules,
        prerequisites=prerequisites,
        extra_health=mitm_health,
        mitm_ca=(lambda: (mitm.ca.pem, mitm.ca.fingerprint)) if mitm is not None else None,
        vault_limits=cfg.vault.limits(cfg.mitm.ignore_hosts),
        vault_transport=VaultTransport(cfg.vault.require_tls, cfg.vault.trusted_proxies),
        before_scrape=drops.refresh,  # the kernel's refusal counter (docs/reference/behaviour.md §15)
        name_check=cfg.mitm.name_check,
    )


async def _serve(cfg: SidecarConfig, http: SidecarHTTP, running: Running, stop: asyncio.Event | None) -> bool:
    """Serve until the stop; whether the stop deletes the table."""
    try:
        running.http = await start_http(http.app(), cfg.common.http_host, cfg.common.http_port)
    except ListenError as exc:
        raise SidecarStartupError(str(exc)) from None
    log.info("http.listening", addr=f"{cfg.common.http_host}:{cfg.common.http_port}", profile="sidecar")
    await wait_for_stop(stop)
    # §13: a stop deletes the table. EGRESSD_SIDECAR_KEEP_TABLE keeps it, so a
    # supervisor's SIGTERM-then-start restart never leaves the sandbox open.
    graceful = not cfg.keep_table
    log.info(
        "shutdown",
        reason="signal",
        table=cfg.kernel.nft_table,
        table_deleted=graceful,
    )
    return graceful


async def _delete_table(cfg: SidecarConfig, engine: SidecarEngine) -> None:
    try:
        await engine.shutdown()
    except NftError as exc:
        log.error("shutdown.table_delete_failed", table=cfg.kernel.nft_table, error=str(exc)[:200])
