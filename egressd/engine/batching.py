"""Group commit of DNS learning, the pure part: which waiting answers one transaction carries,
and the one set of grants it writes for them.

Under load many answers of one subject are learned at once; one kernel transaction each costs
a fixed price (the kernel walks the table's sets by name and, for the port-scoped ranges,
clones the subject's pipapo set on commit), so answers that arrive while a transaction is in
flight wait and go together in the next one (docs/reference/behaviour.md §14: still no reply
before the kernel holds its addresses). The shell (:mod:`egressd.engine.groupcommit`) keeps
the waiters and runs the transactions; this module only orders and merges, no I/O, no clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence

from egressd.addr import IPAddress
from egressd.subject.leases import Grant

#: At most this many answers in one transaction (its size, and how long the first waiter
#: waits for the last one's encoding, stay bounded).
MAX_BATCH = 64
#: ... and at most this many addresses (an answer's own addresses are never split).
MAX_BATCH_ADDRESSES = 512


def merge_grants(per_answer: Sequence[Sequence[Grant]]) -> list[Grant]:
    """The grants of several answers (:meth:`egressd.subject.leases.LeaseBook.admit_many`, in
    its order) as one kernel step: one grant per address, in the order addresses first
    appear, with the longest lifetime, the last answer's scope (each one's scope includes the
    earlier ones') and the first one's ``held`` (what the kernel holds before the step, which
    the step replaces when the scope changed)."""
    merged: dict[IPAddress, Grant] = {}
    for grants in per_answer:
        for g in grants:
            m = merged.get(g.ip)
            merged[g.ip] = g if m is None else Grant(g.ip, max(m.seconds, g.seconds), g.scope, m.held, g.shared)
    return list(merged.values())


class GroupQueue[K: Hashable, T]:
    """Waiting items per key (a subject), taken in arrival order in bounded batches, and
    whether a committer is running for the key (at most one per key at a time).

    The committer's loop: :meth:`put` says whether the caller must start one; the committer
    :meth:`take` s a batch, commits it, and takes again until :meth:`take` returns nothing,
    which also marks the key idle (so the next :meth:`put` starts a new committer)."""

    def __init__(
        self,
        max_items: int = MAX_BATCH,
        max_weight: int = MAX_BATCH_ADDRESSES,
        weight: Callable[[T], int] = lambda _item: 1,
    ) -> None:
        if max_items < 1:
            raise ValueError("max_items must be at least 1")
        self.max_items = max_items
        self.max_weight = max_weight
        self.weight = weight
        self._waiting: dict[K, deque[T]] = {}
        self._running: set[K] = set()

    def put(self, key: K, item: T) -> bool:
        """Queue ``item``; True when no committer runs for ``key`` (the caller starts one)."""
        self._waiting.setdefault(key, deque()).append(item)
        if key in self._running:
            return False
        self._running.add(key)
        return True

    def take(self, key: K) -> list[T]:
        """The next batch for ``key``'s committer: the oldest waiting items, at most
        ``max_items`` and ``max_weight`` (the first always, whatever its weight). Empty: the
        committer stops, the key is idle."""
        queue = self._waiting.get(key)
        if not queue:
            self._waiting.pop(key, None)
            self._running.discard(key)
            return []
        batch = [queue.popleft()]
        total = self.weight(batch[0])
        while queue and len(batch) < self.max_items:
            w = self.weight(queue[0])
            if total + w > self.max_weight:
                break
            batch.append(queue.popleft())
            total += w
        return batch

    def drain(self, key: K) -> list[T]:
        """Everything still waiting for ``key``, which becomes idle (a committer that cannot go
        on fails these)."""
        self._running.discard(key)
        return list(self._waiting.pop(key, ()))

    def waiting(self, key: K) -> int:
        return len(self._waiting.get(key, ()))

    def running(self, key: K) -> bool:
        return key in self._running
