"""Host-uid subjects in the fleet ruleset. Pure.

docs/reference/behaviour.md §17: sandboxes that share egressd's network namespace and differ only by host uid.
Their packets are locally generated, so they meet the ``output`` hook, never prerouting or
forward; the identity is the socket's owner (``meta skuid``). They use the same per-subject
chains and sets as the forward path, reached through uid-keyed verdict maps:

* ``uid_marking`` -> ``mark_<id>`` and ``uid_dispatch`` -> ``subj_<id>`` in ONE chain
  (``uid_out``), followed by the same unmarked-drop tail. An in-range uid that is no
  subject misses both maps and dies at the tail, like an unknown source address.
* Unlike the forward path, established flows are NOT accepted before the subject's chains:
  conntrack knows no uid, so the forward path's way of revoking (cutting the source's
  flows) would cut the host's own flows too. Every packet is judged instead, so a revert,
  rebind, removal or narrowing takes effect on the next packet of every flow. Audit mode
  marks new flows only (its rules say ``ct state new``), so the subjects in audit mode are
  listed in ``uid_audit`` and their established flows pass after the deny sets.
* DNS to port 53 of any address is REDIRECTed (nat output) to the subject's own port, known
  to the DNS proxy; in-range uids that are no subject go to the port that answers NXDOMAIN.
  NAT is decided on a flow's first packet only, and the DNS forwarder sends (exempt, SO_MARK
  0x1) from this same namespace and address: a uid that binds a source port of a forwarder
  socket that has been closed rides its conntrack entry un-NATed, straight to the resolver.
  So ``uid_out`` refuses port 53 that was not NATed, first thing after the exemptions.
  The other way round, a subject's redirected entries (one per source port, if it sends from
  every one) would catch the first packet of the forwarder's next socket on such a port, NATed
  to that subject's DNS port: ``fwd_zone`` (raw output) puts the forwarder's flows in a
  conntrack zone of their own, original direction only (nftsyntax.forwarder_zone).
  With the MITM, 80/443 (the extra ports, and the ports its http/https rules name:
  ``uid_mitm_ports``) go to the subject's own MITM port. The local (loopback) leg of a
  redirected flow is accepted only when its port belongs to the socket's uid
  (``uid . port`` keys): a flow that outlived its subject cannot reach a port that a later
  subject got.
* Loopback and the host's own addresses are exempt (a sandbox's processes talk to each
  other there), except every listener of egressd's own: the actions API, the proxies' ports.
* Refusals go to ``uid_denied``: counted in the subject's ``subj_<id>_dropped`` by the socket's
  owner, then ``deny_verdict`` (drop, or the EGRESSD_DENY_REJECT reply) like every refusal.
* OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT is for network subjects: a uid subject's port-53
  traffic always goes to its own DNS port.
* Sockets of uids outside the range (the host's own processes, egressd and its MITM child
  among them) are never touched; neither are egressd's (``own_uid``: the DNS forwarder and
  the MITM run as it) if the range happens to cover it. The forwarder's mark (SO_MARK 0x1)
  exempts nothing here: a sandbox process with CAP_NET_RAW may set it (Linux 5.17 on).
"""

from __future__ import annotations

from dataclasses import dataclass

from egressd.engine.plansteps import UidKeys
from egressd.fleetnft.subject import flush_subject_sets, subject_objects, subject_rules
from egressd.fleetnft.table import (
    DENY_VERDICT_CHAIN,
    REFUSE,
    Names,
    TableConfig,
    _own_listener_ports,
    _Script,
    doh_set,
    sandbox_nets_set,
    sandbox_set,
)
from egressd.kernel.ops import (
    ALLOW_MARK,
    AddUid,
    AddUidCounterRef,
    AddUidJump,
    AddUidPort,
    DeleteUid,
    NetlinkBatch,
    Op,
)
from egressd.nftsyntax import (
    intercepted_ports,
    l3_of,
    split_by_family,
    unredirected_dns,
)
from egressd.subject.registry import Entry, HostBinding, KernelView

UID_MARKING = "uid_marking"
UID_DISPATCH = "uid_dispatch"
UID_DNS = "uid_dns"  # nat: uid -> its DNS port
UID_DNS_OWN = "uid_dns_own"  # filter: uid . its DNS port
UID_MITM = "uid_mitm"  # nat: uid -> its MITM port
UID_MITM_IN = "uid_mitm_in"  # filter: uid . its MITM port -> subj_<id>_in
UID_MITM_PORTS = "uid_mitm_ports"  # nat: uid . tcp . the ports its http/https rules name
UID_AUDIT = "uid_audit"  # uids whose active policy audits
UID_DROP_COUNTER = "uid_drop_counter"  # uid -> subj_<id>_dropped (docs/reference/behaviour.md §15)
UID_DENIED_CHAIN = "uid_denied"
UID_REFUSE = f"goto {UID_DENIED_CHAIN}"
UID_OUT_CHAIN = "uid_out"
UID_LOCAL_CHAIN = "uid_local"
UID_NAT_CHAIN = "uid_nat"
UID_INPUT_CHAIN = "uid_input"


@dataclass(frozen=True, slots=True)
class UidSubjectNft:
    """What the ruleset needs to know about one host-uid subject."""

    nft_id: str
    host_uid: int
    slot: int


def _uid_exemptions(s: _Script, cfg: TableConfig, chain: str) -> None:
    """egressd's own sockets, the DNS forwarder's and the MITM's among them, if the range
    covers its uid. By uid, never by the forwarder's mark: a sandbox process with CAP_NET_RAW
    sets SO_MARK (Linux 5.17 on) and would pass for the forwarder, past redirect and policy."""
    if cfg.own_uid is not None and cfg.own_uid in cfg.uids.uid_range:
        s.rule(chain, f"meta skuid {cfg.own_uid} return")


def _uid_header(s: _Script, cfg: TableConfig) -> None:
    """The output-hook half of the header (host-uid subjects); see the module docstring."""
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
        # uid . tcp . port range: the ports a subject's http/https rules name (fleetnft.mitmports).
        s.obj("add", "set", f"{UID_MITM_PORTS} {{ typeof meta skuid . meta l4proto . tcp dport; flags interval; }}")
    for chain in (UID_OUT_CHAIN, UID_LOCAL_CHAIN, UID_NAT_CHAIN):
        s.obj("add", "chain", chain)
    # Refusals of in-range uids (docs/reference/behaviour.md §15): their packets carry the host's address, so
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
    # Port 53 that nat output did not redirect (nftsyntax.unredirected_dns). Before uid_local:
    # a local resolver on :53 is redirected too (docs/reference/behaviour.md §17).
    for body in unredirected_dns(UID_REFUSE):
        s.rule(o, body)
    # A sandbox uid sends with the pod's own addresses only. IPv6 lets any process claim another
    # (IPV6_FREEBIND needs no capability): as a network sandbox's address it would get egressd's
    # own DNS answers sent there (a lateral channel) and open conntrack entries that sandbox's
    # later packets ride as "established", past its policy (docs/reference/behaviour.md §17).
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
        for fam, entries in split_by_family(cfg.doh_blocklist).items():
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


def _uid_local_mitm(s: _Script, cfg: TableConfig) -> None:
    """An intercepted flow of a uid subject, judged on its original destination by its own
    ``subj_<id>_in`` (keyed by ``uid . port``: only its own MITM port)."""
    mitm_lo, mitm_hi = cfg.uids.mitm_ports
    c, mitm = UID_LOCAL_CHAIN, f"tcp dport {mitm_lo}-{mitm_hi} ct status dnat"
    if cfg.block_doh_443:
        if not cfg.doh_blocklist:
            s.rule(c, f"{mitm} ct original proto-dst 443 {UID_REFUSE}")
        for fam, entries in split_by_family(cfg.doh_blocklist).items():
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
    s.rule(n, f"tcp dport {intercepted_ports(cfg.mitm_extra_ports)} redirect to :meta skuid map @{UID_MITM}")
    s.rule(n, f"meta skuid . meta l4proto . tcp dport @{UID_MITM_PORTS} redirect to :meta skuid map @{UID_MITM}")


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


# ---- the kernel side of a host-uid subject's plan steps (fleetnft/steps.py)


def audit_membership(cfg: TableConfig, uid_keys: UidKeys, audit: bool) -> NetlinkBatch:
    """``uid_audit`` for each of the subject's uids: in it while its active policy audits."""
    ops: list[Op] = []
    for host_uid, _slot in sorted(uid_keys):
        ops += uid_audit_ops(host_uid, audit=audit)
    return NetlinkBatch(cfg.table, tuple(ops))


def deny_first(
    cfg: TableConfig, entry: Entry, host: HostBinding, view: KernelView
) -> tuple[NetlinkBatch, KernelView]:
    """Deny-first for a host-uid subject, and the view after it: a new subject's objects,
    rules and keys in one batch; or every set emptied, the rules if missing, and the keys."""
    nid = entry.nft_id
    subj = UidSubjectNft(nid, host.host_uid, host.slot)
    keys = view.uid_keys | {(host.host_uid, host.slot)}
    if not view.objects:
        return uid_subject_create(cfg, subj), KernelView(True, rules=True, uid_keys=keys)
    # The audit and range objects stay (lazy, made once, kept for the subject's life): emptied.
    batch = flush_subject_sets(cfg.table, nid, audit=view.audit, ranges=view.ranges)
    if not view.rules:
        batch = batch + subject_rules(cfg, nid, audit=view.audit, ranges=view.ranges)
    batch = batch + uid_subject_keys(cfg, subj) + audit_membership(cfg, keys, audit=False)
    after = KernelView(True, view.keys, True, None, uid_keys=keys, audit=view.audit, ranges=view.ranges)
    return batch, after


def add_keys(cfg: TableConfig, entry: Entry, host: HostBinding, audit: bool) -> NetlinkBatch:
    """Point a host uid at an existing subject's chains (a re-key of an active subject)."""
    keys: UidKeys = frozenset({(host.host_uid, host.slot)})
    subj = UidSubjectNft(entry.nft_id, host.host_uid, host.slot)
    return uid_subject_keys(cfg, subj) + audit_membership(cfg, keys, audit)


def key_deletes(cfg: TableConfig, uid_keys: UidKeys) -> list[Op]:
    ops: list[Op] = []
    for host_uid, slot in sorted(uid_keys):
        ops += uid_key_deletes(cfg, host_uid, slot)
    return ops


def resync_keys(cfg: TableConfig, nid: str, view: KernelView, audit: bool) -> NetlinkBatch:
    """The uid keys of ``view`` re-declared (each a no-op when present), for the re-sync after
    an unanswered transaction."""
    out = NetlinkBatch(cfg.table)
    for host_uid, slot in sorted(view.uid_keys):
        out = out + uid_subject_keys(cfg, UidSubjectNft(nid, host_uid, slot))
    return out + audit_membership(cfg, view.uid_keys, audit)
