"""What the fleet's subject engine needs from the kernel side of a plan: the protocols.

The engine (``egressd.actionhandler``) decides what each plan step does to a subject (which
leases survive, which flows to cut, which DNS ports listen, what the registry records); the
kernel side builds the per-subject objects of each step and sends them in one transaction, and
reads back what the kernel holds. The fleet's implementation is
:class:`egressd.fleetnft.plankernel.FleetPlanKernel`, built by the profile's composition root
(``egressd.fleet.run``) and passed to :class:`egressd.actionhandler.control.ControlPlane`.

A transaction of the kernel side fails with :mod:`egressd.engine.errors`' two errors, or with
:class:`Refused` when it will not send a step as asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from egressd.addr import IPAddress
from egressd.engine.backend import RulesetBackend
from egressd.policy import NetworkPolicy
from egressd.subject.hostuid import UidPorts
from egressd.subject.leases import Grant
from egressd.subject.registry import Binding, Entry, HostBinding, KernelView, StaticContents

Keys = frozenset[tuple[IPAddress, IPAddress]]  # (source address, gateway) dispatch keys
UidKeys = frozenset[tuple[int, int]]  # (host uid, slot)
Leases = Sequence[Grant]  # (address, seconds left, scope) of a subject's dyn sets
InUse = Callable[[IPAddress], bool]  # is this gateway still used by another subject?


class Refused(Exception):
    """A step egressd will not send: the kernel could not take it as asked."""


def in_doubt(before: KernelView, after: KernelView) -> KernelView:
    """What the kernel may hold when a transaction from ``before`` to ``after`` went
    unanswered: anything either state has (so a deletion finds it), rules only if both
    have them. The set contents to re-sync to are the registry's claim (``before``), except
    after a closing step (deny-first, removal): then deny-first, so nothing that re-applies
    the recorded policy (an always-rules reload) reopens what may already be closed."""
    return KernelView(
        objects=before.objects or after.objects,
        keys=before.keys | after.keys,
        rules=before.rules and after.rules,
        applied=None if after.applied is None else before.applied,
        unsure=True,
        uid_keys=before.uid_keys | after.uid_keys,
        audit=before.audit or after.audit,
        ranges=before.ranges or after.ranges,
    )


def ips(keys: Keys) -> list[IPAddress]:
    return sorted({k[0] for k in keys}, key=str)


@dataclass(frozen=True, slots=True)
class Resync:
    """After an unanswered transaction: what the subject's next transaction first makes the
    kernel hold, exactly ``view`` (its objects, rules, keys, and the set contents of
    ``effective``, the effective policy of ``view.applied`` (None: deny-first), with ``kept``,
    the leases its book holds under it)."""

    uid: str
    nft_id: str
    view: KernelView
    effective: NetworkPolicy | None
    kept: Leases


@dataclass(slots=True)
class StepTxn:
    """One plan step's transaction as the engine hands it to the kernel side: ``doubt`` is what
    the kernel may hold if it goes unanswered, ``save`` records in the registry what the kernel
    holds after it (or may hold), and ``resync`` goes first in it."""

    doubt: KernelView
    save: Callable[[KernelView], None]
    resync: Resync | None = None


class TableKnobs(Protocol):
    """The fleet-wide knobs the engine reads (the fleet's TableConfig has them)."""

    @property
    def uids(self) -> UidPorts: ...

    @property
    def own_uid(self) -> int | None: ...

    @property
    def mitm(self) -> bool: ...

    @property
    def mitm_workers(self) -> int: ...


class PlanSteps(Protocol):
    """Each plan step's kernel objects, built and sent in ONE transaction through ``txn``
    (callers hold the kernel lock). Each raises RulesetRefused, RulesetUncertain or Refused."""

    async def reset_table(self) -> None:
        """The table replaced by the deny-all header in one transaction (start-up)."""
        ...

    async def uid_deny_first(self, txn: StepTxn, entry: Entry, host: HostBinding, view: KernelView) -> None:
        """A host-uid subject's deny-first: its objects, or every set emptied, and its uid key."""
        ...

    async def uid_add_keys(
        self, txn: StepTxn, entry: Entry, host: HostBinding, view: KernelView, *, audit: bool
    ) -> None:
        """Point a host uid at an existing subject's chains (``audit``: its policy audits)."""
        ...

    async def deny_first(self, txn: StepTxn, entry: Entry, binding: Binding, view: KernelView) -> list[IPAddress]:
        """A network subject's deny-first; returns the sources whose flows to cut."""
        ...

    def static_contents(self, effective: NetworkPolicy) -> StaticContents:
        """What ``effective`` puts in a subject's static sets."""
        ...

    def refuses_more(self, held: StaticContents, new: StaticContents) -> bool:
        """May static sets going from ``held`` to ``new`` refuse an address ``held`` accepted?"""
        ...

    async def apply_policy(
        self,
        txn: StepTxn,
        entry: Entry,
        view: KernelView,
        policy: NetworkPolicy,
        effective: NetworkPolicy,
        contents: StaticContents,
        kept: Leases | None,
    ) -> None:
        """The static sets swapped to ``contents`` (the user's ``policy``, ``effective`` with the
        always-rules); ``kept``, when not None, replaces the dyn sets in the same transaction."""
        ...

    async def add_keys(self, txn: StepTxn, entry: Entry, binding: Binding, view: KernelView) -> list[IPAddress]:
        """A new dispatch key for an existing subject; returns the sources whose flows to cut."""
        ...

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
        """Every key of ``view`` but the ``kept`` and ``kept_uid`` ones deleted (a gateway released unless
        ``keep`` names it or another subject uses it: ``in_use``)."""
        ...

    async def remove_all(
        self, txn: StepTxn, entry: Entry, view: KernelView, in_use: InUse
    ) -> bool:
        """Everything of the subject deleted; False when the kernel held nothing of it."""
        ...

    def mitm_worker(self, uid: str, binding: Binding | HostBinding) -> int | None:
        """The MITM worker the subject's intercepted connections go to (None: none yet)."""
        ...


class ContentsSwap(Protocol):
    """Many subjects' static and dyn sets re-filled in ONE transaction (an always-rules reload)."""

    def add(
        self,
        nft_id: str,
        contents: StaticContents,
        *,
        audit_objects: bool,
        range_objects: bool,
        kept: Leases,
        unsure: bool = False,
    ) -> None: ...

    def __bool__(self) -> bool: ...

    async def send(self) -> None:
        """Raises RulesetRefused (nothing applied), RulesetUncertain or anything else (unknown)."""
        ...


class KernelReader(Protocol):
    """What the kernel itself holds, read back for operators (one dump per set)."""

    async def dispatched(self, source: IPAddress | int) -> bool:
        """Whether the dispatch map holds the source (its uid map for a host uid, an ``int``)."""
        ...

    async def covering(self, nft_id: str, target: IPAddress) -> list[dict[str, Any]]:
        """Which of the subject's sets cover ``target`` (set, element, a lease's expiresInS)."""
        ...

    def rules_per_subject(self, *, audit: bool, ranges: bool) -> int:
        """How many fixed rules one installed subject has."""
        ...


class PlanKernel(Protocol):
    """The fleet's kernel side, one for the control plane."""

    @property
    def table(self) -> TableKnobs: ...

    @property
    def steps(self) -> PlanSteps: ...

    @property
    def reader(self) -> KernelReader: ...

    @property
    def backend(self) -> RulesetBackend:
        """The ruleset backend the subject engine (egressd.engine.subjects) learns through."""
        ...

    def contents_swap(self) -> ContentsSwap: ...
