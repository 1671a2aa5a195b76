"""What the sidecar's table (§8.6) needs from the kernel: its start-up probes, and the
capability checks before them.

:mod:`egressd.engine.selftest` runs the probes (:func:`selftest_probes`) in a scratch table that
is deleted afterwards. The first failure refuses start-up with a one-line reason: a sidecar that
cannot enforce must not run silently open.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from egressd.engine.selftest import Probe, Probes, SelfTestError
from egressd.kernel import renewal
from egressd.kernel.applier import NftError
from egressd.kernel.netlink_dump import SetElement
from egressd.kernel.renewal import PROBE_IP, LeaseRenewal
from egressd.nftsyntax import FORWARDER_MARK, FORWARDER_ZONE_CHAIN, forwarder_zone, unredirected_dns
from egressd.sidecarnft.ruleset import (
    ESTABLISHED_UNLESS_MARKED,
    MARK_MIDSTREAM_PICKUP,
    REFUSE,
    UNASSURED_REPLY_REFUSED,
    SidecarTable,
    dyn_add,
    dyn_set,
)
from egressd.subject.leases import Grant

CAP_NET_ADMIN = 12
CAP_SETGID = 6


def has_capability(proc_status: str, cap: int) -> bool | None:
    """Whether ``CapEff`` in a /proc/<pid>/status text holds capability ``cap`` (None: no such line)."""
    for line in proc_status.splitlines():
        if line.startswith("CapEff:"):
            try:
                return bool(int(line.split(":", 1)[1].strip(), 16) >> cap & 1)
            except ValueError:
                return None
    return None


def has_net_admin(proc_status: str) -> bool | None:
    return has_capability(proc_status, CAP_NET_ADMIN)


def check_setgid_for_mitm(status_path: str = "/proc/self/status") -> None:
    """The sidecar's MITM child runs with its own group id (its upstream leg is exempted from the
    redirect by it): without CAP_SETGID it could never start. Refuse in one line instead."""
    try:
        with open(status_path) as fh:
            text = fh.read()
    except OSError:
        return
    if has_capability(text, CAP_SETGID) is False:
        raise SelfTestError(
            "missing CAP_SETGID: the sidecar's transparent MITM runs with its own group id "
            "(grant SETGID or turn OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT off)"
        )


def check_net_admin(status_path: str = "/proc/self/status") -> None:
    """Refuse early and in one line: without the capability libnftables also prints its own
    complaint to stderr before failing."""
    try:
        with open(status_path) as fh:
            text = fh.read()
    except OSError:
        return  # unknown: the nft probes below decide
    if has_net_admin(text) is False:
        raise SelfTestError("missing CAP_NET_ADMIN: the sidecar cannot enforce egress in this namespace")


def _port_probes(t: str) -> list[tuple[str, str]]:
    """docs/reference/behaviour.md §18: rules and leases with ports, and the QUIC guard (after the
    output chain and the timeout set exist)."""
    return [
        (
            "port-scoped sets (addr . inet_proto . inet_service, interval and timeout)",
            f"add set inet {t} pv4 {{ type ipv4_addr . inet_proto . inet_service; flags interval; "
            f"elements = {{ 10.0.0.0/8 . tcp . 5432-5433, 192.0.2.1 . udp . 443 }} }}\n"
            f"add set inet {t} ptv6 {{ type ipv6_addr . inet_proto . inet_service; flags interval,timeout; "
            f"timeout 360s; size 16; elements = {{ 2001:db8::1 . tcp . 443 timeout 90s expires 90s }} }}\n"
            f"add rule inet {t} out ip daddr . meta l4proto . th dport @pv4 accept\n"
            f"add rule inet {t} out ip6 daddr . meta l4proto . th dport @ptv6 drop\n"
            f"add rule inet {t} out ip daddr @tv4 meta l4proto != udp accept\n"
            f"add rule inet {t} out ip daddr @tv4 udp dport != 443 accept",
        ),
    ]


def _guard_probes(t: str) -> list[tuple[str, str]]:
    """The guard (ruleset._guard_chain): source-address type, conntrack state and status."""
    return [
        (
            "output guard (fib saddr type, ct state and ct status on output)",
            f"add chain inet {t} guard {{ type filter hook output priority 0; policy accept; }}\n"
            f"add rule inet {t} guard ip6 saddr != :: meta skuid >= 0 fib saddr type != local drop\n"
            + "".join(f"add rule inet {t} guard {body}\n" for body in unredirected_dns("drop"))
            + f"add rule inet {t} guard meta l4proto {{ tcp, udp }} ct direction original ct original proto-dst 53 "
            "th dport != 15353 drop",
        ),
        (
            # ruleset._fwd_zone_chain (nftsyntax.forwarder_zone).
            "directional conntrack zone (raw output chain, ct original zone set)",
            f"add chain inet {t} fz {FORWARDER_ZONE_CHAIN}\nadd rule inet {t} fz {forwarder_zone(FORWARDER_MARK)}",
        ),
    ]


def _inbound_probes(t: str) -> list[tuple[str, str]]:
    """The inbound chain (ruleset._inbound_chain): a TCP flow picked up mid-stream is marked."""
    return [
        (
            "TCP flows picked up mid-stream from outside marked (input hook, TCP flags, ct mark set)",
            f"add chain inet {t} ib {{ type filter hook input priority 0; policy accept; }}\n"
            f"add rule inet {t} ib {MARK_MIDSTREAM_PICKUP}",
        ),
    ]


def _probes(t: str, dns_port: int) -> list[tuple[str, str]]:
    return [
        (
            "interval sets",
            f"add set inet {t} iv4 {{ type ipv4_addr; flags interval; elements = {{ 10.0.0.0/24, 10.1.0.1 }} }}\n"
            f"add set inet {t} iv6 {{ type ipv6_addr; flags interval; elements = {{ 2001:db8::/32 }} }}",
        ),
        (
            "timeout sets",
            f"add set inet {t} tv4 {{ type ipv4_addr; flags timeout; timeout 360s; "
            f"elements = {{ 192.0.2.1 timeout 90s expires 90s }} }}",
        ),
        (
            "output-hook filter chain",
            f"add chain inet {t} out {{ type filter hook output priority 0; policy accept; }}\n"
            f"add rule inet {t} out {UNASSURED_REPLY_REFUSED.removesuffix(REFUSE)}drop\n"
            f"add rule inet {t} out {ESTABLISHED_UNLESS_MARKED}\n"
            f"add rule inet {t} out meta mark {FORWARDER_MARK:#x} accept\n"
            f'add rule inet {t} out oifname "lo" accept\n'
            f"add rule inet {t} out ip daddr @iv4 tcp dport 443 drop\n"
            f"add rule inet {t} out ip6 daddr @iv6 drop\n"
            f"add rule inet {t} out ip daddr @tv4 accept\n"
            f"add rule inet {t} out counter",
        ),
        (
            "DNS redirect (nat hook output)",
            f"add chain inet {t} nat {{ type nat hook output priority -100; policy accept; }}\n"
            f"add rule inet {t} nat meta mark {FORWARDER_MARK:#x} return\n"
            f"add rule inet {t} nat udp dport 53 redirect to :{dns_port}\n"
            f"add rule inet {t} nat tcp dport 53 redirect to :{dns_port}",
        ),
        (
            "nameserver exemption (transport-header port matches)",
            f"add rule inet {t} nat ip daddr {{ 192.0.2.53 }} meta l4proto {{ tcp, udp }} th dport 53 return\n"
            f"add rule inet {t} out ip daddr {{ 192.0.2.53 }} meta l4proto {{ tcp, udp }} th dport 53 accept",
        ),
        (
            "MITM interception (skgid exemption, port redirect, ct status dnat on input)",
            f"add rule inet {t} nat meta skgid 18081 return\n"
            f"add rule inet {t} nat ip6 daddr ::1 return\n"
            f"add rule inet {t} nat tcp dport {{ 80, 443 }} redirect to :18081\n"
            f"add chain inet {t} mi {{ type filter hook input priority 0; policy accept; }}\n"
            f"add rule inet {t} mi tcp dport 18081 ct status dnat accept\n"
            f"add rule inet {t} mi tcp dport 18081 drop",
        ),
        (
            # docs/reference/behaviour.md §15: every refusal is counted in a named counter (given a start value:
            # the count carried over a rebuild) by a chain the others goto.
            "refusal counting (named counter with a value, goto)",
            f"add counter inet {t} dropped {{ packets 3 bytes 0 }}\n"
            f"add chain inet {t} denied\n"
            f'add rule inet {t} denied counter name "dropped"\n'
            f"add rule inet {t} denied drop\n"
            f"add rule inet {t} out ip daddr @iv4 goto denied",
        ),
    ]


def probe_lease_renewal(
    cmd: Callable[[str], None], elements: Callable[[str, str], list[SetElement]], table: str
) -> LeaseRenewal:
    """Whether this kernel extends a lease the way the engine renews one (``dyn_add``), in the
    dyn set of ``table`` (:func:`egressd.kernel.renewal.probe`)."""

    def add(seconds: int, replace: bool) -> None:
        cmd(
            dyn_add(
                SidecarTable(table=table, max_leases=0, renew_by_replace=replace), [Grant(PROBE_IP, seconds)]
            )
        )

    return renewal.probe(add, partial(elements, table, dyn_set("v4")))


def selftest_probes(
    t: str,
    cmd: Callable[[str], None],
    elements: Callable[[str, str], list[SetElement]],
    *,
    dns_port: int,
) -> Probes[LeaseRenewal]:
    """The probes in scratch table ``t``, all libnftables scripts (``cmd``, a failure is an
    :class:`NftError`), then how DNS leases are to be renewed on this kernel (``elements`` reads
    one set back)."""
    return Probes(
        features=[
            # The table itself: the runner's first try just made one, so a failure here is no
            # missing feature and goes up as it is.
            Probe("scratch table", partial(cmd, f"add table inet {t}"), ()),
            *(
                Probe(feature, partial(cmd, script), NftError)
                for feature, script in (
                    *_probes(t, dns_port),
                    *_guard_probes(t),
                    *_inbound_probes(t),
                    *_port_probes(t),
                )
            ),
        ],
        verdict=Probe("timed set element renewal", partial(probe_lease_renewal, cmd, elements, t), NftError),
        cleanup=f"add table inet {t}\ndelete table inet {t}",
    )
