"""Pure generation of the fleet nftables ruleset (docs/reference/behaviour.md §8): the table's knobs, its
object names and the nft text helpers shared by the modules that build it.

Everything in the ruleset modules returns text (libnftables scripts, one script = one atomic
transaction) or :class:`~egressd.kernel.ops.NetlinkBatch` data (one batch = one atomic
transaction); nothing touches the kernel. By concern:

* :mod:`egressd.fleetnft.header`: the table-wide part (maps, sets and base chains of the
  network subjects: dispatch, marking, input, nat, the refusal chains);
* :mod:`egressd.fleetnft.subject`: a subject's own chains, sets, fixed rules and dispatch keys;
* :mod:`egressd.fleetnft.audit`: audit mode's rules and counters;
* :mod:`egressd.fleetnft.contents`: what the sets hold (policy swaps, DNS leases);
* :mod:`egressd.fleetnft.hostuid`: the host-uid subjects (output hook, uid-keyed maps).

libnftables 1.0.6 dumps every set of the netns before an ``add rule`` or a flush+add of a set in
one batch (~15 ms at 1000 subjects) and every interval set's elements before an ``add element``
(~1 s). egressd only hands libnftables cache-free declarations (sets, chains, map elements
re-declared inline); rules, content swaps and deletions go through raw netlink batches
(:mod:`egressd.kernel.ops`), whose cost does not grow with the fleet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from egressd.addr import IPAddress
from egressd.nftsyntax import IPNetwork, addr_type
from egressd.subject.hostuid import DEFAULT_UID_PORTS, UidPorts

CORE_SETS = ("allow_v4", "allow_v6", "deny_v4", "deny_v6")
# wdeny: the user's deny prefixes while auditing; audit: 0.0.0.0/0, ::/0 while auditing.
# Declared (with the audit rules that read them) by :func:`audit_objects` on the subject's
# first audit policy and kept until its removal: the kernel finds a set by name by walking the
# table's list of sets, so every set fewer per subject makes every set-name lookup of every
# transaction cheaper (scripts/bench/results/report-fleet-2026-12-03.md: 10 -> 6 sets per subject).
AUDIT_SETS = ("wdeny_v4", "wdeny_v6", "audit_v4", "audit_v6")
STATIC_SETS = (*CORE_SETS, *AUDIT_SETS)
DYN_SETS = ("dyn_v4", "dyn_v6")
# Port-scoped sets (docs/reference/behaviour.md §18), keyed ``addr . inet_proto . inet_service``:
# IP/CIDR rules with ports or a protocol (allowp mark, denyp refuse), and DNS leases whose
# names' scope is not every port and protocol (dynp, per-element timeouts). Rules without
# ports keep the address-only sets above (the cheap path).
PORT_STATIC_SETS = ("allowp_v4", "allowp_v6", "denyp_v4", "denyp_v6")
# Audit mode's port-scoped would-deny set: the user's deny rules with ports while auditing
# (made with the other audit objects).
AUDIT_PORT_SETS = ("wdenyp_v4", "wdenyp_v6")
DYNP_SETS = ("dynp_v4", "dynp_v6")
# The leases' single-port elements (address . proto . one port: 443, 80, 22): a hash set (no
# interval flag), which costs the same to add to at any size, where the pipapo dynp set clones
# its lookup data on every transaction (docs/concepts/ruleset.md). dynp keeps the port ranges.
DYNPX_SETS = ("dynpx_v4", "dynpx_v6")
# The hash path for the leases' port ranges (egressd.subject.ranges): a lease whose ranges are
# the subject's shared ranges is its address alone in dynr (a timeout hash set like dyn), read
# with dynrports (``inet_proto . inet_service`` intervals: the shared ranges, written with the
# policy). Only other ranges go to the pipapo dynp, whose every change clones it. Declared
# (with the rules that read them) by :func:`range_objects` with the subject's first policy that
# has shared ranges and kept until its removal, like the audit sets and for the same reason.
DYNR_SETS = ("dynr_v4", "dynr_v6")
SHARED_RANGE_SETS = ("dynrports_v4", "dynrports_v6")
PORT_SETS = (*PORT_STATIC_SETS, *DYNP_SETS, *DYNPX_SETS, *DYNR_SETS, *SHARED_RANGE_SETS)
SETS = (*STATIC_SETS, *DYN_SETS, *PORT_SETS)
AUDIT_COUNTERS = ("deny", "default")  # which audit rule counted: a user deny prefix, or no allow
AUDIT_LOG_PREFIX = "egressd would-deny "
#: Every refusal goes here (docs/reference/behaviour.md §15): counted per source, then DENY_VERDICT_CHAIN.
DENIED_CHAIN = "denied"
#: How a refusal looks: drop, or (EGRESSD_DENY_REJECT) TCP reset / ICMP admin-prohibited.
DENY_VERDICT_CHAIN = "deny_verdict"
#: Refusals of sources that are no subject (unknown sources, a privateCidr address nobody
#: registered, the pod's own connections to the MITM port).
UNATTRIBUTED_COUNTER = "unattributed_dropped"
DROPPED_SUFFIX = "_dropped"
REFUSE = f"goto {DENIED_CHAIN}"


@dataclass(frozen=True, slots=True)
class TableConfig:
    """Fleet-wide knobs that shape the ruleset."""

    table: str = "opensandbox-fleet"
    dns_port: int = 15353
    mitm: bool = False
    mitm_port: int = 18081
    block_doh_443: bool = False
    doh_blocklist: tuple[IPNetwork, ...] = ()
    # Size of each dyn set: the per-subject lease cap (docs/reference/behaviour.md §14.4); 0 = unbounded.
    max_leases: int = 4096
    # Host-uid subjects (docs/reference/behaviour.md §17): the uid range the output hook polices and their port
    # block; egressd's own uid (exempt if inside the range) and HTTP port (never reachable
    # from a sandbox uid, like every other listener of egressd's).
    uids: UidPorts = DEFAULT_UID_PORTS
    own_uid: int | None = None
    http_port: int = 18080
    # EGRESSD_DENY_REJECT (docs/reference/behaviour.md §15): refuse with a TCP reset / ICMP admin-prohibited.
    deny_reject: bool = False
    # OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS: intercepted like 80 and 443 (MITM on).
    mitm_extra_ports: tuple[int, ...] = ()
    # OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT: registered sandboxes may query these directly on
    # port 53 (udp and tcp), nothing else of them; the lateral drops still come first (14.2).
    nameserver_exempt: tuple[IPAddress, ...] = ()
    # The self-test found that re-adding a timed element does not extend it (egressd.kernel.renewal).
    renew_by_replace: bool = False
    # EGRESSD_MITM_WORKERS: worker i listens on mitm_port + i.
    mitm_workers: int = 1
    # EGRESSD_SANDBOX_IFACES (docs/reference/behaviour.md §20.2): interface names, or ``prefix*``, whose
    # packets come from sandboxes (bridges, veth name prefixes), beside the attachments'
    # hostVeths (set ``sandbox_ifaces``).
    sandbox_ifaces: tuple[str, ...] = ()
    # The QUIC drop of docs/reference/behaviour.md §18: on, the kernel never opens UDP 443 of a
    # DNS-learned address unless an explicit ``protocol: udp`` rule does (the dyn sets' rules skip
    # it). The daemon sets it from EGRESSD_NAME_CHECK (``MitmConfig.quic_guard``: on unless
    # ``off``, with or without the MITM); None (tests, tools) follows the MITM.
    name_check: bool | None = None

    @property
    def checks_names(self) -> bool:
        """Whether the name check is on (EGRESSD_NAME_CHECK; default: with the MITM)."""
        return self.mitm if self.name_check is None else self.name_check


@dataclass(frozen=True, slots=True)
class SubjectNft:
    """What the ruleset needs to know about one subject."""

    nft_id: str
    ip: IPAddress
    gateway: IPAddress
    worker: int = 0  # the MITM worker its intercepted connections go to (fleetnft.workers)


@dataclass(frozen=True, slots=True)
class Names:
    """nft object names of one subject (docs/concepts/ruleset.md, "Kernel objects")."""

    nft_id: str

    def set(self, kind: str) -> str:
        return f"subj_{self.nft_id}_{kind}"

    @property
    def chain(self) -> str:
        return f"subj_{self.nft_id}"

    @property
    def mark_chain(self) -> str:
        return f"mark_{self.nft_id}"

    @property
    def in_chain(self) -> str:
        return f"subj_{self.nft_id}_in"

    def counter(self, kind: str) -> str:
        return f"subj_{self.nft_id}_audit_{kind}"

    @property
    def dropped_counter(self) -> str:
        """Every packet of the subject that egressd's rules refuse (docs/reference/behaviour.md §15)."""
        return f"subj_{self.nft_id}{DROPPED_SUFFIX}"

    @property
    def log_prefix(self) -> str:
        # The nft id is unique among registered subjects and already log-safe ([a-z0-9_]);
        # cut so the prefix fits the kernel's 127 bytes (the counter names stay exact).
        return f"{AUDIT_LOG_PREFIX}{self.nft_id[:100]} "


def subject_set(nft_id: str, kind: str, fam: str) -> str:
    """``subj_<id>_<kind>_<fam>``: one of a subject's sets (``kind`` one of allow, deny, wdeny,
    audit, dyn; ``fam`` v4 or v6)."""
    return Names(nft_id).set(f"{kind}_{fam}")


def dropped_counter_subject(name: str) -> str | None:
    """``subj_<id>_dropped`` -> the nft id, else None (audit counters never end that way)."""
    if name.startswith("subj_") and name.endswith(DROPPED_SUFFIX) and len(name) > 5 + len(DROPPED_SUFFIX):
        return name[len("subj_") : -len(DROPPED_SUFFIX)]
    return None


class _Script:
    """Accumulates ``<verb> <object> inet T ...`` lines for one transaction."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.lines: list[str] = []

    def add(self, line: str) -> None:
        self.lines.append(line)

    def obj(self, verb: str, kind: str, rest: str) -> None:
        self.lines.append(f"{verb} {kind} inet {self.table} {rest}")

    def rule(self, chain: str, body: str) -> None:
        self.obj("add", "rule", f"{chain} {body}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _plain_set_decl(name: str, fam: str, elements: Sequence[str] = ()) -> str:
    body = f"type {addr_type(fam)};"
    if elements:
        body += f" elements = {{ {', '.join(elements)} }}"
    return f"{name} {{ {body} }}"


def _vmap_decl(name: str, fam: str, elements: Sequence[str] = ()) -> str:
    body = f"type {addr_type(fam)} : verdict;"
    if elements:
        body += f" elements = {{ {', '.join(elements)} }}"
    return f"{name} {{ {body} }}"


# Table-wide object names.
def dispatch_map(fam: str) -> str:
    return f"dispatch_{fam}"


def marking_map(fam: str) -> str:
    return f"marking_{fam}"


def mitm_in_map(fam: str) -> str:
    return f"mitm_in_{fam}"


def mitm_src_set(fam: str) -> str:
    return f"mitm_src_{fam}"


def mitm_port_map(fam: str) -> str:
    """Source address -> its MITM worker's port (``type ipv4_addr : inet_service``)."""
    return f"mitm_port_{fam}"


def mitm_ports_set(fam: str) -> str:
    """Source address . tcp . port range: the ports beyond 80, 443 and the extra ports that the
    source's subject's ``http``/``https`` rules name, intercepted for it alone (§18,
    :mod:`egressd.policy.mitmports`). Interval set keyed like the port-scoped sets."""
    return f"mitm_ports_{fam}"


def _port_map_decl(name: str, fam: str, elements: Sequence[str] = ()) -> str:
    body = f"type {addr_type(fam)} : inet_service;"
    if elements:
        body += f" elements = {{ {', '.join(elements)} }}"
    return f"{name} {{ {body} }}"


def sandbox_set(fam: str) -> str:
    """Every registered sandbox address: never a forwarding destination (no lateral movement)."""
    return f"sandboxes_{fam}"


def sandbox_nets_set(fam: str) -> str:
    """Union of every registered attachment's ``privateCidr``: an address there is a sandbox
    (docs/reference/behaviour.md §14.2) even when no subject registered it (a second address a sandbox gave
    itself, a sandbox whose binding has not arrived yet)."""
    return f"sandbox_nets_{fam}"


def drop_counter_map(fam: str) -> str:
    """Source address -> its subject's drop counter (``type ipv4_addr : counter``)."""
    return f"drop_counter_{fam}"


def _counter_map_decl(name: str, fam: str) -> str:
    return f"{name} {{ type {addr_type(fam)} : counter; }}"


def gateway_set(fam: str) -> str:
    return f"dns_gw_{fam}"


def doh_set(fam: str) -> str:
    return f"doh_block_{fam}"


def _ports(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _port_set(items: Iterable[tuple[int, int]]) -> str:
    """An anonymous set of ports and port ranges, duplicates and contained entries dropped."""
    spans: list[tuple[int, int]] = []
    for lo, hi in sorted(set(items)):
        if spans and lo <= spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], max(hi, spans[-1][1]))
        else:
            spans.append((lo, hi))
    return "{ " + ", ".join(_ports(lo, hi) for lo, hi in spans) + " }"


def _own_listener_ports(cfg: TableConfig) -> tuple[str, str]:
    """egressd's UDP and TCP listener ports (DNS, per-subject DNS, HTTP, every MITM worker and
    per-subject MITM port), as anonymous nft sets."""
    dns_lo, dns_hi = cfg.uids.dns_ports
    own_udp = [(cfg.dns_port, cfg.dns_port), (dns_lo, dns_hi)]
    own_tcp = [*own_udp, (cfg.http_port, cfg.http_port)]
    if cfg.mitm:
        own_tcp += [(cfg.mitm_port, cfg.mitm_port + cfg.mitm_workers - 1), cfg.uids.mitm_ports]
    return _port_set(own_udp), _port_set(own_tcp)
