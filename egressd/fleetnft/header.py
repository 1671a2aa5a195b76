"""The table-wide part of the fleet ruleset (docs/reference/behaviour.md §8.1): an empty, deny-by-default
table with the maps, sets and base chains every network subject is dispatched through (the
host-uid half comes from :mod:`egressd.fleetnft.hostuid`). Pure: returns a libnftables script.

Shape, and why it differs from the reference blueprint where it does:

* Dispatch by source IP goes through verdict maps (``dispatch_v4`` … ``marking_v6``) instead
  of one ``ip saddr X jump`` rule per subject: one lookup per packet at any fleet size, and a
  subject's entry can be removed without knowing rule handles.
* The DNS redirect is per gateway: a gateway set feeds two shared redirect rules, and the
  gateway element lives exactly as long as some subject uses that gateway.
* With MITM, interception is a REDIRECT for sources in ``mitm_src_v4/v6`` (feasibility
  measured REDIRECT and DNAT-to-gateway as equivalent: both keep the original destination)
  to the source's MITM worker port, looked up in ``mitm_port_v4/v6`` (EGRESSD_MITM_WORKERS:
  one worker per subject, so its snapshot cache stays warm). The port element is added and
  deleted in the same transaction as the ``mitm_src`` and ``mitm_in`` elements, and an
  intercepted source whose lookup misses is dropped right after the redirect rule: there is
  no state in which an intercepted source reaches 80/443 upstream past a worker.
* No lateral movement on any hook (docs/reference/behaviour.md §14.2): the forward hook drops sandbox
  destinations; the nat hook never intercepts a packet addressed to the pod itself or to a
  sandbox (the MITM would connect there on the sandbox's behalf); and the input hook, with or
  without the MITM, sends registered sandbox sources to ``sandbox_in``, which accepts only
  what egressd redirected (DNS, the MITM) and drops every other pod listener. A routed
  topology (one /32 veth per sandbox, the gateway on each) makes sibling traffic cross the
  nat and input hooks exactly like upstream traffic, so the bridge is no safeguard here.
* Every refusal is counted (docs/reference/behaviour.md §15): each drop of the header and of a subject's chains
  is a ``goto denied``. ``denied`` counts the packet in its source's named counter
  ``subj_<id>_dropped`` (looked up in the counter maps ``drop_counter_v4/v6``, keyed like the
  dispatch maps) or, for a source that is no subject, in ``unattributed_dropped``, then hands
  it to ``deny_verdict``: ``drop``, or with ``EGRESSD_DENY_REJECT`` a TCP reset / ICMP
  admin-prohibited (ICMP also for TCP the MITM redirect intercepted). One place decides how a refusal looks, so the knob never touches a
  subject's rules, and a lookup miss in the counter map (which only stops that rule) falls
  through to a rule that still refuses.
"""

from __future__ import annotations

from egressd.fleetnft.hostuid import _uid_header
from egressd.fleetnft.table import (
    DENIED_CHAIN,
    DENY_VERDICT_CHAIN,
    REFUSE,
    UNATTRIBUTED_COUNTER,
    TableConfig,
    _counter_map_decl,
    _own_listener_ports,
    _plain_set_decl,
    _port_map_decl,
    _ports,
    _Script,
    _vmap_decl,
    dispatch_map,
    doh_set,
    drop_counter_map,
    gateway_set,
    marking_map,
    mitm_in_map,
    mitm_port_map,
    mitm_ports_set,
    mitm_src_set,
    sandbox_nets_set,
    sandbox_set,
)
from egressd.kernel.listeners import OWNER_MARK
from egressd.kernel.ops import ALLOW_MARK
from egressd.nftsyntax import (
    FORWARDER_MARK,
    FORWARDER_ZONE_CHAIN,
    ND_TYPES,
    exempt_literal,
    forwarder_zone,
    intercepted_ports,
    l3_of,
    port_set_decl,
    set_decl,
    split_by_family,
)

#: Regular chain the input hook sends sandbox-sourced packets to (docs/reference/behaviour.md §14.2).
SANDBOX_IN_CHAIN = "sandbox_in"
#: The attachments' hostVeths (``type ifname``): packets arriving there are a sandbox's (§20.2).
SANDBOX_IFACES_SET = "sandbox_ifaces"
#: Regular chain the input hook sends everything addressed to egressd's ports to (§20.1).
OWNED_IN_CHAIN = "owned_in"


def worker_ports(cfg: TableConfig) -> str:
    """Every MITM worker's listening port, as an nft port or range."""
    return _ports(cfg.mitm_port, cfg.mitm_port + cfg.mitm_workers - 1)


def header_script(cfg: TableConfig, *, delete_existing: bool) -> str:
    """The §8.1 header: an empty, deny-by-default table (``Reset = header only``).

    With ``delete_existing`` the script starts with ``delete table``; the applier retries
    without it when the table does not exist yet.
    """
    s = _Script(cfg.table)
    if delete_existing:
        s.add(f"delete table inet {cfg.table}")
    s.add(f"add table inet {cfg.table}")
    doh = split_by_family(cfg.doh_blocklist)
    _header_objects(s, cfg, doh)
    _marking_chain(s, cfg)
    _filter_chains(s, cfg, doh)
    _nat_chain(s, cfg)
    _uid_header(s, cfg)
    _fwd_zone_chain(s, cfg)
    return s.text()


#: raw output: the DNS forwarder's flows in a conntrack zone of their own.
FWD_ZONE_CHAIN = "fwd_zone"


def _fwd_zone_chain(s: _Script, cfg: TableConfig) -> None:
    """The forwarder serves every subject from the pod's namespace (nftsyntax.forwarder_zone):
    in a zone of their own its flows cannot be captured by a host-uid subject's redirected
    entries on the same ports, nor theirs by its."""
    s.obj("add", "chain", f"{FWD_ZONE_CHAIN} {FORWARDER_ZONE_CHAIN}")
    s.rule(FWD_ZONE_CHAIN, forwarder_zone(FORWARDER_MARK, cfg.own_uid))


def _header_objects(s: _Script, cfg: TableConfig, doh: dict[str, list[str]]) -> None:
    """The table-wide maps and sets, empty but for the DoH blocklist."""
    for fam in ("v4", "v6"):
        s.obj("add", "map", _vmap_decl(marking_map(fam), fam))
        s.obj("add", "map", _vmap_decl(dispatch_map(fam), fam))
        s.obj("add", "set", _plain_set_decl(sandbox_set(fam), fam))
        s.obj("add", "set", set_decl(sandbox_nets_set(fam), fam, "interval"))
        s.obj("add", "set", _plain_set_decl(gateway_set(fam), fam))
        if cfg.mitm:
            s.obj("add", "map", _vmap_decl(mitm_in_map(fam), fam))
            s.obj("add", "set", _plain_set_decl(mitm_src_set(fam), fam))
            s.obj("add", "map", _port_map_decl(mitm_port_map(fam), fam))
            s.obj("add", "set", port_set_decl(mitm_ports_set(fam), fam, 0))
        s.obj("add", "map", _counter_map_decl(drop_counter_map(fam), fam))
    if cfg.block_doh_443 and cfg.doh_blocklist:
        for fam in ("v4", "v6"):
            s.obj("add", "set", set_decl(doh_set(fam), fam, "interval", doh[fam]))
    s.obj("add", "set", f"{SANDBOX_IFACES_SET} {{ type ifname; }}")
    _denial_chains(s, cfg)


def _marking_chain(s: _Script, cfg: TableConfig) -> None:
    # Prerouting: clear our bit first, so only this table's rules can grant it.
    s.obj("add", "chain", "marking { type filter hook prerouting priority 0; policy accept; }")
    _sandbox_source_guard(s, cfg)
    s.rule("marking", f"meta mark set meta mark & {~ALLOW_MARK & 0xFFFFFFFF:#010x}")
    for fam in ("v4", "v6"):
        exempt = exempt_literal(cfg.nameserver_exempt, fam)
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
    """The DNS redirect per gateway and, with the MITM, the interception: 80, 443 and the extra
    ports of every MITM source, and the ports its subject's http/https rules name
    (``mitm_ports``, filled with its policy: docs/reference/behaviour.md §18)."""
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
    ports = intercepted_ports(cfg.mitm_extra_ports)
    # The exemptions hold for every TCP port: a subject's named ports (below) are intercepted
    # like 80 and 443, so what is not upstream must never reach them either.
    s.rule("nat", "fib daddr type local meta l4proto tcp return")
    for fam in ("v4", "v6"):
        s.rule("nat", f"{l3_of(fam)} daddr @{gateway_set(fam)} meta l4proto tcp return")
        s.rule("nat", f"{l3_of(fam)} daddr @{sandbox_set(fam)} meta l4proto tcp return")
        s.rule("nat", f"{l3_of(fam)} daddr @{sandbox_nets_set(fam)} meta l4proto tcp return")
        src = f"{l3_of(fam)} saddr @{mitm_src_set(fam)} tcp dport {ports}"
        named = f"{l3_of(fam)} saddr . meta l4proto . tcp dport @{mitm_ports_set(fam)}"
        for match in (src, named):
            s.rule("nat", f"{match} redirect to :{l3_of(fam)} saddr map @{mitm_port_map(fam)}")
            # A map miss only ends the rule above: an intercepted source without a worker
            # port must not fall through to the forward path (and upstream unintercepted).
            s.rule("nat", f"{match} drop")


def _denial_chains(s: _Script, cfg: TableConfig) -> None:
    """``denied`` and ``deny_verdict`` (docs/reference/behaviour.md §15), declared before any rule jumps there.

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
    """docs/reference/behaviour.md §20.1 on the receiving side: what is addressed to one of egressd's
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
    """docs/reference/behaviour.md §20.2: a packet that arrives on a sandbox-facing interface is a sandbox's,
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
