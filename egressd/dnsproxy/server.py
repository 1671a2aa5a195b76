"""The shared DNS proxy: UDP and TCP listeners, one policy decision per query, learning before replying."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

import structlog
from dnslib import QTYPE, RCODE, DNSRecord

from egressd.addr import IPAddress, unmap_ip
from egressd.dnsproxy.budget import QueryBudget
from egressd.dnsproxy.decide import (
    Action,
    Decision,
    answer_addresses,
    decide,
    lease_seconds,
    refusal,
    with_edns,
)
from egressd.dnsproxy.ede import INFO_BLOCKED, INFO_NOT_SUPPORTED, INFO_OTHER, attach_ede
from egressd.dnsproxy.forwarder import Forwarder
from egressd.events.dns import DnsEvents
from egressd.kernel.listeners import NO_IPV6, bound_socket
from egressd.metrics import EgressMetrics
from egressd.policy import evidence, new_decision_id
from egressd.policy.audit import safe_token
from egressd.subject.model import Asker, Fence, subject_for_uid

log = structlog.get_logger("egressd.dns")

_LEARN_TIMEOUT_S = 5.0
_CLASSIC_UDP = 512
_TCP_IDLE_S = 10.0
MAX_IN_FLIGHT_PER_CLIENT = 64  # queries one source may have outstanding; more are dropped
MAX_TCP_PER_CLIENT = 16
DENY_LOGS_PER_CLIENT_PER_S = 20  # beyond this, denials are counted but not logged one by one


@dataclass(frozen=True, slots=True)
class PortAsker:
    """A listener whose port names the asker (host-uid subjects, docs/reference/behaviour.md §17): every uid
    sandbox asks from the host's own address, and the kernel redirected each one's queries to
    a port of its own. ``asker`` answers for whoever holds the port now (None: nobody, which
    is answered like an unknown source)."""

    port: int
    asker: Callable[[], Asker | None] = field(compare=False)


#: Who is asking: the subject behind a source IP (None: an unknown source, refused).
AskerLookup = Callable[[IPAddress], Asker | None]
#: The DNS-to-kernel callback, called with (uid, fence, [(address, lease seconds)], question
#: name) before an answer is sent: puts the addresses into the asker's dyn sets and returns
#: those the kernel now holds (the reply carries only these, docs/reference/behaviour.md §14.4).
OnResolved = Callable[[str, Fence, list[tuple[IPAddress, int]], str | None], Awaitable[Collection[IPAddress]]]


class DnsProxy:
    def __init__(
        self,
        asker: AskerLookup,
        forwarder: Forwarder,
        metrics: EgressMetrics | None = None,
        *,
        on_resolved: OnResolved,
        lease_bounds: tuple[int, int] = (60, 360),
        budget: QueryBudget | None = None,
        events: DnsEvents | None = None,
        listener_mark: int | None = None,
    ) -> None:
        # Two callables from the composition root, not the control plane: the proxy knows
        # nothing of registries or kernels (the reference's proxy.SetOnResolved).
        self.asker = asker
        self.on_resolved = on_resolved
        # docs/reference/behaviour.md §15: deny webhook, recent denials, egress.outbound (never awaited).
        self.events = events
        self.forwarder = forwarder
        self.metrics = metrics
        self.lease_bounds = lease_bounds
        self.budget = budget  # None: no per-subject query budget (EGRESSD_DNS_QPS_PER_SUBJECT=0)
        # SO_MARK of every listener (fleet: egressd.kernel.listeners.OWNER_MARK, which the
        # table's input chain asks of whatever socket receives on egressd's ports).
        self.listener_mark = listener_mark
        self._transports: list[asyncio.DatagramTransport] = []
        self._servers: list[asyncio.Server] = []
        # Per-subject listeners by port: (transports, servers).
        self._ports: dict[int, tuple[list[asyncio.DatagramTransport], list[asyncio.Server]]] = {}
        self._in_flight: dict[str, int] = {}
        self._log_window: dict[IPAddress, tuple[int, int]] = {}  # ip -> (second, lines logged)
        self._tcp_conns: dict[str, int] = {}

    def _admit(self, counter: dict[str, int], client: str, cap: int) -> bool:
        """Bound one client's concurrent work so a flood cannot stall the other subjects."""
        n = counter.get(client, 0)
        if n >= cap:
            if self.metrics:
                self.metrics.dns_failed.inc("client_limit")
            return False
        counter[client] = n + 1
        return True

    @staticmethod
    def _release(counter: dict[str, int], client: str) -> None:
        n = counter.get(client, 1) - 1
        if n <= 0:
            counter.pop(client, None)
        else:
            counter[client] = n

    async def bounded_answer(
        self, data: bytes, client: str, *, tcp: bool, by_port: PortAsker | None = None
    ) -> bytes | None:
        # Behind a port listener every client is the host's own address: the bound is per port,
        # so one uid sandbox's flood cannot take the others' share.
        key = _client_key(client, by_port)
        if not self._admit(self._in_flight, key, MAX_IN_FLIGHT_PER_CLIENT):
            return None
        try:
            return await self.answer(data, client, tcp=tcp, by_port=by_port)
        finally:
            self._release(self._in_flight, key)

    # ---- one query ---------------------------------------------------------------------------

    async def answer(
        self, data: bytes, client: str, *, tcp: bool, by_port: PortAsker | None = None
    ) -> bytes | None:
        """The reply bytes for one query from ``client``, or None to stay silent (unparseable).

        The asker is the subject behind the source address, or with ``by_port`` the subject
        the listener's port belongs to."""
        start = time.perf_counter()
        parsed = _parse_query(data, client)
        if parsed is None:
            return None
        query, ip = parsed
        asker = self.asker(ip) if by_port is None else by_port.asker()
        had_edns = any(rr.rtype == QTYPE.OPT for rr in query.ar)
        # docs/reference/behaviour.md §14.3: the budget is charged before anything else is looked at, so every
        # parsed message costs a token, a refused or denied one too.
        if self.budget is not None and not self.budget.admit(asker.uid if asker else None, ip):
            return self._over_budget(query, ip, asker, had_edns, tcp, start)
        decision = decide(query, asker.policy if asker else None, known_source=asker is not None)
        if decision.action is not Action.FORWARD:
            return self._refuse(decision, query, ip, asker, had_edns, tcp, start)
        assert asker is not None
        # Audit: the name is answered, but NOT learned into the dyn sets. The audit rules of the
        # subject's chain pass (and count) the flow at the IP layer, and leaving audit closes it
        # at once: no lease of a would-deny name outlives the audit mode.
        audit_text = self._record(decision, ip, asker) if decision.would_deny else None
        return await self._forward(query, decision, asker, audit_text, had_edns, tcp, start)

    def _refuse(
        self,
        decision: Decision,
        query: DNSRecord,
        ip: IPAddress,
        asker: Asker | None,
        had_edns: bool,
        tcp: bool,
        start: float,
    ) -> bytes:
        """NXDOMAIN or REFUSED for a denied name, with the denial's evidence as EDE."""
        text = self._record(decision, ip, asker)
        reply = refusal(query, decision.action)
        if had_edns and decision.action is Action.NXDOMAIN:
            attach_ede(reply, INFO_BLOCKED, text)
        elif had_edns and decision.action is Action.REFUSED:
            attach_ede(reply, INFO_NOT_SUPPORTED, text)
        return self._finish(reply, query, tcp, start)

    async def _forward(
        self,
        query: DNSRecord,
        decision: Decision,
        asker: Asker,
        audit_text: str | None,
        had_edns: bool,
        tcp: bool,
        start: float,
    ) -> bytes:
        """Ask upstream, learn the answer's addresses (unless auditing), then reply."""
        limit = _udp_limit(query)  # the client's own limit, before we add EDNS for the upstream
        forwarded = await self.forwarder.forward(with_edns(query), tcp=tcp)
        if forwarded.reply is None:
            if audit_text is None:
                self._answered(asker.uid, decision.name, None, forwarded.failure)
            if self.metrics:
                self.metrics.dns_failed.inc(forwarded.failure)
            return self._servfail(query, tcp, start, limit)
        reply = forwarded.reply
        addresses = answer_addresses(reply) if audit_text is None else []
        trimmed = False
        if addresses:
            learned = await self._learn(asker, decision.name, addresses)
            if not learned:
                # Nothing of the answer is in the kernel (cap full, refused, or the policy
                # changed meanwhile): an answer the client could not use is not sent (14.4).
                if self.metrics:
                    self.metrics.dns_failed.inc("not_learned")
                return self._servfail(query, tcp, start, limit)
            trimmed = _keep_learned(reply, set(learned))
        if audit_text is None:
            self._answered(asker.uid, decision.name, reply)
        if audit_text is not None and had_edns:
            attach_ede(reply, INFO_OTHER, audit_text)
        elif (
            had_edns and not trimmed and forwarded.wire is not None and (tcp or len(forwarded.wire) <= limit)
        ):
            # Nothing to strip or truncate: the upstream's answer goes back byte for byte
            # (same id: the query was forwarded with it).
            if self.metrics:
                self.metrics.dns_latency.observe(time.perf_counter() - start)
            return forwarded.wire
        if not had_edns:
            reply.ar = [rr for rr in reply.ar if rr.rtype != QTYPE.OPT]
        return self._finish(reply, query, tcp, start, limit)

    async def _learn(
        self, asker: Asker, name: str | None, addresses: list[tuple[IPAddress, int]]
    ) -> Collection[IPAddress]:
        """The answer's addresses the kernel now holds for ``asker`` (none when learning failed)."""
        lo, hi = self.lease_bounds
        leases = [(addr, lease_seconds(ttl, lo, hi)) for addr, ttl in addresses]
        try:
            # The kernel must know the addresses before the client can try to connect.
            return await asyncio.wait_for(
                self.on_resolved(asker.uid, asker.fence, leases, name), _LEARN_TIMEOUT_S
            )
        except Exception as exc:
            # Counted by the kernel shell (egress_nftables_updates_failed_total{dynamic_add}).
            log.warning("dns.learn_failed", subject=subject_for_uid(asker.uid), error=str(exc)[:200])
            return ()

    def _servfail(self, query: DNSRecord, tcp: bool, start: float, limit: int) -> bytes:
        servfail = query.reply()
        servfail.header.rcode = RCODE.SERVFAIL
        return self._finish(servfail, query, tcp, start, limit)

    def _over_budget(
        self, query: DNSRecord, ip: IPAddress, asker: Asker | None, had_edns: bool, tcp: bool, start: float
    ) -> bytes:
        """REFUSED (EDE 15 "Blocked" to EDNS clients), not forwarded, counted per subject.

        Not counted as a policy denial: the name was never judged. Unknown sources share the
        subject label ``-`` (their addresses would make the metric's cardinality theirs).
        """
        subject = safe_token(subject_for_uid(asker.uid)) if asker else "-"
        decision_id = new_decision_id()
        text = evidence(decision_id, subject, "dns-budget")
        if self.metrics:
            self.metrics.dns_rate_limited.inc(subject, exemplar={"decision_id": decision_id})
        if self._may_log(ip):
            log.info(
                f"[dns] rate-limited query (remote={ip} {text})",
                remote=str(ip),
                reason="rate_limited",
                subject=subject if asker else None,
                decision_id=decision_id,
                rule="dns-budget",
                layer="dns",
            )
        reply = refusal(query, Action.REFUSED)
        if had_edns:
            attach_ede(reply, INFO_BLOCKED, text)
        return self._finish(reply, query, tcp, start)

    def _record(self, decision: Decision, ip: IPAddress, asker: Asker | None) -> str:
        """Count and (rate-limited) log a denial or an audit would-deny under a fresh decision id.

        Returns the evidence text for the answer's EDE option: the same id, subject and rule as
        the log line and the metric's exemplar, so one grep for the id finds all three.
        """
        subject = safe_token(subject_for_uid(asker.uid)) if asker else "-"
        rule = decision.rule or decision.reason
        decision_id = new_decision_id()
        text = evidence(decision_id, subject, rule)
        if self.metrics:
            if decision.would_deny:
                self.metrics.would_deny.inc(subject, "dns", rule, exemplar={"decision_id": decision_id})
            else:
                self.metrics.policy_denied.inc(
                    exemplar={"decision_id": decision_id, "rule": rule, "subject": subject}
                )
        if self.events is not None and decision.action is Action.NXDOMAIN:
            self.events.denied(asker.uid if asker else None, decision.name, decision.reason, rule)
        if self._may_log(ip):
            verb = "would-deny" if decision.would_deny else "denied"
            log.info(
                f"[dns] {verb} query (remote={ip} question={decision.name or '-'} "
                f"reason={decision.reason} {text})",
                remote=str(ip),
                question=decision.name,
                reason=decision.reason,
                subject=subject if asker else None,
                decision_id=decision_id,
                rule=rule,
                layer="dns",
                audit=decision.would_deny,
            )
        return text

    def _answered(self, uid: str, name: str, reply: DNSRecord | None, error: str | None = None) -> None:
        """``egress.outbound`` for an allowed answer: the addresses the sandbox gets (§15)."""
        if self.events is not None and self.events.answer_due(uid):
            ips = [addr for addr, _ in answer_addresses(reply)] if reply is not None else []
            self.events.answered(uid, name, ips, error)

    def _may_log(self, ip: IPAddress) -> bool:
        second = int(time.monotonic())
        window, count = self._log_window.get(ip, (second, 0))
        if window != second:
            window, count = second, 0
        if len(self._log_window) > 4096:
            self._log_window.clear()
        self._log_window[ip] = (window, count + 1)
        if count == DENY_LOGS_PER_CLIENT_PER_S:
            log.warning(
                "[dns] denial log rate limit reached; further denials this second are only counted",
                remote=str(ip),
            )
        return count < DENY_LOGS_PER_CLIENT_PER_S

    def _finish(
        self, reply: DNSRecord, query: DNSRecord, tcp: bool, start: float, limit: int | None = None
    ) -> bytes:
        reply.header.id = query.header.id
        wire = bytes(reply.pack())
        if not tcp:
            if limit is None:
                limit = _udp_limit(query)
            if len(wire) > limit:
                wire = bytes(reply.truncate().pack())
        if self.metrics:
            self.metrics.dns_latency.observe(time.perf_counter() - start)
        return wire

    # ---- listeners ---------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> None:
        """Listen on UDP and TCP; for 0.0.0.0 also on [::] (a v6 REDIRECT needs a v6 socket)."""
        loop = asyncio.get_running_loop()
        hosts = [host]
        if host == "0.0.0.0" and socket.has_ipv6:
            hosts.append("::")
        for h in hosts:
            udp, tcp = _bound_pair(h, port, self.listener_mark)
            transport, _ = await loop.create_datagram_endpoint(lambda: _Udp(self), sock=udp)
            self._transports.append(transport)
            self._servers.append(await asyncio.start_server(self._serve_tcp, sock=tcp))

    async def start_port(self, by_port: PortAsker, hosts: tuple[str, ...] = ("127.0.0.1", "::1")) -> None:
        """Listen (UDP and TCP) on a host-uid subject's own port, on loopback only: the kernel
        REDIRECTs a locally generated packet to 127.0.0.1 or ::1. A host without IPv6 on
        loopback gets the IPv4 pair only; any other failure closes what was opened and raises."""
        if by_port.port in self._ports:
            return
        loop = asyncio.get_running_loop()
        transports: list[asyncio.DatagramTransport] = []
        servers: list[asyncio.Server] = []
        try:
            for h in hosts:
                try:
                    udp, tcp = _bound_pair(h, by_port.port, self.listener_mark)
                except OSError as exc:
                    if ":" in h and exc.errno in NO_IPV6:
                        continue
                    raise
                transport, _ = await loop.create_datagram_endpoint(lambda: _Udp(self, by_port), sock=udp)
                transports.append(transport)
                servers.append(
                    await asyncio.start_server(lambda r, w: self._serve_tcp(r, w, by_port), sock=tcp)
                )
        except BaseException:
            await _close_all(transports, servers, wait=False)
            raise
        self._ports[by_port.port] = (transports, servers)

    async def stop_port(self, port: int) -> None:
        """Stop listening on a subject's port at once. A query being answered still is, and an
        open TCP connection ends at its idle timeout (its asker is gone: NXDOMAIN meanwhile);
        the caller (a removal) does not wait for either."""
        transports, servers = self._ports.pop(port, ([], []))
        await _close_all(transports, servers, wait=False)

    def listening_ports(self) -> list[int]:
        return sorted(self._ports)

    async def close(self) -> None:
        for transports, servers in self._ports.values():
            await _close_all(transports, servers)
        self._ports.clear()
        await _close_all(self._transports, self._servers)
        self._transports.clear()
        self._servers.clear()

    async def _serve_tcp(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, by_port: PortAsker | None = None
    ) -> None:
        peer = writer.get_extra_info("peername")
        client = str(peer[0])
        key = _client_key(client, by_port)
        if not self._admit(self._tcp_conns, key, MAX_TCP_PER_CLIENT):
            writer.close()
            return
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(2), _TCP_IDLE_S)
                (length,) = struct.unpack("!H", head)
                data = await asyncio.wait_for(reader.readexactly(length), _TCP_IDLE_S)
                reply = await self.bounded_answer(data, client, tcp=True, by_port=by_port)
                if reply is None:
                    break
                writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._release(self._tcp_conns, key)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _client_key(client: str, by_port: PortAsker | None) -> str:
    return client if by_port is None else f"{client}@{by_port.port}"


def _bound_pair(host: str, port: int, mark: int | None) -> tuple[socket.socket, socket.socket]:
    """The UDP socket and the listening TCP socket of one address (docs/reference/behaviour.md §20.1: the UDP
    one never shares its port, both carry the owner mark when one is given)."""
    udp = bound_socket(host, port, socket.SOCK_DGRAM, mark=mark)
    try:
        tcp = bound_socket(host, port, socket.SOCK_STREAM, mark=mark, backlog=256)
    except BaseException:
        udp.close()
        raise
    return udp, tcp


async def _close_all(
    transports: list[asyncio.DatagramTransport], servers: list[asyncio.Server], *, wait: bool = True
) -> None:
    for t in transports:
        t.close()
    for srv in servers:
        srv.close()
        if wait:  # Server.wait_closed also waits for every open connection to end
            with contextlib.suppress(Exception):
                await srv.wait_closed()


def _keep_learned(reply: DNSRecord, learned: set[IPAddress]) -> bool:
    """Drop the answer's A/AAAA records the kernel did not take; True when any went."""
    kept = []
    for rr in reply.rr:
        if rr.rtype in (QTYPE.A, QTYPE.AAAA):
            try:
                if ipaddress.ip_address(str(rr.rdata)) not in learned:
                    continue
            except ValueError:
                continue
        kept.append(rr)
    if len(kept) == len(reply.rr):
        return False
    reply.rr = kept
    return True


def _parse_query(data: bytes, client: str) -> tuple[DNSRecord, IPAddress] | None:
    """The query and its source address; None for anything that is not a parseable query
    from an IP address (answered with silence)."""
    try:
        query = DNSRecord.parse(data)
    except Exception:
        return None
    if query.header.qr:
        return None  # a response, not a query
    try:
        ip = unmap_ip(ipaddress.ip_address(client.split("%", 1)[0]))
    except ValueError:
        return None
    return query, ip


def _udp_limit(query: DNSRecord) -> int:
    for rr in query.ar:
        if rr.rtype == QTYPE.OPT:
            return max(_CLASSIC_UDP, int(rr.rclass))
    return _CLASSIC_UDP


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, proxy: DnsProxy, by_port: PortAsker | None = None) -> None:
        self.proxy = proxy
        self.by_port = by_port
        self.transport: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.DatagramTransport)
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        task = asyncio.get_running_loop().create_task(self._reply(data, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        try:
            reply = await self.proxy.bounded_answer(data, str(addr[0]), tcp=False, by_port=self.by_port)
        except Exception:
            log.exception("dns.query_crashed")
            return
        if reply is not None and self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(reply, addr)
