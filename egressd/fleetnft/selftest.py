"""What the fleet's ruleset needs from the kernel: its start-up probes, and the bridge report.

:mod:`egressd.engine.selftest` runs the probes (:func:`selftest_probes`) in a scratch table that
is deleted afterwards; the first failure refuses start-up with a one-line reason instead of
running silently open or silently dead. The probes go through the paths the daemon uses:
libnftables scripts, then netlink batches, then the lease-renewal probe.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from egressd.engine.selftest import Probe, Probes
from egressd.fleetnft.contents import dyn_add
from egressd.fleetnft.table import Names
from egressd.kernel import renewal
from egressd.kernel.applier import NftError
from egressd.kernel.listeners import OWNER_MARK
from egressd.kernel.netlink_dump import SetElement
from egressd.kernel.ops import (
    AddCounter,
    AddCounterRef,
    AddIface,
    AddIntervals,
    AddPortElems,
    AddRule,
    AddSet,
    AddTimed,
    AuditRule,
    DeleteChain,
    DeleteElement,
    DeleteIface,
    DeletePortElems,
    DeleteSet,
    FlushSet,
    L4Guard,
    MatchRule,
    NetlinkBatch,
    PortRule,
    RuleAction,
    VerdictRule,
)
from egressd.kernel.renewal import PROBE_IP, LeaseRenewal
from egressd.nftsyntax import FORWARDER_MARK, FORWARDER_ZONE_CHAIN, forwarder_zone, unredirected_dns
from egressd.subject.leases import Grant


@dataclass(frozen=True, slots=True)
class BridgeReport:
    bridges: tuple[str, ...]
    nf_call_iptables: str | None  # "1", "0" or None when the sysctl is absent
    unisolated_ports: tuple[str, ...]
    nf_call_ip6tables: str | None = None  # None: absent (no IPv6 bridge netfilter to bypass)

    @property
    def bypass_risk(self) -> bool:
        """Bridged sandbox-to-sandbox frames skip the forward hook when a sysctl is 0 (IPv4:
        also when absent; IPv6: only when present and not 1)."""
        if not (self.bridges and self.unisolated_ports):
            return False
        return self.nf_call_iptables != "1" or self.nf_call_ip6tables not in (None, "1")

    def failing_sysctls(self) -> str:
        """The sysctl name(s) behind :attr:`bypass_risk`, for the one-line refusal."""
        bad = []
        if self.nf_call_iptables != "1":
            bad.append("net.bridge.bridge-nf-call-iptables")
        if self.nf_call_ip6tables not in (None, "1"):
            bad.append("net.bridge.bridge-nf-call-ip6tables")
        return " and ".join(bad)

    def describe(self) -> str:
        if not self.bridges:
            return "no bridge in this namespace"
        return (
            f"bridges {','.join(self.bridges)}: net.bridge.bridge-nf-call-iptables="
            f"{self.nf_call_iptables or 'absent'}, bridge-nf-call-ip6tables="
            f"{self.nf_call_ip6tables or 'absent'}, non-isolated ports: {len(self.unisolated_ports)}"
        )


def bridge_report(
    sys_root: Path = Path("/sys/class/net"), proc_root: Path = Path("/proc/sys")
) -> BridgeReport:
    bridges: list[str] = []
    unisolated: list[str] = []
    try:
        links = sorted(os.listdir(sys_root))
    except OSError:
        links = []
    for name in links:
        if (sys_root / name / "bridge").is_dir():
            bridges.append(name)
            brif = sys_root / name / "brif"
            try:
                ports = sorted(os.listdir(brif))
            except OSError:
                ports = []
            for port in ports:
                try:
                    isolated = (brif / port / "isolated").read_text().strip()
                except OSError:
                    isolated = "0"
                if isolated != "1":
                    unisolated.append(port)

    def sysctl(name: str) -> str | None:
        try:
            return (proc_root / "net/bridge" / name).read_text().strip()
        except OSError:
            return None

    return BridgeReport(
        tuple(bridges),
        sysctl("bridge-nf-call-iptables"),
        tuple(unisolated),
        sysctl("bridge-nf-call-ip6tables"),
    )


def _probes(t: str) -> list[tuple[str, str]]:
    return [
        ("table creation", f"add table inet {t}"),
        ("regular chains", f"add chain inet {t} c1\nadd chain inet {t} c2"),
        (
            "base chains (prerouting/forward/input hooks)",
            f"add chain inet {t} pre {{ type filter hook prerouting priority 0; policy accept; }}\n"
            f"add chain inet {t} fwd_ {{ type filter hook forward priority 0; policy accept; }}\n"
            f"add chain inet {t} in_ {{ type filter hook input priority 0; policy accept; }}",
        ),
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
            "verdict maps",
            f"add map inet {t} vm {{ type ipv4_addr : verdict; elements = {{ 10.0.0.5 : jump c1 }} }}\n"
            f"add rule inet {t} fwd_ ip saddr vmap @vm",
        ),
        (
            "packet marks",
            f"add rule inet {t} pre meta mark set meta mark & 0xfffffffd\n"
            f"add rule inet {t} c1 ip daddr @iv4 meta mark set 0x2\n"
            f"add rule inet {t} fwd_ meta mark & 0x2 != 0x2 drop",
        ),
        (
            # Forged sources (docs/reference/behaviour.md §17, §20.2): reverse path and source type, in
            # rules no real packet matches (no such interface, no such mark).
            "source-address lookups (fib saddr)",
            f'add rule inet {t} pre iifname "egressd-probe" fib saddr . iif oif missing drop\n'
            f"add rule inet {t} pre meta mark 0x45470001 fib saddr type != local drop",
        ),
        *_match_probes(t),
        (
            # nftsyntax.unredirected_dns (host-uid subjects' output chain).
            "conntrack state and status of unredirected DNS",
            "\n".join(f"add rule inet {t} fwd_ {body}" for body in unredirected_dns("drop")),
        ),
        _zone_probe(t),
    ]


def _zone_probe(t: str) -> tuple[str, str]:
    """nftsyntax.forwarder_zone: the DNS forwarder's flows in a conntrack zone of their own."""
    return (
        "directional conntrack zone (raw output chain, ct original zone set)",
        f"add chain inet {t} fz {FORWARDER_ZONE_CHAIN}\nadd rule inet {t} fz {forwarder_zone(FORWARDER_MARK, 0)}",
    )


def _match_probes(t: str) -> list[tuple[str, str]]:
    """Matches, marks and NAT, on the objects :func:`_probes` declared before them."""
    return [
        (
            "conntrack matches",
            f"add rule inet {t} fwd_ ct state established,related accept\n"
            f"add rule inet {t} c2 ct original ip daddr @iv4 accept\n"
            f"add rule inet {t} in_ tcp dport 18081 ct status dnat ip saddr vmap @vm\n"
            f"add rule inet {t} c2 udp dport 15353 ct status dnat ct original proto-dst 53 accept\n"
            f"add rule inet {t} c2 icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} ip6 hoplimit 255 accept",
        ),
        (
            # OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT's marking rule.
            "transport-header port matches",
            f"add rule inet {t} pre ip daddr {{ 192.0.2.53 }} meta l4proto {{ tcp, udp }} th dport 53 "
            "meta mark set meta mark | 0x2",
        ),
        (
            "redirect/DNAT (nat hook)",
            f"add chain inet {t} nat {{ type nat hook prerouting priority dstnat; policy accept; }}\n"
            f"add set inet {t} gw {{ type ipv4_addr; elements = {{ 10.0.0.1 }} }}\n"
            f"add rule inet {t} nat ip daddr @gw udp dport 53 redirect to :15353\n"
            f"add rule inet {t} nat ip saddr @gw tcp dport {{ 80, 443 }} redirect to :18081\n"
            f"add rule inet {t} nat ip daddr 10.0.0.1 tcp dport 8443 dnat ip to 10.0.0.1:18081",
        ),
        (
            # docs/reference/behaviour.md §14.2: nothing addressed to the pod itself is intercepted, and the
            # input hook sends sandbox sources to a regular chain.
            "local-address lookups (fib) and input jumps",
            f"add rule inet {t} nat fib daddr type local tcp dport {{ 80, 443 }} return\n"
            f"add set inet {t} sb {{ type ipv4_addr; elements = {{ 10.0.0.5 }} }}\n"
            f"add chain inet {t} c3\n"
            f"add rule inet {t} in_ ip saddr @sb jump c3",  # c1, c2 are deleted by later probes
        ),
        (
            # docs/reference/behaviour.md §20.1: what is sent to egressd's ports reaches egressd's sockets only.
            "socket ownership matches (socket mark, ct direction)",
            f"add chain inet {t} own\n"
            f"add rule inet {t} own ct direction reply return\n"
            f"add rule inet {t} own socket mark != {OWNER_MARK:#010x} drop\n"
            f"add rule inet {t} in_ udp dport {{ 15353, 16000-16256 }} jump own\n"
            f"add rule inet {t} in_ tcp dport {{ 15353, 18080-18081 }} jump own",
        ),
        (
            # docs/reference/behaviour.md §20.2: sandbox-facing interfaces, by name, set and prefix.
            "interface-name sets and prefixes",
            f"add set inet {t} ifs {{ type ifname; }}\n"
            f"add rule inet {t} in_ iifname @ifs jump c3\n"
            f'add rule inet {t} in_ iifname "vh*" jump c3',
        ),
        (
            # docs/reference/behaviour.md §15: refusals are counted per source through a counter map.
            "refusal counting (counter maps, goto)",
            f"add counter inet {t} k0\n"
            f"add map inet {t} cm {{ type ipv4_addr : counter; }}\n"
            f"add chain inet {t} dv\n"
            f"add rule inet {t} dv drop\n"
            f"add rule inet {t} fwd_ counter name ip saddr map @cm goto dv",
        ),
    ]


PROBE_SUBJECT = "renewal_probe"


def probe_lease_renewal(
    batch: Callable[[NetlinkBatch], None],
    elements: Callable[[str, str], list[SetElement]],
    table: str,
) -> LeaseRenewal:
    """Whether this kernel extends a lease the way :func:`dyn_add` renews one (§9), in a scratch
    dyn set of ``table`` (:func:`egressd.kernel.renewal.probe`)."""
    name = Names(PROBE_SUBJECT).set("dyn_v4")
    batch(NetlinkBatch(table, (AddSet(name, "v4", "timeout", 360),)))

    def add(seconds: int, replace: bool) -> None:
        batch(dyn_add(table, PROBE_SUBJECT, [Grant(PROBE_IP, seconds)], replace=replace))

    return renewal.probe(add, partial(elements, table, name))


def _netlink_probes(t: str) -> list[tuple[str, NetlinkBatch]]:
    """The raw netlink batches, run after :func:`_probes` built the objects they name."""
    return [
        (
            "netlink rules (set lookups, marks, conntrack original destination)",
            NetlinkBatch(
                t,
                (
                    AddRule("c1", MatchRule("v4", "iv4", RuleAction.DROP)),
                    AddRule("c1", MatchRule("v6", "iv6", RuleAction.DROP)),
                    AddRule("c1", MatchRule("v4", "iv4", RuleAction.MARK)),
                    AddRule("c2", MatchRule("v4", "iv4", RuleAction.ACCEPT, ct_original=True)),
                    AddRule("c2", VerdictRule(RuleAction.DROP)),
                ),
            ),
        ),
        (
            "netlink refusal counting (counter map elements, goto verdicts)",
            NetlinkBatch(
                t,
                (
                    AddCounterRef("cm", ipaddress.IPv4Address("10.0.0.5"), "k0"),
                    AddRule("c2", MatchRule("v4", "iv4", RuleAction.DROP, ct_original=True, drop_chain="dv")),
                    AddRule("c2", VerdictRule(RuleAction.DROP, drop_chain="dv")),
                ),
            ),
        ),
        *_port_probes(t),
        *_netlink_content_probes(t),
    ]


def _port_probes(t: str) -> list[tuple[str, NetlinkBatch]]:
    """Port-scoped sets, elements and rules (docs/reference/behaviour.md §18): without them a policy
    with ports could not be enforced, so a kernel that refuses them fails start-up."""
    net = ipaddress.ip_network
    v4 = (net("192.0.2.0/24"), "tcp", 443, 443)
    one = (net("192.0.2.7/32"), "tcp", 443, 443)
    return [
        (
            "netlink port-scoped sets (addr . inet_proto . inet_service, interval, timeout and hash)",
            NetlinkBatch(
                t,
                (
                    AddSet("pv4", "v4", "interval", ports=True),
                    AddSet("ptv6", "v6", "timeout", 360, size=16, ports=True),
                    AddRule("c1", PortRule("v4", "pv4", RuleAction.MARK)),
                    AddRule("c1", PortRule("v6", "ptv6", RuleAction.DROP)),
                    AddRule("c2", PortRule("v4", "pv4", RuleAction.ACCEPT, ct_original=True)),
                    AddRule("c1", MatchRule("v4", "tv4", RuleAction.MARK, guard=L4Guard.UDP_NOT_443)),
                    AddPortElems("pv4", "v4", (v4, (net("192.0.2.0/24"), "udp", 1000, 2000))),
                    AddPortElems("ptv6", "v6", ((net("2001:db8::1/128"), "tcp", 80, 443),), (60,)),
                    AddPortElems("pv4", "v4", (v4,)),
                    DeletePortElems("pv4", "v4", (v4,)),
                    FlushSet("ptv6"),
                    # The leases' single ports: a hash set (no interval flag), key-only elements.
                    AddSet("pxv4", "v4", "timeout", 360, size=16, ports=True, exact=True),
                    AddRule("c1", PortRule("v4", "pxv4", RuleAction.MARK, exact=True)),
                    AddRule("c2", PortRule("v4", "pxv4", RuleAction.ACCEPT, ct_original=True, exact=True)),
                    AddPortElems("pxv4", "v4", (one,), (60,), exact=True),
                    DeletePortElems("pxv4", "v4", (one,), exact=True),
                    AddPortElems("pxv4", "v4", (one,), (60,), exact=True),
                    FlushSet("pxv4"),
                ),
            ),
        ),
    ]


def _netlink_content_probes(t: str) -> list[tuple[str, NetlinkBatch]]:
    """Audit rules and element changes, on the objects the earlier probes built."""
    v4 = ipaddress.IPv4Network
    return [
        (
            "netlink audit rules (counter objects, log, inverted lookups, ct state, mark tests)",
            NetlinkBatch(
                t,
                (
                    AddCounter("k1"),
                    AddRule(
                        "c1", AuditRule("v4", "iv4", "iv4", "egressd selftest ", "k1", unmarked_only=True)
                    ),
                ),
            ),
        ),
        (
            "netlink interval-set content swap",
            NetlinkBatch(
                t,
                (
                    FlushSet("iv4"),
                    AddIntervals("iv4", "v4", (v4("0.0.0.0/8"), v4("10.0.0.0/24"), v4("255.255.255.0/24"))),
                ),
            ),
        ),
        (
            "netlink timeout elements",
            NetlinkBatch(t, (AddTimed("tv4", "v4", ((ipaddress.IPv4Address("192.0.2.2"), 60),)),)),
        ),
        (
            "netlink interface-name elements",
            NetlinkBatch(
                t,
                (AddIface("ifs", "egressd-probe"), AddIface("ifs", "vh0"), DeleteIface("ifs", "egressd-probe")),
            ),
        ),
        (
            "netlink delete batches",
            NetlinkBatch(
                t,
                (
                    DeleteElement("vm", ipaddress.IPv4Address("10.0.0.5")),
                    DeleteChain("c2"),
                    FlushSet("tv4"),
                ),
            ),
        ),
        # Last: the netlink probes above use c1 and iv6.
        ("netlink delete batches", NetlinkBatch(t, (DeleteChain("c1"), DeleteSet("iv6")))),
    ]


def selftest_probes(
    t: str,
    cmd: Callable[[str], None],
    batch: Callable[[NetlinkBatch], None],
    elements: Callable[[str, str], list[SetElement]],
) -> Probes[LeaseRenewal]:
    """The probes in scratch table ``t``: scripts (``cmd``, a failure is an :class:`NftError`),
    then netlink batches (``batch``: any failure), then how DNS leases are to be renewed on this
    kernel (``elements`` reads one set back)."""
    return Probes(
        features=[
            *(Probe(feature, partial(cmd, script), NftError) for feature, script in _probes(t)),
            *(Probe(feature, partial(batch, nl), Exception) for feature, nl in _netlink_probes(t)),
        ],
        verdict=Probe("timed set element renewal", partial(probe_lease_renewal, batch, elements, t), Exception),
        cleanup=f"delete table inet {t}",
    )
