"""The fenced subject registry (docs/reference/actions-protocol.md §2) as a pure state machine plus an index.

:func:`plan_set_binding`, :func:`plan_data_plane_ready`, :func:`plan_hook_fence` and
:func:`plan_remove` decide, without I/O,
what one action does to one subject: the kernel steps to run (in order), the registry entry
to commit when all of them succeed, and the entry to keep when one fails. The control plane
runs the steps ("kernel first, registry second") under the subject's lock.

:class:`Registry` holds the committed entries and the hot-path indexes: source IP -> subject
for network sandboxes, host uid and port slot -> subject for host-uid sandboxes (docs/reference/behaviour.md §17).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from ipaddress import IPv4Network, IPv6Network

from egressd.addr import IPAddress
from egressd.feed import Feed, SubjectChanged
from egressd.policy import NetworkPolicy
from egressd.subject.model import Fence, Subject, nft_id, subject_for_uid

#: (set kind, its prefixes) for each static set of a subject (fleetnft.contents.static_contents).
#: The port-scoped sets (docs/reference/behaviour.md §18) hold (prefix, protocol, first port, last
#: port) elements instead, and the leases' shared ranges (egressd.subject.ranges) (protocol,
#: first port, last port) elements.
StaticContents = tuple[
    tuple[
        str,
        tuple[IPv4Network | IPv6Network, ...]
        | tuple[tuple[IPv4Network | IPv6Network, str, int, int], ...]
        | tuple[tuple[str, int, int], ...],
    ],
    ...,
]


class State(enum.StrEnum):
    ABSENT = "absent"
    DENYING = "denying"
    ACTIVE = "active"


@dataclass(frozen=True, slots=True)
class Binding:
    """Network identity of an attachment: the dispatch key and the DNS/MITM gateway."""

    ip: IPAddress
    gateway: IPAddress | None
    # attachment.network.privateCidr: every address in it counts as a sandbox (14.2). Not part
    # of the dispatch identity: a changed CIDR alone is no re-key (no keys to move, no flows
    # to cut); the control plane refreshes the kernel's union with the next transaction.
    private_cidr: IPv4Network | IPv6Network | None = field(default=None, compare=False)
    # attachment.network.hostVeth: the pod-side interface its packets arrive on (§20.2); like
    # the CIDR, kept in the kernel's set of sandbox-facing interfaces, no part of the identity.
    host_veth: str | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class HostBinding:
    """Identity of a host-uid sandbox (docs/reference/behaviour.md §17): its processes' host uid, the dispatch key
    (``meta skuid``), and the slot that names its own DNS and MITM ports. The slot is the
    control plane's choice, kept for the subject's life (a rebind keeps it)."""

    host_uid: int
    slot: int


AnyBinding = Binding | HostBinding


@dataclass(frozen=True, slots=True)
class KernelView:
    """What this subject has in the kernel right now, as far as the daemon applied it.

    ``keys`` are the (source ip, gateway) pairs present in the dispatch maps; more than one
    only between the steps of a re-key. ``objects`` says whether chains and sets exist,
    ``rules`` whether the subject's fixed rules were added to them, ``applied`` which user
    policy the sets currently enforce (None: deny-first content).
    """

    objects: bool = False
    keys: frozenset[tuple[IPAddress, IPAddress]] = frozenset()
    rules: bool = False
    applied: NetworkPolicy | None = None  # the user policy whose content is in the sets
    # A transaction's outcome is unknown (its answer never came): the kernel holds either
    # what it held before or what the transaction would have made. ``objects`` and ``keys``
    # then cover both, ``rules`` is True only if both have them, ``applied`` is what the
    # registry still claims; the subject's next transaction first re-creates exactly this.
    unsure: bool = False
    # (host uid, slot) pairs in the uid maps (host-uid subjects), like ``keys``.
    uid_keys: frozenset[tuple[int, int]] = frozenset()
    # The audit sets and rules exist (made by the subject's first audit policy, kept until
    # its removal); when ``unsure``, either state may have them.
    audit: bool = False
    # The range objects (dynr, dynrports and the rules that read them) exist, made by the
    # subject's first policy with shared port ranges (egressd.subject.ranges) and kept until
    # its removal, like ``audit``; when ``unsure``, either state may have them.
    ranges: bool = False
    # What the static sets hold, (set kind, prefixes) per set, as written by the last answered
    # transaction that wrote them (an in-place swap then rewrites only the sets that change).
    # None: not known for certain, and the next swap rewrites every set. Only meaningful
    # while ``applied`` is not None.
    contents: StaticContents | None = None


@dataclass(frozen=True, slots=True)
class Entry:
    """One registered subject. Never holds the raw binding input."""

    uid: str
    fence: Fence
    state: State
    binding: AnyBinding | None
    spec_generation: int = 0
    pending: NetworkPolicy | None = None  # user policy waiting for data-plane-ready
    policy: NetworkPolicy | None = None  # user policy in force (active only)

    @property
    def subject(self) -> Subject:
        return subject_for_uid(self.uid)

    @property
    def nft_id(self) -> str:
        return nft_id(self.subject)


# Kernel steps, executed in order by the control plane.
@dataclass(frozen=True, slots=True)
class InstallDenyFirst:
    """Declare + empty the subject's objects, drop-all content, dispatch entries for ``binding``."""

    binding: AnyBinding


@dataclass(frozen=True, slots=True)
class ApplyPolicy:
    policy: NetworkPolicy


@dataclass(frozen=True, slots=True)
class DropStaleKeys:
    """Remove every dispatch key except the one of ``keep`` (after a re-key)."""

    keep: AnyBinding | None


@dataclass(frozen=True, slots=True)
class AddKeys:
    """Point ``binding`` at the subject's existing chains (re-key of an active subject)."""

    binding: AnyBinding


@dataclass(frozen=True, slots=True)
class RemoveAll:
    pass


Step = InstallDenyFirst | ApplyPolicy | DropStaleKeys | AddKeys | RemoveAll


class PlanOutcome(enum.StrEnum):
    """What executing a plan amounts to: its steps run (OK), 200 at once (NOOP), or 409."""

    OK = "ok"
    NOOP = "noop"  # 200 without touching anything
    CONFLICT = "conflict"  # 409


@dataclass(frozen=True, slots=True)
class Plan:
    outcome: PlanOutcome
    reason: str = ""
    steps: tuple[Step, ...] = ()
    on_success: Entry | None = None  # None = unregister
    on_failure: Entry | None = None  # None = stay absent
    rebind: bool = False  # a new fence replaced an old one (drop per-subject extras)
    removed: bool = False


@dataclass(frozen=True, slots=True)
class SetBindingRequest:
    uid: str
    fence: Fence
    spec_generation: int
    binding: AnyBinding | None
    policy: NetworkPolicy | None  # parsed input; None = the JSON null


def _conflict(reason: str) -> Plan:
    return Plan(PlanOutcome.CONFLICT, reason)


def plan_set_binding(entry: Entry | None, req: SetBindingRequest) -> Plan:
    """SET_BINDING (§2 table, §3). ``req.policy`` has already been parsed successfully."""
    if entry is None:
        if req.binding is None:
            # PROPOSED: null for an absent subject without attachment is a no-op.
            return Plan(PlanOutcome.NOOP, "nothing bound")
        new = Entry(req.uid, req.fence, State.DENYING, req.binding, req.spec_generation, pending=req.policy)
        failed = replace(new, pending=None)
        return Plan(PlanOutcome.OK, steps=(InstallDenyFirst(req.binding),), on_success=new, on_failure=failed)

    binding = req.binding or entry.binding
    if entry.fence != req.fence:
        # Rebind: nothing of the old attachment survives, not even on failure.
        new = Entry(req.uid, req.fence, State.DENYING, binding, req.spec_generation, pending=req.policy)
        failed = replace(new, pending=None)
        steps: tuple[Step, ...] = ()
        steps = (InstallDenyFirst(binding), DropStaleKeys(binding)) if binding is not None else (RemoveAll(),)
        return Plan(
            PlanOutcome.OK,
            steps=steps,
            on_success=new,
            on_failure=failed,
            rebind=True,
        )

    rekey = binding is not None and binding != entry.binding
    base = replace(entry, binding=binding, spec_generation=req.spec_generation)
    if entry.state is State.ACTIVE:
        if req.policy is None:
            # Revert: kernel to deny-first first, then the registry forgets the policy.
            assert binding is not None
            steps = (InstallDenyFirst(binding), DropStaleKeys(binding))
            new = replace(base, state=State.DENYING, policy=None, pending=None)
            return Plan(
                PlanOutcome.OK, steps=steps, on_success=new, on_failure=replace(new, binding=entry.binding)
            )
        steps = ()
        if rekey:
            assert binding is not None
            # Old key out before the new one in: every intermediate state is closed.
            steps = (DropStaleKeys(None), AddKeys(binding))
        steps = (*steps, ApplyPolicy(req.policy))
        new = replace(base, policy=req.policy)
        # A failed in-place apply keeps the old policy (kernel first, registry second).
        return Plan(
            PlanOutcome.OK,
            steps=steps,
            on_success=new,
            on_failure=replace(entry, spec_generation=req.spec_generation),
        )

    # Denying, same fence: idempotent deny-first re-run; the latest input is pending.
    assert binding is not None
    # A failed re-run keeps the previous pending policy: the new input was never accepted.
    return Plan(
        PlanOutcome.OK,
        steps=(InstallDenyFirst(binding), DropStaleKeys(binding)),
        on_success=replace(base, pending=req.policy),
        on_failure=base,
    )


def plan_data_plane_ready(entry: Entry | None, fence: Fence, *, kernel_objects: bool) -> Plan:
    if entry is None:
        return _conflict("subject not registered")
    if entry.fence != fence:
        return _conflict("stale fence")
    if entry.pending is None:
        if entry.state is State.ACTIVE:
            return Plan(PlanOutcome.NOOP, "already active")  # PROPOSED: idempotent retry
        return _conflict("no pending policy")
    steps: tuple[Step, ...] = (ApplyPolicy(entry.pending),)
    if not kernel_objects and entry.binding is not None:
        # Deny-first never made it into the kernel: activation must not skip it.
        steps = (InstallDenyFirst(entry.binding), *steps)
    new = replace(entry, state=State.ACTIVE, policy=entry.pending, pending=None)
    # Failure keeps the pending policy so the retried hook succeeds.
    return Plan(PlanOutcome.OK, steps=steps, on_success=new, on_failure=entry)


def plan_policy_change(entry: Entry, policy: NetworkPolicy) -> Plan:
    """In-place policy change of an active subject (a proxy-route /policy write): a failed
    apply keeps the old policy (kernel first, registry second)."""
    return Plan(
        PlanOutcome.OK,
        steps=(ApplyPolicy(policy),),
        on_success=replace(entry, policy=policy),
        on_failure=entry,
    )


def plan_hook_fence(entry: Entry | None, fence: Fence) -> Plan:
    """runtime-ready: fenced, otherwise a no-op."""
    if entry is None:
        return _conflict("subject not registered")
    if entry.fence != fence:
        return _conflict("stale fence")
    return Plan(PlanOutcome.NOOP, "runtime-ready")


def plan_remove(entry: Entry | None, fence: Fence) -> Plan:
    if entry is None:
        return Plan(PlanOutcome.NOOP, "not registered", removed=True)
    if entry.fence != fence:
        return Plan(PlanOutcome.NOOP, "stale fence ignored")
    # Until the kernel removal succeeds the subject stays registered, so a retry resumes.
    return Plan(PlanOutcome.OK, steps=(RemoveAll(),), on_success=None, on_failure=entry, removed=True)


class RegistryConflict(Exception):
    pass


_EMPTY_KERNEL = KernelView()


def _held(view: KernelView) -> set[tuple[str, object]]:
    """The index keys of what a kernel view holds (Registry._holders)."""
    out: set[tuple[str, object]] = {("ip", ip) for ip, _ in view.keys}
    out |= {("gw", gw) for _, gw in view.keys}
    out |= {("host_uid", host_uid) for host_uid, _ in view.uid_keys}
    return out


class Registry:
    """Committed entries, indexed by uid, by source IP (hot path) and by nft id.

    It also records what each subject has in the kernel (:class:`KernelView`), updated after
    every successful transaction, independently of the entry: a multi-step plan can fail
    half-way, and the next deletion must know exactly what exists.
    """

    def __init__(self, feed: Feed | None = None) -> None:
        # Where a committed or dropped entry is announced (egressd.feed); a test's own by default.
        self.feed = feed if feed is not None else Feed()
        self._by_uid: dict[str, Entry] = {}
        self._kernel: dict[str, KernelView] = {}
        self._by_ip: dict[IPAddress, str] = {}
        self._by_nft_id: dict[str, str] = {}
        self._by_host_uid: dict[int, str] = {}
        self._by_slot: dict[int, str] = {}
        # Which uids' kernel views hold a source ip / gateway / host uid: the claim checks of
        # every SET_BINDING and the gateway release of a removal ask this, at any fleet size.
        self._holders: dict[tuple[str, object], set[str]] = {}

    def get(self, uid: str) -> Entry | None:
        return self._by_uid.get(uid)

    def resolve(self, source_ip: IPAddress) -> Entry | None:
        """Hot path: source IP -> entry, a plain map lookup."""
        uid = self._by_ip.get(source_ip)
        return None if uid is None else self._by_uid.get(uid)

    def resolve_host_uid(self, host_uid: int) -> Entry | None:
        uid = self._by_host_uid.get(host_uid)
        return None if uid is None else self._by_uid.get(uid)

    def resolve_slot(self, slot: int) -> Entry | None:
        """Hot path of a host-uid subject's DNS and MITM ports: slot -> entry."""
        uid = self._by_slot.get(slot)
        return None if uid is None else self._by_uid.get(uid)

    def slots_in_use(self, *, excluding: str | None = None) -> set[int]:
        """Slots a committed entry names or some subject's uid keys still hold in the kernel."""
        used = {slot for slot, uid in self._by_slot.items() if uid != excluding}
        for uid, view in self._kernel.items():
            if uid != excluding:
                used |= {slot for _, slot in view.uid_keys}
        return used

    def __iter__(self) -> Iterator[Entry]:
        return iter(list(self._by_uid.values()))

    def __len__(self) -> int:
        return len(self._by_uid)

    def check_claims(self, uid: str, binding: AnyBinding | None) -> str | None:
        """Why ``uid`` cannot take these keys (409), or None."""
        other = self._by_nft_id.get(nft_id(subject_for_uid(uid)))
        if other is not None and other != uid:
            return f"subject id collides with registered sandbox {other!r}"
        if isinstance(binding, HostBinding):
            owner = self._by_host_uid.get(binding.host_uid)
            if owner is not None and owner != uid:
                return f"host uid {binding.host_uid} already dispatches to another sandbox"
            if self.host_uid_in_use(binding.host_uid, excluding=uid):
                return f"host uid {binding.host_uid} is still installed for another sandbox"
        elif binding is not None:
            owner = self._by_ip.get(binding.ip)
            if owner is not None and owner != uid:
                return f"ip {binding.ip} already dispatches to another sandbox"
            if self.ip_in_use(binding.ip, excluding=uid):
                return f"ip {binding.ip} is still installed for another sandbox"
        return None

    def _unindex(self, entry: Entry) -> None:
        uid, binding = entry.uid, entry.binding
        if isinstance(binding, HostBinding):
            if self._by_host_uid.get(binding.host_uid) == uid:
                del self._by_host_uid[binding.host_uid]
            if self._by_slot.get(binding.slot) == uid:
                del self._by_slot[binding.slot]
        elif binding is not None and self._by_ip.get(binding.ip) == uid:
            del self._by_ip[binding.ip]

    def put(self, entry: Entry) -> None:
        old = self._by_uid.get(entry.uid)
        if old is not None:
            self._unindex(old)
        self._by_uid[entry.uid] = entry
        self._by_nft_id[entry.nft_id] = entry.uid
        if isinstance(entry.binding, HostBinding):
            self._by_host_uid[entry.binding.host_uid] = entry.uid
            self._by_slot[entry.binding.slot] = entry.uid
        elif entry.binding is not None:
            self._by_ip[entry.binding.ip] = entry.uid
        # A policy, state or binding change: what the MITM may remember of it is void.
        self.feed.publish(SubjectChanged())

    def drop(self, uid: str) -> None:
        old = self._by_uid.pop(uid, None)
        if old is None:
            return
        self._unindex(old)
        if self._by_nft_id.get(old.nft_id) == uid:
            del self._by_nft_id[old.nft_id]
        self.feed.publish(SubjectChanged())

    def kernel(self, uid: str) -> KernelView:
        return self._kernel.get(uid, _EMPTY_KERNEL)

    def set_kernel(self, uid: str, view: KernelView) -> None:
        old = self._kernel.get(uid, _EMPTY_KERNEL)
        if (old.keys, old.uid_keys) != (view.keys, view.uid_keys):
            before, after = _held(old), _held(view)
            for key in before - after:
                holders = self._holders[key]
                holders.discard(uid)
                if not holders:
                    del self._holders[key]
            for key in after - before:
                self._holders.setdefault(key, set()).add(uid)
        if view == _EMPTY_KERNEL:
            self._kernel.pop(uid, None)
        else:
            self._kernel[uid] = view

    def _held_by_other(self, key: tuple[str, object], excluding: str) -> bool:
        holders = self._holders.get(key)
        return holders is not None and bool(holders - {excluding})

    def gateway_in_use(self, gateway: IPAddress, *, excluding: str) -> bool:
        return self._held_by_other(("gw", gateway), excluding)

    def host_uid_in_use(self, host_uid: int, *, excluding: str) -> bool:
        return self._held_by_other(("host_uid", host_uid), excluding)

    def ip_in_use(self, ip: IPAddress, *, excluding: str) -> bool:
        return self._held_by_other(("ip", ip), excluding)

    def counts(self) -> dict[State, int]:
        out = {State.DENYING: 0, State.ACTIVE: 0}
        for e in self._by_uid.values():
            out[e.state] += 1
        return out
