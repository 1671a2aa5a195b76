"""What the parts of the fleet's action handling share: the table's knobs, the registry, the locks.

Every mutation of a subject runs under that subject's lock, and every kernel transaction under
one global kernel lock, so the cross-subject bookkeeping (who still uses a gateway or an IP)
is read and changed atomically with the transaction that depends on it. Kernel first,
registry second (docs/architecture.md, "Concurrency").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from egressd.addr import IPAddress
from egressd.engine.plansteps import TableKnobs
from egressd.feed import Feed
from egressd.metrics import EgressMetrics
from egressd.subject.model import nft_id, subject_for_uid
from egressd.subject.registry import AnyBinding, HostBinding, Registry


class SubjectLocks:
    """One asyncio lock per uid, freed when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, uid: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(uid, (asyncio.Lock(), 0))
        self._locks[uid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[uid]
            if users <= 1:
                del self._locks[uid]
            else:
                self._locks[uid] = (lock, users - 1)


class Claims:
    """The nft ids, IPs, host uids and slots SET_BINDINGs in flight are binding: visible from
    before their first await, so a concurrent SET_BINDING of another uid for the same key gets
    409 instead of sharing kernel objects (the registry only knows committed entries)."""

    def __init__(self) -> None:
        self.ips: dict[IPAddress, str] = {}
        self.nft_ids: dict[str, str] = {}
        self.host_uids: dict[int, str] = {}  # host-uid subjects (docs/behaviour.md §17)
        self.slots: dict[int, str] = {}

    def conflict(self, uid: str, binding: AnyBinding | None) -> str | None:
        other = self.nft_ids.get(nft_id(subject_for_uid(uid)))
        if other is not None and other != uid:
            return f"subject id collides with sandbox {other!r} being bound"
        if isinstance(binding, HostBinding):
            other = self.host_uids.get(binding.host_uid)
            if other is not None and other != uid:
                return f"host uid {binding.host_uid} is being bound to another sandbox"
        elif binding is not None:
            other = self.ips.get(binding.ip)
            if other is not None and other != uid:
                return f"ip {binding.ip} is being bound to another sandbox"
        return None

    def slots_of_others(self, uid: str) -> set[int]:
        return {slot for slot, owner in self.slots.items() if owner != uid}

    @contextlib.contextmanager
    def reserve(self, uid: str, binding: AnyBinding | None) -> Iterator[None]:
        nid = nft_id(subject_for_uid(uid))
        self.nft_ids[nid] = uid
        held: list[tuple[dict[Any, str], object]] = []
        if isinstance(binding, HostBinding):
            held = [(self.host_uids, binding.host_uid), (self.slots, binding.slot)]
        elif binding is not None:
            held = [(self.ips, binding.ip)]
        for book, key in held:
            book[key] = uid
        try:
            yield
        finally:
            if self.nft_ids.get(nid) == uid:
                del self.nft_ids[nid]
            for book, key in held:
                if book.get(key) == uid:
                    del book[key]


@dataclass(slots=True)
class Shared:
    """The table's knobs, the registry, the locks and the change feed, one of each for the whole
    control plane (the kernel side itself is the control plane's ``kernel``)."""

    table: TableKnobs
    metrics: EgressMetrics | None = None
    # Every narrowing of the control plane is published here (egressd.feed), the registry's too.
    feed: Feed = field(default_factory=Feed)
    registry: Registry = field(init=False)
    locks: SubjectLocks = field(default_factory=SubjectLocks)
    # Held around every kernel transaction and the bookkeeping read or changed with it.
    kernel_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.registry = Registry(self.feed)
