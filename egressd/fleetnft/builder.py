"""Pure generation of the fleet nftables ruleset (docs/behaviour.md §8).

Everything here returns text (libnftables scripts, one script = one atomic transaction) or
:class:`~egressd.kernel.ops.NetlinkBatch` data (one batch = one atomic transaction);
nothing touches the kernel.

Shape, and why it differs from the reference blueprint where it does:

* Dispatch by source IP goes through verdict maps (``dispatch_v4`` … ``marking_v6``) instead
  of one ``ip saddr X jump`` rule per subject: one lookup per packet at any fleet size, and a
  subject's entry can be removed without knowing rule handles.
* A subject's rules are fixed for its lifetime (deny sets drop; allow and dyn sets mark
  ``0x2``), except that its first audit policy adds the audit rules once; its state lives
  only in its set contents. Deny-first is "all its sets empty":
  nothing is marked, so the unmarked-drop tail drops everything. ``defaultAction: allow`` is
  ``0.0.0.0/0`` and ``::/0`` in the allow sets. So activation, policy updates and reverts are
  set-content swaps, never rule changes.
* libnftables 1.0.6 dumps every set of the netns before an ``add rule`` or a flush+add of a
  set in one batch (~15 ms at 1000 subjects) and every interval set's elements before an
  ``add element`` (~1 s). egressd only hands libnftables cache-free declarations (sets,
  chains, map elements re-declared inline); rules, content swaps and deletions go through
  raw netlink batches (:mod:`egressd.kernel.ops`), whose cost does not grow with the fleet.
* Audit mode (a policy with ``"mode": "audit"``) is set content too, once the subject has its
  audit objects (:func:`audit_objects`, added in the transaction of its first audit policy
  and kept until removal; a subject that never audits has 6 sets, not 10, and every
  set-name lookup in the kernel walks the table's whole list of sets). Two rule
  pairs at the end of ``mark_<id>`` log (``log prefix "egressd would-deny <id> "``), count
  (named counters ``subj_<id>_audit_deny`` / ``subj_<id>_audit_default``) and mark new flows
  to ``wdeny`` (the user's deny prefixes, moved out of ``deny`` while auditing) and, if still
  unmarked, to ``audit`` (``0.0.0.0/0`` / ``::/0`` while auditing). Both are empty unless the
  active policy audits, so deny-first (all sets empty) and enforcing subjects are unchanged,
  and switching audit on or off is the same atomic swap as any policy change. ``deny`` keeps
  the operator's always-deny prefixes in audit mode: those stay hard, like the lateral,
  DoT and DoH drops of the header, which audit never touches.
* The DNS redirect is per gateway: a gateway set feeds two shared redirect rules, and the
  gateway element lives exactly as long as some subject uses that gateway.
* With MITM, interception is a REDIRECT for sources in ``mitm_src_v4/v6`` (feasibility
  measured REDIRECT and DNAT-to-gateway as equivalent: both keep the original destination)
  to the source's MITM worker port, looked up in ``mitm_port_v4/v6`` (EGRESSD_MITM_WORKERS:
  one worker per subject, so its snapshot cache stays warm). The port element is added and
  deleted in the same transaction as the ``mitm_src`` and ``mitm_in`` elements, and an
  intercepted source whose lookup misses is dropped right after the redirect rule: there is
  no state in which an intercepted source reaches 80/443 upstream past a worker.
* No lateral movement on any hook (docs/behaviour.md §14.2): the forward hook drops sandbox
  destinations; the nat hook never intercepts a packet addressed to the pod itself or to a
  sandbox (the MITM would connect there on the sandbox's behalf); and the input hook, with or
  without the MITM, sends registered sandbox sources to ``sandbox_in``, which accepts only
  what egressd redirected (DNS, the MITM) and drops every other pod listener. A routed
  topology (one /32 veth per sandbox, the gateway on each) makes sibling traffic cross the
  nat and input hooks exactly like upstream traffic, so the bridge is no safeguard here.
* Every refusal is counted (docs/behaviour.md §15): each drop of the header and of a subject's chains
  is a ``goto denied``. ``denied`` counts the packet in its source's named counter
  ``subj_<id>_dropped`` (looked up in the counter maps ``drop_counter_v4/v6``, keyed like the
  dispatch maps) or, for a source that is no subject, in ``unattributed_dropped``, then hands
  it to ``deny_verdict``: ``drop``, or with ``EGRESSD_DENY_REJECT`` a TCP reset / ICMP
  admin-prohibited (ICMP also for TCP the MITM redirect intercepted). One place decides how a refusal looks, so the knob never touches a
  subject's rules, and a lookup miss in the counter map (which only stops that rule) falls
  through to a rule that still refuses.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from egressd.addr import IPAddress
from egressd.kernel.listeners import OWNER_MARK
from egressd.kernel.ops import (
    ALLOW_MARK,
    AddChain,
    AddCounter,
    AddCounterRef,
    AddElements,
    AddIntervals,
    AddJump,
    AddPort,
    AddRule,
    AddSet,
    AddTimed,
    AddUid,
    AddUidCounterRef,
    AddUidJump,
    AddUidPort,
    AuditRule,
    DeleteChain,
    DeleteCounter,
    DeleteElement,
    DeleteSet,
    DeleteUid,
    FlushChain,
    FlushSet,
    MatchRule,
    NetlinkBatch,
    Op,
    RuleAction,
    VerdictRule,
)
from egressd.policy import (
    IpSets,
    NetworkPolicy,
    Verdict,
    audit_deny_sets,
    format_element,
    ip_sets,
    normalise_networks,
)
from egressd.policy.ipsets import PrefixIndex
from egressd.subject.hostuid import DEFAULT_UID_PORTS, UidPorts

CORE_SETS = ("allow_v4", "allow_v6", "deny_v4", "deny_v6")
# wdeny: the user's deny prefixes while auditing; audit: 0.0.0.0/0, ::/0 while auditing.
# Declared (with the audit rules that read them) by :func:`audit_objects` on the subject's
# first audit policy and kept until its removal: the kernel finds a set by name by walking the
# table's list of sets, so every set fewer per subject makes every set-name lookup of every
# transaction cheaper (scripts/bench/README.md, fleet: 10 -> 6 sets per subject).
AUDIT_SETS = ("wdeny_v4", "wdeny_v6", "audit_v4", "audit_v6")
STATIC_SETS = (*CORE_SETS, *AUDIT_SETS)
DYN_SETS = ("dyn_v4", "dyn_v6")
SETS = (*STATIC_SETS, *DYN_SETS)
AUDIT_COUNTERS = ("deny", "default")  # which audit rule counted: a user deny prefix, or no allow
AUDIT_LOG_PREFIX = "egressd would-deny "
DYN_TIMEOUT_S = 360
#: Regular chain the input hook sends sandbox-sourced packets to (docs/behaviour.md §14.2).
SANDBOX_IN_CHAIN = "sandbox_in"
#: The attachments' hostVeths (``type ifname``): packets arriving there are a sandbox's (§20.2).
SANDBOX_IFACES_SET = "sandbox_ifaces"
#: Regular chain the input hook sends everything addressed to egressd's ports to (§20.1).
OWNED_IN_CHAIN = "owned_in"
ND_TYPES = "nd-router-solicit, nd-neighbor-solicit, nd-neighbor-advert"
#: Every refusal goes here (docs/behaviour.md §15): counted per source, then DENY_VERDICT_CHAIN.
DENIED_CHAIN = "denied"
#: How a refusal looks: drop, or (EGRESSD_DENY_REJECT) TCP reset / ICMP admin-prohibited.
DENY_VERDICT_CHAIN = "deny_verdict"
#: Refusals of sources that are no subject (unknown sources, a privateCidr address nobody
#: registered, the pod's own connections to the MITM port).
UNATTRIBUTED_COUNTER = "unattributed_dropped"
DROPPED_SUFFIX = "_dropped"
REFUSE = f"goto {DENIED_CHAIN}"

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class TableConfig:
    """Fleet-wide knobs that shape the ruleset."""

    table: str = "opensandbox-fleet"
    dns_port: int = 15353
    mitm: bool = False
    mitm_port: int = 18081
    block_doh_443: bool = False
    doh_blocklist: tuple[IPNetwork, ...] = ()
    # Size of each dyn set: the per-subject lease cap (docs/behaviour.md §14.4); 0 = unbounded.
    max_leases: int = 4096
    # Host-uid subjects (docs/behaviour.md §17): the uid range the output hook polices and their port
    # block; egressd's own uid (exempt if inside the range) and HTTP port (never reachable
    # from a sandbox uid, like every other listener of egressd's).
    uids: UidPorts = DEFAULT_UID_PORTS
    own_uid: int | None = None
    http_port: int = 18080
    # EGRESSD_DENY_REJECT (docs/behaviour.md §15): refuse with a TCP reset / ICMP admin-prohibited.
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
    # EGRESSD_SANDBOX_IFACES (docs/behaviour.md §20.2): interface names, or ``prefix*``, whose
    # packets come from sandboxes (bridges, veth name prefixes), beside the attachments'
    # hostVeths (set ``sandbox_ifaces``).
    sandbox_ifaces: tuple[str, ...] = ()


def worker_ports(cfg: TableConfig) -> str:
    """Every MITM worker's listening port, as an nft port or range."""
    return _ports(cfg.mitm_port, cfg.mitm_port + cfg.mitm_workers - 1)


def mitm_ports(cfg: TableConfig) -> str:
    """The intercepted TCP destination ports as an nft set literal."""
    return "{ " + ", ".join(str(p) for p in (80, 443, *cfg.mitm_extra_ports)) + " }"


def _exempt_literal(cfg: TableConfig, fam: str) -> str | None:
    """The exempt nameservers of one family as an anonymous nft set, or None."""
    version = 4 if fam == "v4" else 6
    ips = [str(ip) for ip in cfg.nameserver_exempt if ip.version == version]
    return "{ " + ", ".join(ips) + " }" if ips else None


@dataclass(frozen=True, slots=True)
class SubjectNft:
    """What the ruleset needs to know about one subject."""

    nft_id: str
    ip: IPAddress
    gateway: IPAddress
    worker: int = 0  # the MITM worker its intercepted connections go to (fleetnft.workers)


def family(ip: IPAddress | IPNetwork) -> str:
    return "v4" if ip.version == 4 else "v6"


def _addr_type(fam: str) -> str:
    return "ipv4_addr" if fam == "v4" else "ipv6_addr"


@dataclass(frozen=True, slots=True)
class Names:
    """nft object names of one subject (docs/protocol.md, "Kernel objects")."""

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
        """Every packet of the subject that egressd's rules refuse (docs/behaviour.md §15)."""
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


def audit_counter_subject(name: str) -> tuple[str, str] | None:
    """``subj_<id>_audit_<kind>`` -> (nft id, kind), else None."""
    for kind in AUDIT_COUNTERS:
        suffix = f"_audit_{kind}"
        if name.startswith("subj_") and name.endswith(suffix):
            return name[len("subj_") : -len(suffix)], kind
    return None


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


def _set_decl(name: str, fam: str, flags: str, elements: Sequence[str] = (), extra: str = "") -> str:
    body = f"type {_addr_type(fam)}; flags {flags};{extra}"
    if elements:
        body += f" elements = {{ {', '.join(elements)} }}"
    return f"{name} {{ {body} }}"


def _plain_set_decl(name: str, fam: str, elements: Sequence[str] = ()) -> str:
    body = f"type {_addr_type(fam)};"
    if elements:
        body += f" elements = {{ {', '.join(elements)} }}"
    return f"{name} {{ {body} }}"


def _vmap_decl(name: str, fam: str, elements: Sequence[str] = ()) -> str:
    body = f"type {_addr_type(fam)} : verdict;"
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


def _port_map_decl(name: str, fam: str, elements: Sequence[str] = ()) -> str:
    body = f"type {_addr_type(fam)} : inet_service;"
    if elements:
        body += f" elements = {{ {', '.join(elements)} }}"
    return f"{name} {{ {body} }}"


def subject_worker_port(cfg: TableConfig, subj: SubjectNft) -> int:
    """The worker port of ``subj``; a worker the table has no port for is refused (ValueError)."""
    if not 0 <= subj.worker < cfg.mitm_workers:
        raise ValueError(f"MITM worker {subj.worker} does not exist ({cfg.mitm_workers} workers)")
    return cfg.mitm_port + subj.worker


def sandbox_set(fam: str) -> str:
    """Every registered sandbox address: never a forwarding destination (no lateral movement)."""
    return f"sandboxes_{fam}"


def sandbox_nets_set(fam: str) -> str:
    """Union of every registered attachment's ``privateCidr``: an address there is a sandbox
    (docs/behaviour.md §14.2) even when no subject registered it (a second address a sandbox gave
    itself, a sandbox whose binding has not arrived yet)."""
    return f"sandbox_nets_{fam}"


def sandbox_nets_refresh(nets: Iterable[IPNetwork]) -> list[Op]:
    """Empty and refill ``sandbox_nets_v4/v6`` with the union of ``nets`` (merged: an interval
    set refuses overlapping elements), for the caller's transaction."""
    ops: list[Op] = []
    for fam, version in (("v4", 4), ("v6", 6)):
        mine = [n for n in nets if n.version == version]
        merged = tuple(ipaddress.collapse_addresses(mine))  # type: ignore[type-var]
        ops.append(FlushSet(sandbox_nets_set(fam)))
        if merged:
            ops.append(AddIntervals(sandbox_nets_set(fam), fam, merged))
    return ops


def drop_counter_map(fam: str) -> str:
    """Source address -> its subject's drop counter (``type ipv4_addr : counter``)."""
    return f"drop_counter_{fam}"


def _counter_map_decl(name: str, fam: str) -> str:
    return f"{name} {{ type {_addr_type(fam)} : counter; }}"


def gateway_set(fam: str) -> str:
    return f"dns_gw_{fam}"


def doh_set(fam: str) -> str:
    return f"doh_block_{fam}"


def _split_doh(nets: Iterable[IPNetwork]) -> dict[str, list[str]]:
    """Normalised per family: overlapping entries would make nft refuse the header."""
    v4 = [n for n in nets if isinstance(n, ipaddress.IPv4Network)]
    v6 = [n for n in nets if isinstance(n, ipaddress.IPv6Network)]
    return {
        "v4": [format_element(n) for n in normalise_networks(v4)],
        "v6": [format_element(n) for n in normalise_networks(v6)],
    }


def header_script(cfg: TableConfig, *, delete_existing: bool) -> str:
    """The §8.1 header: an empty, deny-by-default table (``Reset = header only``).

    With ``delete_existing`` the script starts with ``delete table``; the applier retries
    without it when the table does not exist yet.
    """
    s = _Script(cfg.table)
    if delete_existing:
        s.add(f"delete table inet {cfg.table}")
    s.add(f"add table inet {cfg.table}")
    doh = _split_doh(cfg.doh_blocklist)
    _header_objects(s, cfg, doh)
    _marking_chain(s, cfg)
    _filter_chains(s, cfg, doh)
    _nat_chain(s, cfg)
    _uid_header(s, cfg)
    return s.text()


def _header_objects(s: _Script, cfg: TableConfig, doh: dict[str, list[str]]) -> None:
    """The table-wide maps and sets, empty but for the DoH blocklist."""
    for fam in ("v4", "v6"):
        s.obj("add", "map", _vmap_decl(marking_map(fam), fam))
        s.obj("add", "map", _vmap_decl(dispatch_map(fam), fam))
        s.obj("add", "set", _plain_set_decl(sandbox_set(fam), fam))
        s.obj("add", "set", _set_decl(sandbox_nets_set(fam), fam, "interval"))
        s.obj("add", "set", _plain_set_decl(gateway_set(fam), fam))
        if cfg.mitm:
            s.obj("add", "map", _vmap_decl(mitm_in_map(fam), fam))
            s.obj("add", "set", _plain_set_decl(mitm_src_set(fam), fam))
            s.obj("add", "map", _port_map_decl(mitm_port_map(fam), fam))
        s.obj("add", "map", _counter_map_decl(drop_counter_map(fam), fam))
    if cfg.block_doh_443 and cfg.doh_blocklist:
        for fam in ("v4", "v6"):
            s.obj("add", "set", _set_decl(doh_set(fam), fam, "interval", doh[fam]))
    s.obj("add", "set", f"{SANDBOX_IFACES_SET} {{ type ifname; }}")
    _denial_chains(s, cfg)


def _marking_chain(s: _Script, cfg: TableConfig) -> None:
    # Prerouting: clear our bit first, so only this table's rules can grant it.
    s.obj("add", "chain", "marking { type filter hook prerouting priority 0; policy accept; }")
    _sandbox_source_guard(s, cfg)
    s.rule("marking", f"meta mark set meta mark & {~ALLOW_MARK & 0xFFFFFFFF:#010x}")
    for fam in ("v4", "v6"):
        exempt = _exempt_literal(cfg, fam)
        if exempt is not None:
            # Direct DNS of a registered sandbox to an exempt nameserver passes the
            # unmarked-drop tail; the forward hook's lateral drops and the subject's deny
            # sets are still judged before it (the DNS proxy is simply not involved).
            s.rule(
                "marking",
                f"{l3_of(fam)} saddr @{sandbox_set(fam)} {l3_of(fam)} daddr {exempt} "
                f"meta l4proto {{ tcp, udp }} th dport 53 meta mark set meta mark | {ALLOW_MARK:#x}",
            )
    s.rule("marking", f"ip saddr vmap @{marking_map('v4')}")
    s.rule("marking", f"ip6 saddr vmap @{marking_map('v6')}")


def _sandbox_source_guard(s: _Script, cfg: TableConfig) -> None:
    """A packet from a sandbox-facing interface carries a source address routed back through
    that interface (strict reverse path), else it is dropped before anything reads its source.

    Identity is the source address (dispatch, DNS, the MITM), and IPv6 lets an unprivileged
    process send with any address (``IPV6_FREEBIND`` needs no capability). Without this, a
    sandbox claiming an upstream's address injects into a sibling's established flows (the
    forward hook accepts established first), and one claiming a sibling's address sends with
    the sibling's policy and has egressd answer the sibling. One veth per sandbox (routed):
    only its own addresses pass. A bridge (``EGRESSD_SANDBOX_IFACES``): only addresses routed
    to the bridge; telling two ports of one bridge apart is the runtime's (docs/security.md).
    Refusals are counted as unattributed: the source names nobody it can be trusted to.
    """
    drop = f'fib saddr . iif oif missing counter name "{UNATTRIBUTED_COUNTER}" drop'
    s.rule("marking", f"iifname @{SANDBOX_IFACES_SET} {drop}")
    for name in cfg.sandbox_ifaces:
        s.rule("marking", f'iifname "{name}" {drop}')


def _filter_chains(s: _Script, cfg: TableConfig, doh: dict[str, list[str]]) -> None:
    """The forward hook (``dispatch``) and the input hook, in the order their rules apply."""
    s.obj("add", "chain", "dispatch { type filter hook forward priority 0; policy accept; }")
    s.rule("dispatch", "ct state established,related accept")
    s.rule("dispatch", f"tcp dport 853 {REFUSE}")
    s.rule("dispatch", f"udp dport 853 {REFUSE}")
    # Input exists with or without the MITM: a sandbox can address the pod itself (the
    # gateway, any other pod address) and that never crosses the forward hook (§14.2).
    s.obj("add", "chain", "input { type filter hook input priority 0; policy accept; }")
    s.obj("add", "chain", SANDBOX_IN_CHAIN)
    _owned_ports_input(s, cfg)
    # Replies to the pod's own flows (upstream DNS, the MITM's upstream leg) and the later
    # packets of the flows sandbox_in accepted.
    s.rule("input", "ct state established,related accept")
    if cfg.block_doh_443:
        _doh_drops(s, cfg, doh)
    # Sandboxes never reach each other, whatever their egress policy says (defaultAction
    # allow or a CIDR covering the sandbox subnet would otherwise open lateral movement).
    s.rule("dispatch", f"ip daddr @{sandbox_set('v4')} {REFUSE}")
    s.rule("dispatch", f"ip6 daddr @{sandbox_set('v6')} {REFUSE}")
    s.rule("dispatch", f"ip daddr @{sandbox_nets_set('v4')} {REFUSE}")
    s.rule("dispatch", f"ip6 daddr @{sandbox_nets_set('v6')} {REFUSE}")
    s.rule("dispatch", f"ip saddr vmap @{dispatch_map('v4')}")
    s.rule("dispatch", f"ip6 saddr vmap @{dispatch_map('v6')}")
    s.rule("dispatch", f"meta mark & {ALLOW_MARK:#x} != {ALLOW_MARK:#x} {REFUSE}")
    _sandbox_input(s, cfg)


def _doh_drops(s: _Script, cfg: TableConfig, doh: dict[str, list[str]]) -> None:
    """TCP 443 to the DoH blocklist (to anything without a list), forwarded or intercepted."""
    if not cfg.doh_blocklist:
        s.rule("dispatch", f"tcp dport 443 {REFUSE}")
        if cfg.mitm:
            # nft 1.0.6 cannot type "ct original proto-dst 443" without a protocol
            # context ("Can't parse symbolic invalid expressions"): give it tcp.
            s.rule("input", f"meta l4proto tcp ct status dnat ct original proto-dst 443 {REFUSE}")
        return
    for fam in ("v4", "v6"):
        if not doh[fam]:
            continue
        s.rule("dispatch", f"{l3_of(fam)} daddr @{doh_set(fam)} tcp dport 443 {REFUSE}")
        if cfg.mitm:
            s.rule(
                "input",
                f"meta l4proto tcp ct status dnat ct original {l3_of(fam)} daddr @{doh_set(fam)} "
                f"ct original proto-dst 443 {REFUSE}",
            )


def _nat_chain(s: _Script, cfg: TableConfig) -> None:
    """The DNS redirect per gateway and, with the MITM, the 80/443 interception."""
    s.obj("add", "chain", "nat { type nat hook prerouting priority dstnat; policy accept; }")
    for fam in ("v4", "v6"):
        for proto in ("udp", "tcp"):
            s.rule(
                "nat", f"{l3_of(fam)} daddr @{gateway_set(fam)} {proto} dport 53 redirect to :{cfg.dns_port}"
            )
    if not cfg.mitm:
        return
    # REDIRECT (to the address of the interface the packet came in on: the sandbox's
    # gateway) instead of a per-source DNAT target: the source set carries no data, so
    # a gateway change can never collide with an existing element.
    # Never intercept what is not upstream (§14.2): the MITM would connect to the pod
    # itself (any local address, loopback included) or to a sibling sandbox on the
    # sandbox's behalf. Left alone, such packets meet sandbox_in's drop or the forward
    # drop of sandbox destinations.
    ports = mitm_ports(cfg)
    s.rule("nat", f"fib daddr type local tcp dport {ports} return")
    for fam in ("v4", "v6"):
        s.rule("nat", f"{l3_of(fam)} daddr @{gateway_set(fam)} tcp dport {ports} return")
        s.rule("nat", f"{l3_of(fam)} daddr @{sandbox_set(fam)} tcp dport {ports} return")
        s.rule("nat", f"{l3_of(fam)} daddr @{sandbox_nets_set(fam)} tcp dport {ports} return")
        src = f"{l3_of(fam)} saddr @{mitm_src_set(fam)} tcp dport {ports}"
        s.rule("nat", f"{src} redirect to :{l3_of(fam)} saddr map @{mitm_port_map(fam)}")
        # A map miss only ends the rule above: an intercepted source without a worker port
        # must not fall through to the forward path (and upstream unintercepted).
        s.rule("nat", f"{src} drop")


def l3_of(fam: str) -> str:
    return "ip" if fam == "v4" else "ip6"


def _denial_chains(s: _Script, cfg: TableConfig) -> None:
    """``denied`` and ``deny_verdict`` (docs/behaviour.md §15), declared before any rule jumps there.

    An objref map lookup that misses (a source that is no subject, or the other family)
    only ends its own rule, so each counted rule carries the verdict and the last one
    refuses whatever arrives: there is no way through ``denied`` that accepts.
    """
    s.obj("add", "counter", UNATTRIBUTED_COUNTER)
    s.obj("add", "chain", DENY_VERDICT_CHAIN)
    if cfg.deny_reject:
        # A connection the MITM redirect took (REDIRECT = DNAT to the pod): over a bridge the
        # kernel sends a reset straight out of the bridge port with the redirected address,
        # which the client does not know and ignores; the ICMP error goes through the stack
        # and is translated back, so it fails the connect at once (EHOSTUNREACH).
        s.rule(DENY_VERDICT_CHAIN, "ct status dnat reject with icmpx admin-prohibited")
        s.rule(DENY_VERDICT_CHAIN, "meta l4proto tcp reject with tcp reset")
        s.rule(DENY_VERDICT_CHAIN, "reject with icmpx admin-prohibited")
    s.rule(DENY_VERDICT_CHAIN, "drop")  # the only verdict without the knob; unreachable with it
    s.obj("add", "chain", DENIED_CHAIN)
    for fam in ("v4", "v6"):
        s.rule(
            DENIED_CHAIN,
            f"counter name {l3_of(fam)} saddr map @{drop_counter_map(fam)} goto {DENY_VERDICT_CHAIN}",
        )
    s.rule(DENIED_CHAIN, f'counter name "{UNATTRIBUTED_COUNTER}" goto {DENY_VERDICT_CHAIN}')


def _owned_ports_input(s: _Script, cfg: TableConfig) -> None:
    """docs/behaviour.md §20.1 on the receiving side: what is addressed to one of egressd's
    listener ports reaches only a socket of egressd's (:data:`OWNER_MARK`).

    Before the established-flows accept, so no packet of any state skips it: a squatter that
    bound a port egressd was not using at that instant (a worker restarting, egressd down, a
    port of the per-subject blocks) would otherwise get a SYN-cookie handshake's first flight,
    a child socket's data before ``accept()``, or datagrams of a flow conntrack already knows.
    ``socket mark`` reads a *full* socket only (a listener, an accepted or not-yet-accepted
    child, a UDP socket); a request or TIME_WAIT socket, or no socket at all, does not match, so
    egressd's own handshakes complete (their final ACK meets a request socket) and a port
    nobody listens on still answers with a reset. Data always lands on a full socket, which
    must be egressd's. Replies to connections egressd (or anyone) opened from such a port are
    the other direction of a flow and are left alone.
    """
    s.obj("add", "chain", OWNED_IN_CHAIN)
    s.rule(OWNED_IN_CHAIN, "ct direction reply return")
    s.rule(OWNED_IN_CHAIN, f"socket mark != {OWNER_MARK:#010x} {REFUSE}")
    own_udp, own_tcp = _own_listener_ports(cfg)
    s.rule("input", f"udp dport {own_udp} jump {OWNED_IN_CHAIN}")
    s.rule("input", f"tcp dport {own_tcp} jump {OWNED_IN_CHAIN}")


def _sandbox_ifaces_input(s: _Script, cfg: TableConfig) -> None:
    """docs/behaviour.md §20.2: a packet that arrives on a sandbox-facing interface is a sandbox's,
    whatever its source address (a link-local one, another family than the registered one, one
    it gave itself, a sandbox not registered yet or any more): it meets ``sandbox_in``."""
    s.rule("input", f"iifname @{SANDBOX_IFACES_SET} jump {SANDBOX_IN_CHAIN}")
    for name in cfg.sandbox_ifaces:
        # nft reads a trailing "*" of a quoted interface name as a prefix match.
        s.rule("input", f'iifname "{name}" jump {SANDBOX_IN_CHAIN}')


def _sandbox_input(s: _Script, cfg: TableConfig) -> None:
    """§14.2 on the input hook: what a sandbox source may reach on the pod itself.

    Only what egressd redirected: ``<gateway>:53`` (REDIRECTed to the DNS port) and, with the
    MITM, 80/443 (REDIRECTed to the MITM port, then judged by the subject's policy on the
    conntrack original destination). Everything else a sandbox sends to a pod address (a
    direct DNS or MITM port, the actions API, a helper on the gateway address, ICMP) is
    dropped. Sandbox sources are the registered subject addresses (``sandboxes_v4/v6``, the
    set the forward drop uses); the pod's own traffic and upstream peers never match them,
    so nothing else that reaches the input hook changes. The sandbox-facing interfaces come
    first (:func:`_sandbox_ifaces_input`); the addresses stay as a second layer.
    """
    _sandbox_ifaces_input(s, cfg)
    for fam in ("v4", "v6"):
        s.rule("input", f"{l3_of(fam)} saddr @{sandbox_set(fam)} jump {SANDBOX_IN_CHAIN}")
        # Any address of an attachment's privateCidr is a sandbox too, except the pod's own
        # (the gateway is inside the CIDR: the pod talking to itself arrives on lo).
        s.rule(
            "input", f'iifname != "lo" {l3_of(fam)} saddr @{sandbox_nets_set(fam)} jump {SANDBOX_IN_CHAIN}'
        )
    if cfg.mitm:
        # Mandatory: a direct connection to the MITM port makes it proxy to itself in a
        # loop (from any source, the pod's own loopback included).
        s.rule("input", f"tcp dport {worker_ports(cfg)} {REFUSE}")

    c = SANDBOX_IN_CHAIN
    for proto in ("udp", "tcp"):
        s.rule(c, f"{proto} dport {cfg.dns_port} ct status dnat ct original proto-dst 53 accept")
    # IPv6 needs neighbour discovery with the gateway (IPv4's ARP never enters an inet
    # chain). Hop limit 255: link-local, it cannot have been routed here.
    s.rule(c, f"icmpv6 type {{ {ND_TYPES} }} ip6 hoplimit 255 accept")
    if cfg.mitm:
        port = worker_ports(cfg)
        for fam in ("v4", "v6"):
            # Belt and braces for the nat exemption: an intercepted flow whose original
            # destination is a sandbox is lateral movement through the MITM.
            s.rule(c, f"ct status dnat ct original {l3_of(fam)} daddr @{sandbox_set(fam)} {REFUSE}")
            s.rule(c, f"ct status dnat ct original {l3_of(fam)} daddr @{sandbox_nets_set(fam)} {REFUSE}")
        s.rule(c, f"tcp dport {port} ct status dnat ip saddr vmap @{mitm_in_map('v4')}")
        s.rule(c, f"tcp dport {port} ct status dnat ip6 saddr vmap @{mitm_in_map('v6')}")
    s.rule(c, REFUSE)


def subject_sets(*, audit: bool) -> tuple[str, ...]:
    """The kinds of set a subject has: the audit sets only once :func:`audit_objects` made them."""
    return (*CORE_SETS, *(AUDIT_SETS if audit else ()), *DYN_SETS)


def subject_rules(cfg: TableConfig, nft_id: str, *, audit: bool = False) -> NetlinkBatch:
    """The subject's fixed rules, added once when its chains are first created (the audit
    rules with its audit objects, :func:`audit_objects`).

    ``subj_<id>``: deny sets drop. ``mark_<id>``: allow and dyn sets mark 0x2, then (``audit``)
    the audit rules, which match nothing while ``wdeny`` and ``audit`` are empty.
    ``subj_<id>_in`` (MITM): IN(drop) of §8.2 on the conntrack original destination; the
    intercepted path is never audited, so ``wdeny`` drops there like ``deny``.
    """
    n = Names(nft_id)
    ops: list[Op] = []
    for fam in ("v4", "v6"):
        ops.append(
            AddRule(n.chain, MatchRule(fam, n.set(f"deny_{fam}"), RuleAction.DROP, drop_chain=DENIED_CHAIN))
        )
    ops += _mark_rules(n, audit=audit)
    if cfg.mitm:
        ops += _in_rules(n, audit=audit)
    return NetlinkBatch(cfg.table, tuple(ops))


def _mark_rules(n: Names, *, audit: bool) -> list[Op]:
    ops: list[Op] = []
    for kind in ("allow", "dyn"):
        for fam in ("v4", "v6"):
            ops.append(AddRule(n.mark_chain, MatchRule(fam, n.set(f"{kind}_{fam}"), RuleAction.MARK)))
    if not audit:
        return ops
    # A user-denied prefix is logged even inside an allowed one (deny beats allow, as enforced).
    for fam in ("v4", "v6"):
        rule = AuditRule(fam, n.set(f"wdeny_{fam}"), n.set(f"deny_{fam}"), n.log_prefix, n.counter("deny"))
        ops.append(AddRule(n.mark_chain, rule))
    for fam in ("v4", "v6"):
        rule = AuditRule(
            fam,
            n.set(f"audit_{fam}"),
            n.set(f"deny_{fam}"),
            n.log_prefix,
            n.counter("default"),
            unmarked_only=True,
        )
        ops.append(AddRule(n.mark_chain, rule))
    return ops


def _in_rules(n: Names, *, audit: bool) -> list[Op]:
    in_rules = (
        ("deny", RuleAction.DROP),
        *((("wdeny", RuleAction.DROP),) if audit else ()),
        ("dyn", RuleAction.ACCEPT),
        ("allow", RuleAction.ACCEPT),
    )
    ops: list[Op] = []
    for kind, outcome in in_rules:
        via = DENIED_CHAIN if outcome is RuleAction.DROP else ""
        for fam in ("v4", "v6"):
            rule = MatchRule(fam, n.set(f"{kind}_{fam}"), outcome, ct_original=True, drop_chain=via)
            ops.append(AddRule(n.in_chain, rule))
    ops.append(AddRule(n.in_chain, VerdictRule(RuleAction.DROP, drop_chain=DENIED_CHAIN)))
    return ops


def audit_objects(cfg: TableConfig, nft_id: str) -> NetlinkBatch:
    """Audit mode's objects for a subject that has none yet, for the caller's transaction: the
    ``wdeny`` and ``audit`` sets (empty), and ``mark_<id>`` (and ``subj_<id>_in``) rebuilt with
    the rules that read them. The chains are emptied and refilled in the same atomic batch, so
    no packet ever meets a chain without its allow/deny rules; the sets are declared (a no-op
    when present) before any rule names them."""
    n = Names(nft_id)
    ops: list[Op] = [AddSet(n.set(kind), kind[-2:], "interval") for kind in AUDIT_SETS]
    ops.append(FlushChain(n.mark_chain))
    ops += _mark_rules(n, audit=True)
    if cfg.mitm:
        ops.append(FlushChain(n.in_chain))
        ops += _in_rules(n, audit=True)
    return NetlinkBatch(cfg.table, tuple(ops))


def rules_per_subject(cfg: TableConfig, *, audit: bool = False) -> int:
    """How many rules one installed subject adds to the table: its fixed rules (with the audit
    rules once it has them), counted from :func:`subject_rules` itself so the metric can never
    drift from what is installed."""
    return len(subject_rules(cfg, "0", audit=audit).ops)


def subject_keys(cfg: TableConfig, subj: SubjectNft) -> NetlinkBatch:
    """Point the subject's source IP (and gateway) at its chains (idempotent)."""
    n = Names(subj.nft_id)
    fam = family(subj.ip)
    ops: list[Op] = [
        # First: the counter exists before the dispatch jump can send a packet to a drop.
        AddCounterRef(drop_counter_map(fam), subj.ip, n.dropped_counter),
        AddJump(dispatch_map(fam), subj.ip, n.chain),
        AddElements(sandbox_set(fam), (subj.ip,)),
        AddJump(marking_map(fam), subj.ip, n.mark_chain),
        AddElements(gateway_set(family(subj.gateway)), (subj.gateway,)),
    ]
    if cfg.mitm:
        ops += [
            AddPort(mitm_port_map(fam), subj.ip, subject_worker_port(cfg, subj)),
            AddJump(mitm_in_map(fam), subj.ip, n.in_chain),
            AddElements(mitm_src_set(fam), (subj.ip,)),
        ]
    return NetlinkBatch(cfg.table, tuple(ops))


def subject_create(cfg: TableConfig, subj: SubjectNft) -> NetlinkBatch:
    """A new subject in ONE atomic batch: sets, chains, fixed rules, then its dispatch keys.

    All of it or nothing lands, so a subject never exists half made; nothing in it goes
    through libnftables (no cache fill), and the table is validated once.
    """
    if cfg.mitm and subj.gateway.version != subj.ip.version:
        raise ValueError("gateway and sandbox ip are of different address families")
    return subject_objects(cfg, subj.nft_id) + subject_rules(cfg, subj.nft_id) + subject_keys(cfg, subj)


def subject_chains(cfg: TableConfig, nft_id: str) -> list[str]:
    n = Names(nft_id)
    return [n.chain, n.mark_chain] + ([n.in_chain] if cfg.mitm else [])


def subject_objects(cfg: TableConfig, nft_id: str, *, audit: bool = False) -> NetlinkBatch:
    """Declare the subject's sets, chains and counters (each a no-op when it exists); the
    audit sets only with ``audit``."""
    n = Names(nft_id)
    kinds = CORE_SETS + (AUDIT_SETS if audit else ())
    ops: list[Op] = [AddSet(n.set(kind), kind[-2:], "interval") for kind in kinds]
    ops += [
        AddSet(n.set(f"dyn_{fam}"), fam, "timeout", DYN_TIMEOUT_S, size=cfg.max_leases)
        for fam in ("v4", "v6")
    ]
    ops += [AddChain(c) for c in subject_chains(cfg, nft_id)]
    ops += [AddCounter(n.counter(kind)) for kind in AUDIT_COUNTERS]
    ops.append(AddCounter(n.dropped_counter))
    return NetlinkBatch(cfg.table, tuple(ops))


def subject_resync(
    cfg: TableConfig, nft_id: str, keys: Iterable[SubjectNft], contents: NetlinkBatch, *, audit: bool
) -> NetlinkBatch:
    """Make the kernel hold exactly one state of a subject whichever of two states it holds
    now (after a transaction whose answer never came): every object declared (no-op when
    present), its chains emptied and given their fixed rules once, ``contents`` (flushes and
    refills of all its sets), and every one of ``keys``. Each part succeeds on both states,
    so the caller's own operations can follow in the same transaction. ``audit``: either state
    may have the audit objects; both then end with them."""
    ops: list[Op] = [FlushChain(c) for c in subject_chains(cfg, nft_id)]
    out = subject_objects(cfg, nft_id, audit=audit) + NetlinkBatch(cfg.table, tuple(ops))
    out = out + subject_rules(cfg, nft_id, audit=audit)
    out = out + contents
    for subj in keys:
        out = out + subject_keys(cfg, subj)
    return out


def subject_objects_script(cfg: TableConfig, subj: SubjectNft) -> str:
    """Declare the subject's sets and chains (no-op when they exist) and point its keys at them.

    Contains no rules and no flushes, so libnftables runs it without a cache fill. Callers
    empty the sets first when the subject already had content (revert, rebind).
    """
    if cfg.mitm and subj.gateway.version != subj.ip.version:
        raise ValueError("gateway and sandbox ip are of different address families")
    s = _Script(cfg.table)
    n = Names(subj.nft_id)
    for kind in CORE_SETS:
        s.obj("add", "set", _set_decl(n.set(kind), kind[-2:], "interval"))
    for fam in ("v4", "v6"):
        s.obj(
            "add",
            "set",
            _set_decl(
                n.set(f"dyn_{fam}"),
                fam,
                "timeout",
                extra=f" timeout {DYN_TIMEOUT_S}s;" + (f" size {cfg.max_leases};" if cfg.max_leases else ""),
            ),
        )
    s.obj("add", "chain", n.chain)
    s.obj("add", "chain", n.mark_chain)
    if cfg.mitm:
        s.obj("add", "chain", n.in_chain)
    for kind in AUDIT_COUNTERS:
        s.obj("add", "counter", n.counter(kind))
    _dispatch_entries(s, cfg, subj)
    return s.text()


def flush_subject_sets(table: str, nft_id: str, *, audit: bool) -> NetlinkBatch:
    """Deny-first content: every set of the subject empty (leases included, so a rebind never
    keeps them); ``audit``: it has the audit sets, which must be emptied too (``audit`` holds
    0.0.0.0/0 while auditing)."""
    n = Names(nft_id)
    return NetlinkBatch(table, tuple(FlushSet(n.set(kind)) for kind in subject_sets(audit=audit)))


def dispatch_entries(cfg: TableConfig, subj: SubjectNft) -> str:
    """Re-declarations that point the subject's source IP (and gateway) at its chains."""
    s = _Script(cfg.table)
    _dispatch_entries(s, cfg, subj)
    return s.text()


def _dispatch_entries(s: _Script, cfg: TableConfig, subj: SubjectNft) -> None:
    n = Names(subj.nft_id)
    fam = family(subj.ip)
    ip = str(subj.ip)
    s.obj("add", "map", _vmap_decl(dispatch_map(fam), fam, [f"{ip} : jump {n.chain}"]))
    s.obj("add", "set", _plain_set_decl(sandbox_set(fam), fam, [ip]))
    s.obj("add", "map", _vmap_decl(marking_map(fam), fam, [f"{ip} : jump {n.mark_chain}"]))
    gfam = family(subj.gateway)
    s.obj("add", "set", _plain_set_decl(gateway_set(gfam), gfam, [str(subj.gateway)]))
    if cfg.mitm:
        port = subject_worker_port(cfg, subj)
        s.obj("add", "map", _port_map_decl(mitm_port_map(fam), fam, [f"{ip} : {port}"]))
        s.obj("add", "map", _vmap_decl(mitm_in_map(fam), fam, [f"{ip} : jump {n.in_chain}"]))
        s.obj("add", "set", _plain_set_decl(mitm_src_set(fam), fam, [ip]))


_ALL_V4 = ipaddress.IPv4Network("0.0.0.0/0")
_ALL_V6 = ipaddress.IPv6Network("::/0")


def policy_contents(effective: NetworkPolicy) -> dict[str, tuple[IPNetwork, ...]]:
    """Contents of the static sets for an effective policy (§5 IP layer), audit mode included."""
    sets: IpSets = ip_sets(effective)
    allow_v4: tuple[IPNetwork, ...] = sets.allow_v4
    allow_v6: tuple[IPNetwork, ...] = sets.allow_v6
    if effective.default_action is Verdict.ALLOW:
        # Everything is allowed unless denied: the whole address space, one prefix per family.
        allow_v4, allow_v6 = (_ALL_V4,), (_ALL_V6,)
    out: dict[str, tuple[IPNetwork, ...]] = {"allow_v4": allow_v4, "allow_v6": allow_v6}
    if not effective.audit:
        return out | {"deny_v4": sets.deny_v4, "deny_v6": sets.deny_v6} | dict.fromkeys(STATIC_SETS[4:], ())
    split = audit_deny_sets(effective)
    return out | {
        "deny_v4": split.hard_v4,
        "deny_v6": split.hard_v6,
        "wdeny_v4": split.soft_v4,
        "wdeny_v6": split.soft_v6,
        "audit_v4": (_ALL_V4,),
        "audit_v6": (_ALL_V6,),
    }


#: What a subject's static sets hold: (set kind, its prefixes) in :data:`STATIC_SETS` order.
Contents = tuple[tuple[str, tuple[IPNetwork, ...]], ...]


def static_contents(effective: NetworkPolicy) -> Contents:
    """:func:`policy_contents` in the form a kernel view records (docs/architecture.md, KernelView)."""
    return tuple(policy_contents(effective).items())


def policy_swap(
    table: str,
    nft_id: str,
    effective: NetworkPolicy,
    *,
    audit_objects: bool,
    known_empty: bool = False,
    held: Contents | None = None,
) -> NetlinkBatch:
    """§8.3 as one atomic batch: each static set flushed and refilled; dyn sets untouched.

    ``audit_objects``: the subject has the audit sets (an audit policy needs them: raises
    ValueError without). ``known_empty``: every static set is empty (deny-first content, the
    registry's ``applied`` None), so the flushes are left out: each is one more set-name
    lookup, a walk of the table's list of sets in the kernel. ``held``: what the static sets
    hold now, known for certain (the kernel view's ``contents``); a set whose content does not
    change is then left alone, neither flushed nor refilled."""
    if effective.audit and not audit_objects:
        raise ValueError("an audit policy needs the subject's audit objects")
    return contents_swap(
        table,
        nft_id,
        static_contents(effective),
        audit_objects=audit_objects,
        known_empty=known_empty,
        held=held,
    )


def contents_swap(
    table: str,
    nft_id: str,
    contents: Contents,
    *,
    audit_objects: bool,
    known_empty: bool = False,
    held: Contents | None = None,
) -> NetlinkBatch:
    """:func:`policy_swap` of :func:`static_contents` already computed."""
    n = Names(nft_id)
    before = dict(held) if held is not None else {}
    ops: list[Op] = []
    for kind, nets in contents:
        if kind in AUDIT_SETS and not audit_objects:
            if nets:
                raise ValueError("an audit policy needs the subject's audit objects")
            continue  # empty for a policy that does not audit, and absent
        if before.get(kind) == nets:
            continue  # held and unchanged
        if not known_empty:
            ops.append(FlushSet(n.set(kind)))
        if nets:
            ops.append(AddIntervals(n.set(kind), kind[-2:], nets))
    return NetlinkBatch(table, tuple(ops))


def refuses_more(held: Contents, new: Contents) -> bool:
    """Would the kernel refuse, with ``new`` in the static sets, a destination it accepts with
    ``held`` (DNS leases aside)? A destination is accepted when no deny prefix holds it and an
    allow, wdeny or audit prefix does (or a lease: the lease book answers for those). So
    ``new`` refuses nothing more when its deny sets lie within the held ones and its marking
    sets cover the held ones. Conservative: True whenever that cannot be shown prefix by
    prefix (e.g. a held /24 covered only by two new /25s)."""
    old, now = dict(held), dict(new)
    marks = ("allow", "wdeny", "audit")
    for fam in ("v4", "v6"):
        if not _within(now.get(f"deny_{fam}", ()), old.get(f"deny_{fam}", ())):
            return True
        marked = [net for kind in marks for net in now.get(f"{kind}_{fam}", ())]
        if not _within([net for kind in marks for net in old.get(f"{kind}_{fam}", ())], marked):
            return True
    return False


def _within(nets: Sequence[IPNetwork], cover: Sequence[IPNetwork]) -> bool:
    """Every prefix of ``nets`` inside one prefix of ``cover``."""
    if not nets:
        return True
    index = PrefixIndex(cover)
    for net in nets:
        hit = index.hit(net.network_address)
        if hit is None or int(net.broadcast_address) > int(hit.broadcast_address):
            return False
    return True


def gateway_release(gateway: IPAddress) -> DeleteElement:
    return DeleteElement(gateway_set(family(gateway)), gateway)


def dispatch_deletes(cfg: TableConfig, ip: IPAddress, *, release_gateway: IPAddress | None) -> list[Op]:
    """Remove a source IP from every dispatch map (and, when unused, its gateway)."""
    fam = family(ip)
    maps = [marking_map(fam), dispatch_map(fam), sandbox_set(fam)]
    if cfg.mitm:
        # The source leaves mitm_src before its port: never intercepted without a worker port
        # (and within one transaction either order is atomic anyway).
        maps += [mitm_src_set(fam), mitm_in_map(fam), mitm_port_map(fam)]
    maps.append(drop_counter_map(fam))  # last: the counter outlives every way a packet reaches a drop
    ops: list[Op] = [DeleteElement(m, ip) for m in maps]
    if release_gateway is not None:
        ops.append(gateway_release(release_gateway))
    return ops


def removal_batch(
    cfg: TableConfig,
    nft_id: str,
    ip: IPAddress | None,
    *,
    release_gateway: IPAddress | None,
    audit: bool,
) -> NetlinkBatch:
    """§8.5 without the rebuild: one atomic batch dropping exactly this subject's objects.

    Map entries go first (they reference the chains), then chains (their rules reference
    the sets and counters), then sets and counters. Other subjects' objects and leases are untouched.
    """
    n = Names(nft_id)
    ops: list[Op] = []
    if ip is not None:
        ops += dispatch_deletes(cfg, ip, release_gateway=release_gateway)
    ops += [DeleteChain(c) for c in subject_chains(cfg, nft_id)]
    ops += [DeleteSet(n.set(kind)) for kind in subject_sets(audit=audit)]
    ops += [DeleteCounter(n.counter(kind)) for kind in AUDIT_COUNTERS]
    ops.append(DeleteCounter(n.dropped_counter))
    return NetlinkBatch(cfg.table, tuple(ops))


def dyn_replace(table: str, nft_id: str, kept: Sequence[tuple[IPAddress, int]]) -> NetlinkBatch:
    """A narrowing change's dyn-set part (docs/behaviour.md §14.1): both dyn sets emptied and refilled
    with the leases that survive, in the caller's transaction. A flush, not per-element
    deletes: an element the kernel already expired would make a delete fail (ENOENT) and
    abort the whole swap."""
    n = Names(nft_id)
    flush = NetlinkBatch(table, tuple(FlushSet(n.set(f"dyn_{fam}")) for fam in ("v4", "v6")))
    return flush + dyn_add(table, nft_id, kept)


def dyn_add(
    table: str, nft_id: str, leases: Sequence[tuple[IPAddress, int]], *, replace: bool = False
) -> NetlinkBatch:
    """DNS learning (§7) and renewal (§9): addresses with per-element timeouts.

    ``replace`` False: one add, which also sets a new expiry on an existing element where the
    kernel supports that. True (the self-test found it does not, egressd.kernel.renewal):
    add (so each element exists), delete, add again, in the caller's one transaction."""
    n = Names(nft_id)
    ops: list[Op] = []
    for fam in ("v4", "v6"):
        mine = tuple((ip, sec) for ip, sec in leases if family(ip) == fam)
        if not mine:
            continue
        name = n.set(f"dyn_{fam}")
        ops.append(AddTimed(name, fam, mine))
        if replace:
            ops += [DeleteElement(name, ip) for ip, _ in mine]
            ops.append(AddTimed(name, fam, mine))
    return NetlinkBatch(table, tuple(ops))


# --------------------------------------------------------------------------- host-uid subjects
#
# docs/behaviour.md §17: sandboxes that share egressd's network namespace and differ only by host uid.
# Their packets are locally generated, so they meet the ``output`` hook, never prerouting or
# forward; the identity is the socket's owner (``meta skuid``). They use the same per-subject
# chains and sets as the forward path, reached through uid-keyed verdict maps:
#
# * ``uid_marking`` -> ``mark_<id>`` and ``uid_dispatch`` -> ``subj_<id>`` in ONE chain
#   (``uid_out``), followed by the same unmarked-drop tail. An in-range uid that is no
#   subject misses both maps and dies at the tail, like an unknown source address.
# * Unlike the forward path, established flows are NOT accepted before the subject's chains:
#   conntrack knows no uid, so the forward path's way of revoking (cutting the source's
#   flows) would cut the host's own flows too. Every packet is judged instead, so a revert,
#   rebind, removal or narrowing takes effect on the next packet of every flow. Audit mode
#   marks new flows only (its rules say ``ct state new``), so the subjects in audit mode are
#   listed in ``uid_audit`` and their established flows pass after the deny sets.
# * DNS to port 53 of any address is REDIRECTed (nat output) to the subject's own port, known
#   to the DNS proxy; in-range uids that are no subject go to the port that answers NXDOMAIN.
#   With the MITM, 80/443 go to the subject's own MITM port. The local (loopback) leg of a
#   redirected flow is accepted only when its port belongs to the socket's uid
#   (``uid . port`` keys): a flow that outlived its subject cannot reach a port that a later
#   subject got.
# * Loopback and the host's own addresses are exempt (a sandbox's processes talk to each
#   other there), except every listener of egressd's own: the actions API, the proxies' ports.
# * Refusals go to ``uid_denied``: counted in the subject's ``subj_<id>_dropped`` by the socket's
#   owner, then ``deny_verdict`` (drop, or the EGRESSD_DENY_REJECT reply) like every refusal.
# * OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT is for network subjects: a uid subject's port-53
#   traffic always goes to its own DNS port.
# * Sockets of uids outside the range (the host's own processes, egressd and its MITM child
#   among them) are never touched; neither are egressd's (``own_uid``) and the DNS
#   forwarder's (SO_MARK 0x1, which needs CAP_NET_ADMIN) if the range happens to cover them.

UID_MARKING = "uid_marking"
UID_DISPATCH = "uid_dispatch"
UID_DNS = "uid_dns"  # nat: uid -> its DNS port
UID_DNS_OWN = "uid_dns_own"  # filter: uid . its DNS port
UID_MITM = "uid_mitm"  # nat: uid -> its MITM port
UID_MITM_IN = "uid_mitm_in"  # filter: uid . its MITM port -> subj_<id>_in
UID_AUDIT = "uid_audit"  # uids whose active policy audits
UID_DROP_COUNTER = "uid_drop_counter"  # uid -> subj_<id>_dropped (docs/behaviour.md §15)
UID_DENIED_CHAIN = "uid_denied"
UID_REFUSE = f"goto {UID_DENIED_CHAIN}"
UID_OUT_CHAIN = "uid_out"
UID_LOCAL_CHAIN = "uid_local"
UID_NAT_CHAIN = "uid_nat"
UID_INPUT_CHAIN = "uid_input"
FORWARDER_MARK = 0x1  # the DNS forwarder's SO_MARK (egressd/dnsproxy/forwarder.py)


@dataclass(frozen=True, slots=True)
class UidSubjectNft:
    """What the ruleset needs to know about one host-uid subject."""

    nft_id: str
    host_uid: int
    slot: int


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


def _uid_exemptions(s: _Script, cfg: TableConfig, chain: str) -> None:
    if cfg.own_uid is not None and cfg.own_uid in cfg.uids.uid_range:
        s.rule(chain, f"meta skuid {cfg.own_uid} return")
    s.rule(chain, f"meta mark {FORWARDER_MARK:#010x} return")


def _uid_header(s: _Script, cfg: TableConfig) -> None:
    """The output-hook half of the header (host-uid subjects); see the block comment above."""
    _uid_objects(s, cfg)
    _uid_out_chain(s, cfg)
    _uid_local_chain(s, cfg)
    if cfg.mitm:
        _uid_input_chain(s, cfg)
    _uid_nat_chain(s, cfg)


def _uid_range(cfg: TableConfig) -> str:
    return f"{cfg.uids.uid_range.first}-{cfg.uids.uid_range.last}"


def _uid_objects(s: _Script, cfg: TableConfig) -> None:
    s.obj("add", "map", f"{UID_MARKING} {{ type uid : verdict; }}")
    s.obj("add", "map", f"{UID_DISPATCH} {{ type uid : verdict; }}")
    s.obj("add", "map", f"{UID_DNS} {{ type uid : inet_service; }}")
    s.obj("add", "set", f"{UID_DNS_OWN} {{ type uid . inet_service; }}")
    s.obj("add", "set", f"{UID_AUDIT} {{ type uid; }}")
    if cfg.mitm:
        s.obj("add", "map", f"{UID_MITM} {{ type uid : inet_service; }}")
        s.obj("add", "map", f"{UID_MITM_IN} {{ type uid . inet_service : verdict; }}")
    for chain in (UID_OUT_CHAIN, UID_LOCAL_CHAIN, UID_NAT_CHAIN):
        s.obj("add", "chain", chain)
    # Refusals of in-range uids (docs/behaviour.md §15): their packets carry the host's address, so
    # they are counted by the socket's owner; an unknown uid's go on to ``denied`` (there:
    # unattributed), which also decides how a refusal looks (EGRESSD_DENY_REJECT).
    s.obj("add", "map", f"{UID_DROP_COUNTER} {{ type uid : counter; }}")
    s.obj("add", "chain", UID_DENIED_CHAIN)
    s.rule(UID_DENIED_CHAIN, f"counter name meta skuid map @{UID_DROP_COUNTER} goto {DENY_VERDICT_CHAIN}")
    s.rule(UID_DENIED_CHAIN, REFUSE)


def _uid_out_chain(s: _Script, cfg: TableConfig) -> None:
    """The forward path's dispatch, marking and tail on output, judged on every packet."""
    s.obj("add", "chain", "output { type filter hook output priority 0; policy accept; }")
    s.rule("output", f"meta skuid {_uid_range(cfg)} jump {UID_OUT_CHAIN}")
    o = UID_OUT_CHAIN
    _uid_exemptions(s, cfg, o)
    # A sandbox uid sends with the pod's own addresses only. IPv6 lets any process claim another
    # (IPV6_FREEBIND needs no capability): as a network sandbox's address it would get egressd's
    # own DNS answers sent there (a lateral channel) and open conntrack entries that sandbox's
    # later packets ride as "established", past its policy (docs/security.md, Hardening III).
    s.rule(o, f"fib saddr type != local {UID_REFUSE}")
    # A sandbox uid answering from one of egressd's listener ports squats it (a worker that is
    # restarting, a port egressd has not bound yet): it would receive another subject's
    # redirected DNS or intercepted flows. Its replies never leave, so nothing connects.
    own_udp, own_tcp = _own_listener_ports(cfg)
    s.rule(o, f"udp sport {own_udp} {UID_REFUSE}")
    s.rule(o, f"tcp sport {own_tcp} {UID_REFUSE}")
    s.rule(o, f"fib daddr type local jump {UID_LOCAL_CHAIN}")
    s.rule(o, f"meta mark set meta mark & {~ALLOW_MARK & 0xFFFFFFFF:#010x}")
    s.rule(o, f"tcp dport 853 {UID_REFUSE}")
    s.rule(o, f"udp dport 853 {UID_REFUSE}")
    if cfg.block_doh_443:
        if not cfg.doh_blocklist:
            s.rule(o, f"tcp dport 443 {UID_REFUSE}")
        for fam, entries in _split_doh(cfg.doh_blocklist).items():
            if entries:
                s.rule(o, f"{l3_of(fam)} daddr @{doh_set(fam)} tcp dport 443 {UID_REFUSE}")
    for fam in ("v4", "v6"):
        s.rule(o, f"{l3_of(fam)} daddr @{sandbox_set(fam)} {UID_REFUSE}")
        s.rule(o, f"{l3_of(fam)} daddr @{sandbox_nets_set(fam)} {UID_REFUSE}")
    s.rule(o, f"meta skuid vmap @{UID_MARKING}")
    s.rule(o, f"meta skuid vmap @{UID_DISPATCH}")
    s.rule(o, f"ct state established,related meta skuid @{UID_AUDIT} accept")
    s.rule(o, f"meta mark & {ALLOW_MARK:#x} != {ALLOW_MARK:#x} {UID_REFUSE}")


def _uid_local_chain(s: _Script, cfg: TableConfig) -> None:
    """What an in-range uid may reach on the host itself: its own redirects, anything but
    egressd's listeners."""
    uids, c = cfg.uids, UID_LOCAL_CHAIN
    dns_lo, dns_hi = uids.dns_ports
    for proto in ("udp", "tcp"):
        s.rule(
            c,
            f"{proto} dport {dns_lo}-{dns_hi} ct status dnat ct original proto-dst 53 "
            f"meta skuid . {proto} dport @{UID_DNS_OWN} accept",
        )
        s.rule(c, f"{proto} dport {uids.unknown_dns_port} ct status dnat ct original proto-dst 53 accept")
    if cfg.mitm:
        _uid_local_mitm(s, cfg)
    own_udp, own_tcp = _own_listener_ports(cfg)
    s.rule(c, f"udp dport {own_udp} {UID_REFUSE}")
    s.rule(c, f"tcp dport {own_tcp} {UID_REFUSE}")
    s.rule(c, "accept")


def _own_listener_ports(cfg: TableConfig) -> tuple[str, str]:
    """egressd's UDP and TCP listener ports (DNS, per-subject DNS, HTTP, every MITM worker and
    per-subject MITM port), as anonymous nft sets."""
    dns_lo, dns_hi = cfg.uids.dns_ports
    own_udp = [(cfg.dns_port, cfg.dns_port), (dns_lo, dns_hi)]
    own_tcp = [*own_udp, (cfg.http_port, cfg.http_port)]
    if cfg.mitm:
        own_tcp += [(cfg.mitm_port, cfg.mitm_port + cfg.mitm_workers - 1), cfg.uids.mitm_ports]
    return _port_set(own_udp), _port_set(own_tcp)


def _uid_local_mitm(s: _Script, cfg: TableConfig) -> None:
    """An intercepted flow of a uid subject, judged on its original destination by its own
    ``subj_<id>_in`` (keyed by ``uid . port``: only its own MITM port)."""
    mitm_lo, mitm_hi = cfg.uids.mitm_ports
    c, mitm = UID_LOCAL_CHAIN, f"tcp dport {mitm_lo}-{mitm_hi} ct status dnat"
    if cfg.block_doh_443:
        if not cfg.doh_blocklist:
            s.rule(c, f"{mitm} ct original proto-dst 443 {UID_REFUSE}")
        for fam, entries in _split_doh(cfg.doh_blocklist).items():
            if entries:
                s.rule(
                    c,
                    f"{mitm} ct original {l3_of(fam)} daddr @{doh_set(fam)} ct original proto-dst 443 {UID_REFUSE}",
                )
    for fam in ("v4", "v6"):
        s.rule(c, f"{mitm} ct original {l3_of(fam)} daddr @{sandbox_set(fam)} {UID_REFUSE}")
        s.rule(c, f"{mitm} ct original {l3_of(fam)} daddr @{sandbox_nets_set(fam)} {UID_REFUSE}")
    s.rule(c, f"{mitm} meta skuid . tcp dport vmap @{UID_MITM_IN}")


def _uid_input_chain(s: _Script, cfg: TableConfig) -> None:
    """The local leg of a uid subject's intercepted flow was judged on output; anything else
    on these ports (a remote peer, a direct connection) would make the MITM proxy to itself
    or to nowhere. A base chain of its own: the network subjects' input chain stays as is."""
    mitm_lo, mitm_hi = cfg.uids.mitm_ports
    s.obj("add", "chain", f"{UID_INPUT_CHAIN} {{ type filter hook input priority 0; policy accept; }}")
    s.rule(UID_INPUT_CHAIN, f"tcp dport {mitm_lo}-{mitm_hi} ct status dnat return")
    s.rule(UID_INPUT_CHAIN, f"tcp dport {mitm_lo}-{mitm_hi} {UID_REFUSE}")


def _uid_nat_chain(s: _Script, cfg: TableConfig) -> None:
    """Port-53 traffic to any address goes to the uid's own DNS port (unknown uids: to the
    NXDOMAIN port); with the MITM, what would be intercepted goes to its own MITM port."""
    s.obj("add", "chain", "nat_out { type nat hook output priority -100; policy accept; }")
    s.rule("nat_out", f"meta skuid {_uid_range(cfg)} jump {UID_NAT_CHAIN}")
    n = UID_NAT_CHAIN
    _uid_exemptions(s, cfg, n)
    for proto in ("udp", "tcp"):
        s.rule(n, f"{proto} dport 53 redirect to :meta skuid map @{UID_DNS}")
    for proto in ("udp", "tcp"):
        s.rule(n, f"{proto} dport 53 redirect to :{cfg.uids.unknown_dns_port}")
    if not cfg.mitm:
        return
    s.rule(n, "fib daddr type local return")
    for fam in ("v4", "v6"):
        s.rule(n, f"{l3_of(fam)} daddr @{sandbox_set(fam)} return")
        s.rule(n, f"{l3_of(fam)} daddr @{sandbox_nets_set(fam)} return")
    s.rule(n, f"tcp dport {mitm_ports(cfg)} redirect to :meta skuid map @{UID_MITM}")


def uid_subject_keys(cfg: TableConfig, subj: UidSubjectNft) -> NetlinkBatch:
    """Point the subject's host uid at its chains and ports (idempotent)."""
    n = Names(subj.nft_id)
    uid, dns = subj.host_uid, cfg.uids.dns_port(subj.slot)
    ops: list[Op] = [
        # First: the counter exists before the dispatch jump can send a packet to a refusal.
        AddUidCounterRef(UID_DROP_COUNTER, uid, n.dropped_counter),
        AddUidJump(UID_DISPATCH, uid, n.chain),
        AddUidJump(UID_MARKING, uid, n.mark_chain),
        AddUidPort(UID_DNS, uid, dns),
        AddUid(UID_DNS_OWN, uid, dns),
    ]
    if cfg.mitm:
        mitm = cfg.uids.mitm_port(subj.slot)
        ops += [AddUidPort(UID_MITM, uid, mitm), AddUidJump(UID_MITM_IN, uid, n.in_chain, port=mitm)]
    return NetlinkBatch(cfg.table, tuple(ops))


def uid_key_deletes(cfg: TableConfig, host_uid: int, slot: int) -> list[Op]:
    """Remove a host uid from every uid map (the inverse of :func:`uid_subject_keys`), and from
    ``uid_audit`` whether or not it is there."""
    dns = cfg.uids.dns_port(slot)
    ops: list[Op] = [
        DeleteUid(UID_DISPATCH, host_uid),
        DeleteUid(UID_MARKING, host_uid),
        DeleteUid(UID_DNS, host_uid),
        DeleteUid(UID_DNS_OWN, host_uid, dns),
    ]
    if cfg.mitm:
        ops += [DeleteUid(UID_MITM, host_uid), DeleteUid(UID_MITM_IN, host_uid, cfg.uids.mitm_port(slot))]
    # Last: nothing jumps to a refusal of this uid any more (its counter may go after this).
    return [*ops, DeleteUid(UID_DROP_COUNTER, host_uid), *uid_audit_ops(host_uid, audit=False)]


def uid_audit_ops(host_uid: int, *, audit: bool) -> list[Op]:
    """``uid_audit`` membership for the subject's policy, in the caller's transaction. "Not a
    member" is an add then a delete: a bare delete of a missing element would fail (ENOENT)
    and abort the whole batch, and the kernel is the only one who knows for sure."""
    ops: list[Op] = [AddUid(UID_AUDIT, host_uid)]
    if not audit:
        ops.append(DeleteUid(UID_AUDIT, host_uid))
    return ops


def uid_subject_create(cfg: TableConfig, subj: UidSubjectNft) -> NetlinkBatch:
    """A new host-uid subject in ONE atomic batch: the same sets, chains and fixed rules as a
    network subject, then its uid keys (no sandbox address, no gateway)."""
    return (
        subject_objects(cfg, subj.nft_id)
        + subject_rules(cfg, subj.nft_id)
        + uid_subject_keys(cfg, subj)
        + NetlinkBatch(cfg.table, tuple(uid_audit_ops(subj.host_uid, audit=False)))
    )
