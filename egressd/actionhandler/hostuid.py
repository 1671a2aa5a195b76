"""Host-uid subjects in the action handling (docs/behaviour.md §17): their binding, slots and DNS ports.

A host-uid sandbox is keyed by its processes' host uid (``attachment.process.uid``) and gets a
*slot*, which names its own DNS port (and, with the MITM, its MITM port). Its kernel objects,
rules and set contents are a network subject's; only its keys differ: uid map elements instead
of address ones (the kernel side builds them: fleetnft/hostuid.py, fleetnft/steps.py).

Nothing of a host-uid subject is established past its rules (its packets are all judged on
output), so its steps never ask for flows to be cut.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from egressd.actionhandler.api import Result
from egressd.actionhandler.envelope import SetBinding
from egressd.actionhandler.shared import Claims
from egressd.engine.plansteps import TableKnobs, UidKeys
from egressd.subject.hostuid import free_slot, host_uid_problem
from egressd.subject.registry import Entry, HostBinding, Registry, SetBindingRequest


class DnsListeners(Protocol):
    """The DNS proxy's per-subject listeners: a slot's port listens from before any redirect
    points at it until its subject is gone."""

    async def open(self, slot: int) -> None: ...  # raises OSError when the port cannot be bound

    async def close(self, slot: int) -> None: ...


def host_binding(
    table: TableKnobs, registry: Registry, claims: Claims, uid: str, host_uid: int
) -> HostBinding | Result:
    """The binding of ``uid``'s host-uid sandbox, or the refusal.

    The uid is checked again here (the range and egressd's own uid are this daemon's, whoever
    parsed the envelope). The slot is the one the subject has (a retry, rebind or re-key keeps
    its ports), else one a failed install left in the kernel, else the lowest free one.
    """
    problem = host_uid_problem(host_uid, table.uids.uid_range, table.own_uid)
    if problem is not None:
        return Result(400, f"invalid action envelope: attachment.process.uid is invalid: {problem}")
    entry = registry.get(uid)
    if entry is not None and isinstance(entry.binding, HostBinding):
        return HostBinding(host_uid, entry.binding.slot)
    held = sorted(slot for _, slot in registry.kernel(uid).uid_keys)
    if held:
        return HostBinding(host_uid, held[0])
    slot = free_slot(registry.slots_in_use() | claims.slots_of_others(uid), table.uids.max_subjects)
    if slot is None:
        return Result(409, f"no free host-uid slot (EGRESSD_UID_MAX_SUBJECTS={table.uids.max_subjects})")
    return HostBinding(host_uid, slot)


def with_host_binding(
    table: TableKnobs, registry: Registry, claims: Claims, action: SetBinding, req: SetBindingRequest
) -> SetBindingRequest | Result:
    """``req`` keyed by the action's host uid when it names one (else unchanged)."""
    if action.process is None:
        return req
    host = host_binding(table, registry, claims, action.uid, action.process.uid)
    return host if isinstance(host, Result) else replace(req, binding=host)


def kept(keep: object) -> UidKeys:
    """The uid keys a DropStaleKeys keeps (those of a host-uid binding kept, else none)."""
    return frozenset({(keep.host_uid, keep.slot)}) if isinstance(keep, HostBinding) else frozenset()


def slots(entry: Entry, uid_keys: UidKeys) -> set[int]:
    """The slots ``entry`` holds: its binding's and those of its uid keys."""
    out = {slot for _, slot in uid_keys}
    if isinstance(entry.binding, HostBinding):
        out.add(entry.binding.slot)
    return out


class PortBook:
    """Opens and closes the per-subject DNS listeners (none without a DNS proxy: unit tests)."""

    def __init__(self, table: TableKnobs, registry: Registry, claims: Claims) -> None:
        self._table = table
        self._registry = registry
        self._claims = claims
        self.ports: DnsListeners | None = None

    async def open(self, slot: int) -> None:
        """Raises OSError when the port cannot be bound (the step then fails closed: no
        redirect is installed towards a port nobody listens on)."""
        if self.ports is not None:
            await self.ports.open(slot)

    async def close(self, uid: str, slots: set[int]) -> None:
        """Stop listening on ``uid``'s former ports, unless another subject holds one now."""
        if self.ports is None:
            return
        others = self._registry.slots_in_use(excluding=uid) | self._claims.slots_of_others(uid)
        for slot in sorted(slots - others):
            await self.ports.close(slot)
