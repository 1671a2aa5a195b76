"""Start-up, serving and shutdown of the fleet profile: the composition root that wires the shared
packages together (docs/reference/actions-protocol.md §3 "Startup").

Order: always-rules -> kernel self-test and bridge check -> control plane -> table reset to
deny-all -> DNS proxy -> background tasks -> MITM -> HTTP. Any failure before serving is a
one-line refusal (:class:`StartupError`, exit 1). A stop keeps the table (still enforcing); the
next start resets it and the Fastlet replays its actions.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import structlog

from egressd.actionhandler.control import ControlPlane
from egressd.commonconfig import ignored_settings
from egressd.dnsproxy.budget import query_budget
from egressd.dnsproxy.forwarder import Forwarder
from egressd.dnsproxy.server import DnsProxy, PortAsker
from egressd.dnsproxy.upstreams import upstreams_or_system
from egressd.engine.selftest import Probes, SelfTestError, run_selftest
from egressd.events.suggestion import suggestion
from egressd.feed import Feed
from egressd.fleet.config import FleetConfig
from egressd.fleet.proxyroute import ProxyRouteAPI
from egressd.fleet.server import FleetHTTP
from egressd.fleet.visibility import FleetVisibility, fleet_visibility
from egressd.fleetnft.backend import FleetBackend
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.selftest import BridgeReport, bridge_report, selftest_probes
from egressd.fleetnft.table import TableConfig
from egressd.kernel.applier import KernelTransactions, NftError
from egressd.kernel.conntrack import flush_source
from egressd.kernel.listeners import OWNER_MARK
from egressd.kernel.refresh import LeaseRefresher
from egressd.kernel.renewal import LeaseRenewal
from egressd.lifecycle import Running, StartupError
from egressd.metrics import EgressMetrics
from egressd.mitm.active import PortVaults
from egressd.mitm.names import NameService
from egressd.mitm.service import MitmStartupError, RunningMitm, start_mitm
from egressd.policy import AlwaysRules, AlwaysRulesError, load_always_rules
from egressd.policy.reload import AlwaysRulesReloader
from egressd.policy.requests import intercepted_ports, set_intercepted_ports
from egressd.vault.keys import KeyDirError, KeyStore
from egressd.web.serving import ListenError, start_http, wait_for_stop
from egressd.web.transport import VaultTransport

log = structlog.get_logger("egressd")

__all__ = ["StartupError", "run_fleet", "table_config"]


def table_config(cfg: FleetConfig, renewal: LeaseRenewal = LeaseRenewal.READD) -> TableConfig:
    return TableConfig(
        table=cfg.kernel.nft_table,
        dns_port=cfg.dns.port,
        mitm=cfg.mitm.transparent,
        mitm_port=cfg.mitm.port,
        mitm_workers=cfg.mitm.workers,
        block_doh_443=cfg.kernel.block_doh_443,
        doh_blocklist=cfg.kernel.doh_blocklist,
        max_leases=cfg.kernel.max_leases,
        mitm_extra_ports=cfg.mitm.extra_ports if cfg.mitm.transparent else (),
        nameserver_exempt=cfg.kernel.nameserver_exempt,
        renew_by_replace=renewal is LeaseRenewal.REPLACE,
        uids=cfg.uid_ports,
        own_uid=os.getuid(),
        http_port=cfg.common.http_port,
        deny_reject=cfg.kernel.deny_reject,
        sandbox_ifaces=cfg.sandbox_ifaces,
        name_check=cfg.mitm.quic_guard,
    )


async def run_fleet(cfg: FleetConfig, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` (or SIGTERM/SIGINT)."""
    # Request rules only where the MITM judges them (docs/reference/behaviour.md §19): else 400.
    set_intercepted_ports(intercepted_ports(cfg.mitm.transparent, cfg.mitm.extra_ports))
    try:
        always = load_always_rules(cfg.common.always_rules_dir)
    except AlwaysRulesError as exc:
        raise StartupError(f"always-rules: {exc}") from None

    metrics = EgressMetrics()
    metrics.constant_labels = cfg.common.metric_labels
    tx = KernelTransactions(metrics)
    running = Running(tx)
    # The subject engine's ruleset backend; its table learns how this kernel renews a lease from
    # the self-test, which runs the backend's own probes.
    backend = FleetBackend(
        table_config(cfg),
        tx,
        probes=partial(selftest_probes, cmd=tx.run_script_sync, batch=tx.run_batch_sync, elements=tx.set_elements_sync),
    )
    try:
        bridges, renewal = _check_kernel(cfg, tx, backend.probes)
        backend.table = table_config(cfg, renewal)
        control, proxy, visibility = _control_plane(cfg, tx, always, metrics, backend)
        running.stoppers.append(control.close)
        # The deny webhook's worker; events queued after its close are dropped (docs/reference/behaviour.md §15).
        visibility.start()
        running.stoppers.append(visibility.close)
        await _reset_table(cfg, control, always)
        await _start_dns(cfg, control, metrics, running, visibility)
        _start_background(cfg, control, always, running)
        mitm = await _start_mitm(cfg, control, metrics, running, visibility)

        def mitm_health() -> str | None:
            return mitm.supervisor.health() if mitm is not None else None

        http = FleetHTTP(
            control,
            metrics,
            extra_health=mitm_health,
            status_extra=lambda: {
                "bridgeNfCallIptables": bridges.nf_call_iptables,
                **({"mitmWorkers": mitm.supervisor.status_doc()} if mitm is not None else {}),
            },
            proxy=proxy,
            mitm_ca=lambda: (mitm.ca.pem, mitm.ca.fingerprint) if mitm else None,
            before_scrape=visibility.before_scrape,
            vault_transport=VaultTransport(cfg.vault.require_tls, cfg.vault.trusted_proxies),
            annotate_subjects=visibility.drops.annotate,
            name_check=cfg.mitm.name_check,
            suggestion=lambda uid: _suggestion(control, visibility, uid),
        )
        await _serve(cfg, http, running, stop)
    finally:
        await running.close()


def _check_kernel(
    cfg: FleetConfig, tx: KernelTransactions, probes: Callable[[str], Probes[LeaseRenewal]]
) -> tuple[BridgeReport, LeaseRenewal]:
    """Every nft feature the ruleset uses, tried in a scratch table; then the bridges."""
    try:
        renewal = tx.run_sync(
            lambda: run_selftest(
                tx.run_script_sync,
                NftError,
                cfg.kernel.nft_table,
                probes,
            )
        )
    except SelfTestError as exc:
        raise StartupError(str(exc)) from None
    bridges = bridge_report()
    log.info("kernel.selftest_passed", bridge=bridges.describe(), lease_renewal=renewal.value)
    for note in ignored_settings(cfg.mitm, cfg.vault):
        log.warning("config.ignored", reason=note)
    if bridges.bypass_risk and not cfg.kernel.allow_bridge_bypass:
        raise StartupError(
            f"{bridges.failing_sysctls()} is not 1 on a bridge with non-isolated ports: bridged "
            "sandbox-to-sandbox traffic would bypass enforcement (set it to 1, isolate the ports, or "
            "EGRESSD_ALLOW_BRIDGE_BYPASS=1)"
        )
    return bridges, renewal


def _control_plane(
    cfg: FleetConfig, tx: KernelTransactions, always: AlwaysRules, metrics: EgressMetrics, backend: FleetBackend
) -> tuple[ControlPlane, ProxyRouteAPI, FleetVisibility]:
    """The control plane and the listeners of its registry; the gauges read from it on scrape."""
    try:
        keys = KeyStore(cfg.vault.keys_dir)
    except KeyDirError as exc:
        raise StartupError(f"vault keys: {exc}") from None
    control = ControlPlane(
        FleetPlanKernel(backend.table, tx, backend=backend),
        always=always,
        metrics=metrics,
        conntrack_flush=flush_source,
        keys=keys,
        pending_ttl=cfg.pending_push_ttl,
        max_leases=cfg.kernel.max_leases,
        max_rules=cfg.common.max_rules,
        vault_limits=cfg.vault.limits(cfg.mitm.ignore_hosts),
        # The daemon's one change feed: every owner of state publishes its narrowings here,
        # the MITM's memory subscribes (_start_mitm).
        feed=Feed(),
    )
    proxy = ProxyRouteAPI(control, max_rules=cfg.common.max_rules)
    # Audit evidence and refusal counts (docs/reference/behaviour.md §15) share one counter dump per scrape.
    visibility = fleet_visibility(
        cfg.common, metrics, lambda: tx.list_counters(cfg.kernel.nft_table), lambda: list(control.registry)
    )
    control.listeners += [visibility.audit, visibility.drops]
    metrics.pending_pushes.collect_from(lambda: {(): float(control.credentials.pending_pushes.count())})
    metrics.subjects.collect_from(control.report.state_counts)
    metrics.nft_rules.collect_from(control.report.rules_count)
    return control, proxy, visibility


async def _reset_table(cfg: FleetConfig, control: ControlPlane, always: AlwaysRules) -> None:
    try:
        await control.reset_table()
    except NftError as exc:
        raise StartupError(f"cannot reset nft table {cfg.kernel.nft_table}: {exc}") from None
    log.info(
        "egress.loaded",
        **{"opensandbox.event": "egress.loaded"},
        profile="fleet",
        table=cfg.kernel.nft_table,
        always_deny=len(always.deny),
        always_allow=len(always.allow),
    )


async def _start_dns(
    cfg: FleetConfig, control: ControlPlane, metrics: EgressMetrics, running: Running, visibility: FleetVisibility
) -> None:
    upstreams = upstreams_or_system(cfg.dns.upstreams)
    forwarder = running.forwarder = Forwarder(upstreams, cfg.dns.upstream_timeout)
    dns = running.dns = DnsProxy(
        control.learning.asker,
        forwarder,
        metrics,
        # DNS-to-kernel: an answer's addresses join the asker's dyn sets before the reply.
        on_resolved=control.learning.learn,
        lease_bounds=(cfg.dns.lease_min, cfg.dns.lease_max),
        budget=query_budget(cfg.dns.qps_per_subject),
        events=visibility.events,
        listener_mark=OWNER_MARK,
    )
    try:
        await dns.start(cfg.dns.host, cfg.dns.port)
    except OSError as exc:
        raise StartupError(
            f"cannot listen for DNS on {cfg.dns.host}:{cfg.dns.port}: {exc.strerror}"
        ) from None
    log.info("dns.listening", addr=f"{cfg.dns.host}:{cfg.dns.port}", upstreams=[str(u) for u in upstreams])
    port = cfg.uid_ports.unknown_dns_port
    try:
        # In-range uids that are no subject are redirected here: NXDOMAIN, like an unknown source.
        await dns.start_port(PortAsker(port, lambda: None))
    except OSError as exc:
        # Still closed without it (their queries get no answer instead of NXDOMAIN); another
        # daemon in this namespace may hold the block (each needs its own EGRESSD_UID_DNS_PORT_BASE).
        log.warning("dns.unknown_uid_port_unavailable", port=port, error=exc.strerror or str(exc))
    control.uid_ports.ports = UidDnsPorts(dns, control)


class UidDnsPorts:
    """The DNS proxy's per-subject listeners of host-uid subjects (docs/reference/behaviour.md §17), by slot."""

    def __init__(self, dns: DnsProxy, control: ControlPlane) -> None:
        self._dns = dns
        self._control = control

    async def open(self, slot: int) -> None:
        port = self._control.table.uids.dns_port(slot)
        await self._dns.start_port(PortAsker(port, lambda: self._control.learning.asker_for_slot(slot)))

    async def close(self, slot: int) -> None:
        await self._dns.stop_port(self._control.table.uids.dns_port(slot))


def _start_background(cfg: FleetConfig, control: ControlPlane, always: AlwaysRules, running: Running) -> None:
    reloader = AlwaysRulesReloader(
        cfg.common.always_rules_dir, always, control.always_rules.apply, interval=cfg.common.always_reload_interval
    )
    refresher = LeaseRefresher(
        control.learning.uid_for,
        control.learning.leases,
        control.learning.renew_leases,
        interval=cfg.kernel.refresh_interval,
        host_uids=control.learning.host_uid_subjects,
    )
    running.spawn(reloader.run())
    running.spawn(refresher.run())
    running.spawn(_sweep_pending(control))


async def _start_mitm(
    cfg: FleetConfig, control: ControlPlane, metrics: EgressMetrics, running: Running, visibility: FleetVisibility
) -> RunningMitm | None:
    if not cfg.mitm.transparent:
        return None
    try:
        lo, hi = cfg.uid_ports.mitm_ports
        by_port = PortVaults(
            control.credentials.vault_for_mitm_port,
            control.learning.destination_verified_until_port,
            tuple(range(lo, hi + 1)),
        )
        mitm = await start_mitm(
            cfg.mitm,
            control.credentials.vault_for_ip,
            control.learning.destination_verified_until,
            metrics=metrics,
            by_port=by_port,
            listen_mark=OWNER_MARK,
            names=NameService(
                lambda q: control.learning.check_name(q.client, q.listen_port, q.wire, q.name, q.dst, q.port),
                visibility.names,
                policy_of=control.learning.request_policy,
                request_report=visibility.requests,
            ),
        )
    except MitmStartupError as exc:
        raise StartupError(str(exc)) from None
    mitm.subscribe(control.feed)  # before anything else is awaited: no narrowing goes unseen
    running.supervise(mitm)
    return mitm


def _suggestion(control: ControlPlane, visibility: FleetVisibility, uid: str) -> dict[str, Any] | None:
    """``egressctl suggest`` (docs/reference/behaviour.md §19): the subject's user policy and its ring."""
    entry = control.registry.get(uid)
    if entry is None or entry.policy is None:
        return None
    denials = visibility.drops.denials
    return suggestion(entry.policy, denials.of(uid) if denials is not None else [])


async def _serve(cfg: FleetConfig, http: FleetHTTP, running: Running, stop: asyncio.Event | None) -> None:
    try:
        running.http = await start_http(http.app(), cfg.common.http_host, cfg.common.http_port, mark=OWNER_MARK)
    except ListenError as exc:
        raise StartupError(str(exc)) from None
    log.info("http.listening", addr=f"{cfg.common.http_host}:{cfg.common.http_port}", instance_id=http.instance_id)
    # Start-up objects never die: keep them out of the cyclic GC's full collections,
    # and collect less often (tail latency of actions and DNS answers).
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 50, 100)
    await wait_for_stop(stop)
    log.info("shutdown", reason="signal", table_kept=cfg.kernel.nft_table)


async def _sweep_pending(control: ControlPlane, interval: float = 10.0) -> None:
    """Expired pending pushes are dropped (docs/reference/actions-protocol.md §4: swept every 10 s)."""
    while True:
        await asyncio.sleep(interval)
        control.credentials.pending_pushes.sweep(time.monotonic())
