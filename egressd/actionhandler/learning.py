"""The fleet's DNS side: who asks, and the DNS-to-kernel callback that learns answers.

:meth:`DnsLearning.asker` and :meth:`DnsLearning.learn` are the two callables the composition
root hands the DNS proxy. The decisions (which addresses of an answer may enter the dyn sets,
which leases survive a narrowing, whether the MITM may trust an address for a host) are the
lease book's (subject/leases.py) and the procedure around them is the subject engine's
(:class:`egressd.engine.subjects.SubjectEngine`, over the fleet's ruleset backend), both shared
with the sidecar; this module supplies the fleet's guards (the subject's lock, its state and
fence, closing subjects, the kernel lock) around the engine's calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from egressd.actionhandler.policies import EffectivePolicies
from egressd.actionhandler.shared import Shared
from egressd.addr import IPAddress, unmap_ip
from egressd.engine.groupcommit import GroupCommit
from egressd.engine.subjects import SubjectEngine
from egressd.policy import IpSets, NetworkPolicy
from egressd.policy.namecheck import NameVerdict, Wire
from egressd.subject.leases import LeaseBook, Narrowed
from egressd.subject.model import Asker, Fence
from egressd.subject.registry import Entry, HostBinding, State


@dataclass(frozen=True, slots=True)
class LearnAsk:
    """One answer waiting to be learned: the subject's fence when it was asked, the addresses
    with their lease seconds, the question (None: the connection refresh)."""

    fence: Fence
    leases: list[tuple[IPAddress, int]]
    name: str | None


class DnsLearning:
    def __init__(
        self,
        shared: Shared,
        policies: EffectivePolicies,
        closing: Callable[[str], bool],
        subjects: SubjectEngine,
    ) -> None:
        self._shared = shared
        self._policies = policies
        # A subject whose revert, rebind or removal the kernel refused (14.6) is answered
        # as denying, learns nothing and verifies nothing.
        self._closing = closing
        self.subjects = subjects
        # Each subject's DNS leases (the engine's books): the refresh mirror, the lease cap,
        # narrowing on policy changes, flow cuts and the MITM's check.
        self.leases: dict[str, LeaseBook] = subjects.books
        # Concurrent answers of one subject go to the kernel together (docs/reference/behaviour.md
        # §14: each reply still waits for the transaction that carries its addresses).
        self.group: GroupCommit[str, LearnAsk, list[IPAddress]] = GroupCommit(
            self._commit, guard=shared.locks.hold, weight=lambda ask: len(ask.leases)
        )

    def asker(self, source_ip: IPAddress) -> Asker | None:
        """Hot path for every DNS query: a map lookup and a cached effective policy."""
        return self._asker_of(self._shared.registry.resolve(source_ip))

    def asker_for_slot(self, slot: int) -> Asker | None:
        """The asker behind a host-uid subject's DNS port (docs/reference/behaviour.md §17): the port names it."""
        return self._asker_of(self._shared.registry.resolve_slot(slot))

    def host_uid_subjects(self) -> dict[int, str]:
        """Host uid -> sandbox uid of every host-uid subject (the connection refresh's view)."""
        return {
            e.binding.host_uid: e.uid for e in self._shared.registry if isinstance(e.binding, HostBinding)
        }

    def _asker_of(self, entry: Entry | None) -> Asker | None:
        if entry is None:
            return None
        if self._closing(entry.uid):
            return Asker(entry.uid, entry.fence, None)  # being closed: answered as denying
        return Asker(entry.uid, entry.fence, self._policies.effective_for(entry))

    def uid_for(self, source_ip: IPAddress) -> str | None:
        entry = self._shared.registry.resolve(source_ip)
        return entry.uid if entry is not None else None

    async def renew_leases(self, uid: str, ips: list[IPAddress], seconds: int) -> None:
        """Connection refresh: re-add still-used DNS leases (one transaction per subject)."""
        entry = self._shared.registry.get(uid)
        if entry is not None:
            await self.learn(uid, entry.fence, [(ip, seconds) for ip in ips])

    async def learn(
        self, uid: str, fence: Fence, leases: list[tuple[IPAddress, int]], name: str | None = None
    ) -> list[IPAddress]:
        """Put DNS-learned addresses into the subject's dyn sets before the answer is sent;
        return those the kernel now holds (the reply carries only these, docs/reference/behaviour.md §14.4).

        Under the subject's lock and decided again there, against the policy in force now
        (docs/reference/behaviour.md §14.1): an answer that arrives after a revert, rebind, removal or a change
        that denies its name must never reopen it. ``name`` None is the connection refresh:
        it renews only addresses that a still-allowed name taught.

        Group commit: answers of ``uid`` that arrive while its transaction runs wait and go
        together in the next one; each caller is released only once the transaction that
        carries its addresses ended (its failure fails every caller of the batch, as each would
        have failed on its own). A caller that stops waiting (the DNS proxy's bound) does not
        take its answer out of the batch: the book always records what the kernel took.
        """
        return await self.group.submit(uid, LearnAsk(fence, leases, name))

    async def _commit(self, uid: str, asks: list[LearnAsk]) -> list[list[IPAddress]]:
        """One batch of ``uid``'s answers, under the subject's lock (the group's guard)."""
        out: list[list[IPAddress]] = [[] for _ in asks]
        shared = self._shared
        entry = shared.registry.get(uid)
        if entry is None or entry.state is not State.ACTIVE:
            return out
        if self._closing(uid) or not shared.registry.kernel(uid).rules:
            return out
        # An answer asked under an older fence (a rebind since) learns nothing.
        mine = [i for i, ask in enumerate(asks) if ask.fence == entry.fence]
        if not mine:
            return out
        async with shared.kernel_lock:
            effective = self._policies.effective_for(entry)  # always-rules change under this lock
            if effective is None:
                return out
            # An unanswered, timed-out or cancelled step (the DNS proxy's bound) may still be
            # committed by the kernel thread: the engine records such leases too. After an
            # unanswered policy step the kernel may hold the new policy's shared ranges while
            # ``effective`` is the old one: no lease takes the range hash path until a step
            # settles it (egressd.subject.leases.admissible_many).
            settled = not shared.registry.kernel(uid).unsure
            learned = await self.subjects.learn_many(
                uid, effective, [(asks[i].leases, asks[i].name) for i in mine], hash_ranges=settled
            )
        for i, ips in zip(mine, learned, strict=True):
            out[i] = ips
        return out

    def narrowed(self, uid: str, effective: NetworkPolicy) -> Narrowed | None:
        """The subject's leases under a new effective policy (None: it has none)."""
        return self.subjects.narrowed(uid, effective)

    def destination_verified(self, source_ip: IPAddress, host: str, dst: IPAddress) -> bool:
        """May the MITM send ``host``'s credentials to ``dst`` for this sandbox? The lease
        book's rule (:func:`egressd.engine.learning.verified`), for the active
        subject behind ``source_ip`` only."""
        return self._verified(self._shared.registry.resolve(source_ip), host, dst)

    def destination_verified_port(self, port: int, host: str, dst: IPAddress) -> bool:
        """The same for a host-uid subject, named by its MITM port (docs/reference/behaviour.md §17)."""
        slot = self._shared.table.uids.slot_of_mitm_port(port)
        return slot is not None and self._verified(self._shared.registry.resolve_slot(slot), host, dst)

    def destination_verified_until(self, source_ip: IPAddress, host: str, dst: IPAddress) -> float:
        """:meth:`destination_verified` with its deadline (the MITM's ``_active`` answers from memory
        until then, absent a narrowing; 0.0: not verified)."""
        return self._verified_until(self._shared.registry.resolve(source_ip), host, dst)

    def destination_verified_until_port(self, port: int, host: str, dst: IPAddress) -> float:
        slot = self._shared.table.uids.slot_of_mitm_port(port)
        return (
            self._verified_until(self._shared.registry.resolve_slot(slot), host, dst)
            if slot is not None
            else 0.0
        )

    def check_name(
        self,
        source_ip: IPAddress,
        listen_port: int | None,
        wire: Wire,
        name: str | None,
        dst: IPAddress,
        port: int,
    ) -> tuple[str | None, NameVerdict | None]:
        """May the active subject behind ``source_ip`` (or, for a host-uid subject, behind its
        MITM port ``listen_port``) ask for ``name`` on a connection to ``dst``:``port``
        (docs/reference/behaviour.md §18)? (uid, verdict); (None, None) when there is no active subject
        there (refused by the caller)."""
        if listen_port is not None:
            slot = self._shared.table.uids.slot_of_mitm_port(listen_port)
            entry = self._shared.registry.resolve_slot(slot) if slot is not None else None
        else:
            entry = self._shared.registry.resolve(source_ip)
        held = self._verifying(entry)
        if entry is None or held is None:
            return None, None
        effective = self._policies.effective_for(entry)
        if effective is None or held[1] is None:
            return None, None
        verdict = self.subjects.check_name(
            entry.uid, effective, held[1], wire=wire, name=name, dst=unmap_ip(dst), port=port
        )
        return entry.uid, verdict

    def request_policy(
        self, source_ip: IPAddress, listen_port: int | None
    ) -> tuple[str, NetworkPolicy] | None:
        """The active subject behind ``source_ip`` (or its host-uid MITM port) and its effective
        policy, for the MITM's request rules (docs/reference/behaviour.md §19); None: no active
        subject there (the MITM refuses its requests)."""
        if listen_port is not None:
            slot = self._shared.table.uids.slot_of_mitm_port(listen_port)
            entry = self._shared.registry.resolve_slot(slot) if slot is not None else None
        else:
            entry = self._shared.registry.resolve(source_ip)
        if entry is None or entry.state is not State.ACTIVE or self._closing(entry.uid):
            return None
        effective = self._policies.effective_for(entry)
        return (entry.uid, effective) if effective is not None else None

    def _verified(self, entry: Entry | None, host: str, dst: IPAddress) -> bool:
        held = self._verifying(entry)
        return held is not None and self.subjects.verified(*held, host.strip(), unmap_ip(dst))

    def _verified_until(self, entry: Entry | None, host: str, dst: IPAddress) -> float:
        held = self._verifying(entry)
        return self.subjects.verified_until(*held, host.strip(), unmap_ip(dst)) if held else 0.0

    def _verifying(self, entry: Entry | None) -> tuple[str, IpSets | None] | None:
        """The uid and IP sets an active subject's destinations are verified against (None:
        nothing is verified for it: absent, not active or being closed)."""
        if entry is None or entry.state is not State.ACTIVE or self._closing(entry.uid):
            return None
        effective = self._policies.effective_for(entry)
        sets = self._policies.ip_sets_of(entry.uid, effective) if effective is not None else None
        return entry.uid, sets

    def forget(self, uid: str) -> None:
        self.subjects.forget(uid)
