"""Pending credential pushes for sandbox UIDs that are not registered yet (docs/reference/actions-protocol.md §4).

Pure: the clock is passed in. Bodies are kept only in memory, for at most the TTL, and are
never logged; a per-UID cap bounds what one unknown UID can make the daemon hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

MAX_PER_UID = 32
DEFAULT_TTL_S = 30


@dataclass(frozen=True, slots=True)
class PendingPush:
    method: str
    suffix: str  # e.g. "/credential-vault"
    body: bytes = field(repr=False)
    generation: int | None
    deadline: float


class PendingFull(Exception):
    """The UID already has MAX_PER_UID pushes waiting (-> 503, the caller retries later)."""


class PendingPushes:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_per_uid: int = MAX_PER_UID) -> None:
        self.ttl_s = ttl_s
        self.max_per_uid = max_per_uid
        self._by_uid: dict[str, list[PendingPush]] = {}

    def add(
        self, uid: str, method: str, suffix: str, body: bytes, generation: int | None, now: float
    ) -> None:
        queue = [p for p in self._by_uid.get(uid, []) if p.deadline > now]
        if len(queue) >= self.max_per_uid:
            self._by_uid[uid] = queue
            raise PendingFull
        queue.append(PendingPush(method, suffix, body, generation, now + self.ttl_s))
        self._by_uid[uid] = queue

    def take_for_replay(self, uid: str, spec_generation: int, now: float) -> list[PendingPush]:
        """Remove and return, in arrival order, what a registering SET_BINDING replays: unexpired
        pushes whose generation is not older than the registering ``revision.specGeneration``."""
        queue = self._by_uid.pop(uid, [])
        return [
            p for p in queue if p.deadline > now and (p.generation is None or p.generation >= spec_generation)
        ]

    def drop(self, uid: str) -> int:
        return len(self._by_uid.pop(uid, []))

    def sweep(self, now: float) -> int:
        dropped = 0
        for uid in list(self._by_uid):
            kept = [p for p in self._by_uid[uid] if p.deadline > now]
            dropped += len(self._by_uid[uid]) - len(kept)
            if kept:
                self._by_uid[uid] = kept
            else:
                del self._by_uid[uid]
        return dropped

    def count(self) -> int:
        return sum(len(q) for q in self._by_uid.values())

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._by_uid))
