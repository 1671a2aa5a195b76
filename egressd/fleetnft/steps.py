"""The fleet's kernel side of each plan step: its netlink objects, built and sent in one transaction.

One method per step kind (subject/registry.py defines them), implementing
:class:`egressd.engine.plansteps.PlanSteps` for the engine's step runner
(egressd/actionhandler/steps.py), which decides what surrounds each transaction. Each sends
its batch through :class:`_Transaction`, which records in the registry what the kernel holds
after it, or what it may hold when the answer never came (the engine's ``StepTxn.save``).
Callers hold the kernel lock.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from egressd.addr import IPAddress
from egressd.engine.plansteps import InUse, Keys, Leases, Refused, StepTxn, UidKeys, in_doubt, ips
from egressd.fleetnft import hostuid
from egressd.fleetnft.contents import (
    Contents,
    contents_swap,
    dyn_replace,
    needs_range_objects,
    policy_swap,
    refuses_more,
    sandbox_nets_refresh,
    static_contents,
)
from egressd.fleetnft.header import SANDBOX_IFACES_SET, header_script
from egressd.fleetnft.ifaces import usable_host_veth
from egressd.fleetnft.mitmports import (
    NONE,
    Interception,
    Key,
    NamedPorts,
    address_key,
    uid_key,
)
from egressd.fleetnft.subject import (
    dispatch_deletes,
    flush_subject_sets,
    gateway_release,
    lazy_objects,
    removal_batch,
    subject_create,
    subject_keys,
    subject_resync,
    subject_rules,
)
from egressd.fleetnft.table import SubjectNft, TableConfig, mitm_ports_set
from egressd.fleetnft.workers import WorkerAssignment, uid_worker
from egressd.kernel.applier import NftError, NftUncertain, Transactions
from egressd.kernel.ops import AddIface, DeleteIface, NetlinkBatch, Op
from egressd.policy import NetworkPolicy
from egressd.policy.mitmports import FIXED_PORTS, named_ports
from egressd.subject.registry import Binding, Entry, HostBinding, KernelView

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class SandboxNets:
    """What the kernel holds per subject to recognise sandboxes on the input hook: its
    privateCidr in the ``sandbox_nets`` union (14.2) and its hostVeth in ``sandbox_ifaces`` (20.2)."""

    def __init__(self) -> None:
        self.held: dict[str, Network] = {}
        self.ifaces: dict[str, str] = {}
        self._naming: Counter[str] = Counter()  # interface -> how many subjects name it

    def forget_all(self) -> None:
        """The table was reset: nothing of any subject is held any more."""
        self.held, self.ifaces, self._naming = {}, {}, Counter()

    def refilled(
        self, batch: NetlinkBatch, uid: str, cidr: Network | None, iface: str | None
    ) -> tuple[NetlinkBatch, Callable[[], None]]:
        """``batch`` plus, in the same transaction, the refill of the kernel's union of every
        subject's CIDR when ``uid``'s changes, and its interface's entry when that changes;
        and the commit to call after it."""
        iface = usable_host_veth(iface)
        if self.held.get(uid) == cidr and self.ifaces.get(uid) == iface:
            return batch, lambda: None
        ops = self._iface_ops(uid, iface)
        desired = self.held
        if self.held.get(uid) != cidr:
            desired = {u: n for u, n in self.held.items() if u != uid}
            if cidr is not None:
                desired[uid] = cidr
            ops += sandbox_nets_refresh(desired.values())

        def commit() -> None:
            self.held = desired
            old = self.ifaces.pop(uid, None)
            if old is not None:
                self._naming[old] -= 1
                if self._naming[old] <= 0:
                    del self._naming[old]
            if iface is not None:
                self.ifaces[uid] = iface
                self._naming[iface] += 1

        return batch + NetlinkBatch(batch.table, tuple(ops)), commit

    def _iface_ops(self, uid: str, iface: str | None) -> list[Op]:
        """The new name in (adding is idempotent); the old one out when no other subject names
        it (added first: a delete of a missing element would fail the whole transaction)."""
        old = self.ifaces.get(uid)
        if old == iface:
            return []
        ops: list[Op] = []
        if iface is not None:
            ops.append(AddIface(SANDBOX_IFACES_SET, iface))
        if old is not None and self._naming[old] <= 1:
            ops += [AddIface(SANDBOX_IFACES_SET, old), DeleteIface(SANDBOX_IFACES_SET, old)]
        return ops


@dataclass(slots=True)
class _Transaction:
    """Sends one step's batch; ``prelude`` (a re-sync after an unanswered transaction) goes
    into it first, ``doubt`` is what the kernel may hold if it goes unanswered."""

    tx: Transactions
    prelude: NetlinkBatch
    doubt: KernelView
    save: Callable[[KernelView], None]

    async def send(self, batch: NetlinkBatch, op: str, after: KernelView) -> None:
        batch = self.prelude + batch
        if batch:
            try:
                await self.tx.run_batch(batch, op=op)
            except NftUncertain:
                self.save(in_doubt(self.doubt, after))
                raise
            except NftError:
                raise  # refused: nothing of it applied, the view still holds
            except Exception as exc:
                # A timeout (or anything else) out of the kernel shell: the batch may
                # have been committed all the same.
                self.save(in_doubt(self.doubt, after))
                raise NftUncertain(f"kernel transaction failed: {exc!r}"[:300]) from exc
            except BaseException:
                self.save(in_doubt(self.doubt, after))  # cancelled: the kernel thread may still commit it
                raise
        self.save(after)


class FleetSteps:
    """The fleet's :class:`egressd.engine.plansteps.PlanSteps`: per-subject netlink objects."""

    def __init__(self, cfg: TableConfig, tx: Transactions) -> None:
        self._cfg = cfg
        self._tx = tx
        # What the kernel holds per subject to recognise sandboxes on the input hook.
        self.nets = SandboxNets()
        # Network subjects' MITM workers (EGRESSD_MITM_WORKERS): kept from a subject's first MITM
        # entries to its removal, so its mitm_port elements never change value.
        self.workers = WorkerAssignment(cfg.mitm_workers)
        # The ports each subject's http/https rules name, intercepted for it alone (§18).
        sets = (mitm_ports_set("v4"), mitm_ports_set("v6"), hostuid.UID_MITM_PORTS) if cfg.mitm else ()
        self.named = NamedPorts(sets)
        self.fixed_ports = (*FIXED_PORTS, *cfg.mitm_extra_ports)

    def _txn(self, txn: StepTxn) -> _Transaction:
        """The step's transaction: the re-sync first when the last one went unanswered."""
        prelude = NetlinkBatch(self._cfg.table)
        if txn.resync is not None:
            r = txn.resync
            prelude = self.resync_batch(r.uid, r.nft_id, r.view, r.effective, r.kept)
        return _Transaction(self._tx, prelude, txn.doubt, txn.save)

    async def reset_table(self) -> None:
        await self._tx.reset_table(
            header_script(self._cfg, delete_existing=True),
            header_script(self._cfg, delete_existing=False),
        )
        self.nets.forget_all()
        self.named.forget_all()

    async def uid_deny_first(self, txn: StepTxn, entry: Entry, host: HostBinding, view: KernelView) -> None:
        send = self._txn(txn)
        batch, after = hostuid.deny_first(self._cfg, entry, host, view)
        batch, commit = self.nets.refilled(batch, entry.uid, None, None)
        batch, named = self.named.changed(batch, entry.uid, NONE)
        await send.send(batch, "deny_first", after)
        commit()
        named()

    async def uid_add_keys(
        self, txn: StepTxn, entry: Entry, host: HostBinding, view: KernelView, *, audit: bool
    ) -> None:
        send = self._txn(txn)
        batch, commit = self.nets.refilled(
            hostuid.add_keys(self._cfg, entry, host, audit), entry.uid, None, None
        )
        key = (host.host_uid, host.slot)
        after = replace(view, uid_keys=view.uid_keys | {key})
        batch, named = self._follow_keys(batch, entry.uid, after)
        await send.send(batch, "dispatch_update", after)
        commit()
        named()

    async def deny_first(self, txn: StepTxn, entry: Entry, binding: Binding, view: KernelView) -> list[IPAddress]:
        send = self._txn(txn)
        nid, cfg = entry.nft_id, self._cfg
        subj = _subject_nft(nid, binding, self.workers.of(entry.uid))
        try:
            create = subject_create(cfg, subj)
        except ValueError as exc:
            raise Refused(str(exc)) from None
        key = (subj.ip, subj.gateway)
        if not view.objects:
            # A new subject: sets, chains, fixed rules and keys in one transaction.
            create, commit = self.nets.refilled(create, entry.uid, binding.private_cidr, binding.host_veth)
            await send.send(create, "deny_first", KernelView(True, frozenset({key}), rules=True))
            commit()
            # Nothing this subject allows is established yet, yet the header accepts
            # established flows: after a kill -9 and restart (the Fastlet's replay lands
            # here) or an address reused from a sandbox that left while egressd was down,
            # flows a previous process allowed would run on unjudged. Cut them; picked up
            # again they meet this subject's rules (found with scripts/storm.py).
            return [subj.ip]
        # Revert, rebind or retry: empty every set before any (new) key points at the
        # chains, all in one transaction.
        batch = flush_subject_sets(cfg.table, nid, audit=view.audit, ranges=view.ranges)
        if not view.rules:
            batch = batch + subject_rules(cfg, nid, audit=view.audit, ranges=view.ranges)
        batch, commit = self.nets.refilled(
            batch + subject_keys(cfg, subj), entry.uid, binding.private_cidr, binding.host_veth
        )
        after = replace(view, rules=True, applied=None, keys=view.keys | {key}, contents=None)
        batch, named = self.named.changed(batch, entry.uid, NONE)
        await send.send(batch, "deny_first", after)
        commit()
        named()
        return ips(view.keys | {key})

    def static_contents(self, effective: NetworkPolicy) -> Contents:
        return static_contents(effective, name_check=self._cfg.checks_names)

    def refuses_more(self, held: Contents, new: Contents) -> bool:
        return refuses_more(held, new)

    async def apply_policy(
        self,
        txn: StepTxn,
        entry: Entry,
        view: KernelView,
        policy: NetworkPolicy,
        effective: NetworkPolicy,
        contents: Contents,
        kept: Leases | None,
    ) -> None:
        send = self._txn(txn)
        nid, table = entry.nft_id, self._cfg.table
        batch, audit, ranges = self._policy_batch(nid, effective, contents, view)
        if kept is not None:
            batch = batch + dyn_replace(table, nid, kept, ranges=ranges)
        # A host-uid subject's audit mode lets its established flows pass (fleetnft/hostuid.py).
        batch = batch + hostuid.audit_membership(self._cfg, view.uid_keys, effective.audit)
        batch, commit = self.nets.refilled(batch, entry.uid, *_recognised_by(entry, self.nets))
        want = Interception(_named_keys(view), named_ports(effective, self.fixed_ports))
        batch, named = self.named.changed(batch, entry.uid, want)
        after = replace(view, applied=policy, audit=audit, ranges=ranges, contents=contents)
        await send.send(batch, "static_apply", after)
        commit()
        named()

    def _policy_batch(
        self, nid: str, effective: NetworkPolicy, contents: Contents, view: KernelView
    ) -> tuple[NetlinkBatch, bool, bool]:
        """The static sets' swap to ``effective`` (with the audit objects first when it is the
        subject's first audit policy, the range objects first when it is its first policy with
        shared ranges), and whether the subject has audit and range objects after it. Either
        kind is made in the transaction of the policy that needs it, so a lease can only be
        decided onto the hash path (under that policy) once ``dynr`` exists.
        Deny-first content (``applied`` None; every writer of static sets skips such a
        subject, see actionhandler/always.py) is empty, so its first policy is only filled in;
        after that only the sets whose content changes are rewritten, when the view knows what
        they hold."""
        table = self._cfg.table
        make_audit = effective.audit and not view.audit
        make_ranges = needs_range_objects(contents) and not view.ranges
        batch = lazy_objects(
            self._cfg, nid, audit=view.audit, ranges=view.ranges, make_audit=make_audit, make_ranges=make_ranges
        )
        audit, ranges = view.audit or make_audit, view.ranges or make_ranges
        held = view.contents if view.applied is not None else None
        fill = contents_swap(
            table,
            nid,
            contents,
            audit_objects=audit,
            range_objects=ranges,
            known_empty=view.applied is None,
            held=held,
        )
        return batch + fill, audit, ranges

    async def add_keys(self, txn: StepTxn, entry: Entry, binding: Binding, view: KernelView) -> list[IPAddress]:
        send = self._txn(txn)
        subj = _subject_nft(entry.nft_id, binding, self.workers.of(entry.uid))
        keys, commit = self.nets.refilled(
            subject_keys(self._cfg, subj), entry.uid, binding.private_cidr, binding.host_veth
        )
        after = replace(view, keys=view.keys | {(subj.ip, subj.gateway)})
        keys, named = self._follow_keys(keys, entry.uid, after)
        await send.send(keys, "dispatch_update", after)
        commit()
        named()
        # A new address's established flows were never judged by this subject (see deny_first).
        return [] if subj.ip in ips(view.keys) else [subj.ip]

    async def drop_keys(
        self,
        txn: StepTxn,
        entry: Entry,
        view: KernelView,
        keep: Binding | None,
        kept: Keys,
        kept_uid: UidKeys,
        in_use: InUse,
    ) -> None:
        send = self._txn(txn)
        stale, stale_uid = view.keys - kept, view.uid_keys - kept_uid
        ops = self._key_deletes(stale, keep, in_use) + hostuid.key_deletes(self._cfg, stale_uid)
        batch = NetlinkBatch(self._cfg.table, tuple(ops))
        after = replace(view, keys=view.keys & kept, uid_keys=view.uid_keys & kept_uid)
        batch, named = self._follow_keys(batch, entry.uid, after)
        await send.send(batch, "dispatch_update", after)
        named()

    async def remove_all(self, txn: StepTxn, entry: Entry, view: KernelView, in_use: InUse) -> bool:
        if not view.objects and not view.keys and not view.uid_keys:
            txn.save(KernelView())
            self.workers.release(entry.uid)
            return False
        send = self._txn(txn)
        ops = self._key_deletes(view.keys, None, in_use) + hostuid.key_deletes(self._cfg, view.uid_keys)
        if view.objects:
            removal = removal_batch(
                self._cfg, entry.nft_id, None, release_gateway=None, audit=view.audit, ranges=view.ranges
            )
            ops += removal.ops
        removal, commit = self.nets.refilled(NetlinkBatch(self._cfg.table, tuple(ops)), entry.uid, None, None)
        removal, named = self.named.changed(removal, entry.uid, NONE)
        await send.send(removal, "remove", KernelView())
        commit()
        named()
        self.workers.release(entry.uid)
        return True

    def _follow_keys(
        self, batch: NetlinkBatch, uid: str, after: KernelView
    ) -> tuple[NetlinkBatch, Callable[[], None]]:
        """The subject's named-port elements follow its keys (its ports stay those of its policy)."""
        return self.named.changed(batch, uid, self.named.wanted(uid).with_keys(_named_keys(after)))

    def mitm_worker(self, uid: str, binding: Binding | HostBinding) -> int | None:
        if isinstance(binding, HostBinding):
            return uid_worker(binding.slot, self._cfg.mitm_workers)
        return self.workers.peek(uid)

    def resync_batch(
        self, uid: str, nid: str, view: KernelView, effective: NetworkPolicy | None, kept: Leases
    ) -> NetlinkBatch:
        """Everything ``view`` says the subject has, made so in one batch that succeeds on
        either state an unanswered transaction left (see :class:`KernelView`): objects, fixed
        rules exactly once, the set contents of ``effective`` (deny-first when None) with
        ``kept``, the leases the book holds, and every key."""
        table = self._cfg.table
        if not view.objects:
            return NetlinkBatch(table)  # neither state has objects (nor keys, which jump to them)
        if effective is None:
            contents = flush_subject_sets(table, nid, audit=view.audit, ranges=view.ranges)
        else:
            swap = policy_swap(
                table,
                nid,
                effective,
                audit_objects=view.audit,
                range_objects=view.ranges,
                name_check=self._cfg.checks_names,
            )
            contents = swap + dyn_replace(table, nid, kept, ranges=view.ranges)
        worker = self.workers.of(uid) if view.keys else 0
        keys = [SubjectNft(nid, ip, gw, worker) for ip, gw in sorted(view.keys, key=str)]
        audit = effective is not None and effective.audit
        uid_keys = hostuid.resync_keys(self._cfg, nid, view, audit)
        return subject_resync(self._cfg, nid, keys, contents, audit=view.audit, ranges=view.ranges) + uid_keys

    def _key_deletes(self, stale: Keys, keep: Binding | None, in_use: InUse) -> list[Op]:
        """Deletions for stale dispatch keys: each map element and gateway exactly once."""
        ops: list[Op] = []
        keep_ip = keep.ip if keep is not None else None
        for ip in ips(stale):
            if ip != keep_ip:
                ops += dispatch_deletes(self._cfg, ip, release_gateway=None)
        for gw in sorted({k[1] for k in stale}, key=str):
            if keep is not None and keep.gateway == gw:
                continue
            if not in_use(gw):
                ops.append(gateway_release(gw))
        return ops

def _named_keys(view: KernelView) -> frozenset[Key]:
    """Where a subject's named-port elements go: its source addresses and its host uids."""
    keys = {address_key(ip) for ip in ips(view.keys)}
    keys |= {(hostuid.UID_MITM_PORTS, uid_key(host_uid)) for host_uid, _ in view.uid_keys}
    return frozenset(keys)


def _recognised_by(entry: Entry, nets: SandboxNets) -> tuple[Network | None, str | None]:
    """The privateCidr and hostVeth the subject's binding names (none for a host-uid subject)."""
    if isinstance(entry.binding, HostBinding):
        return None, None
    if entry.binding is not None:
        return entry.binding.private_cidr, entry.binding.host_veth
    return nets.held.get(entry.uid), nets.ifaces.get(entry.uid)


def _subject_nft(nid: str, binding: Binding, worker: int) -> SubjectNft:
    if binding.gateway is None:
        raise Refused("attachment.network.gateway is required for the DNS redirect")
    return SubjectNft(nid, binding.ip, binding.gateway, worker)
