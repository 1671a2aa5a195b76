"""Which MITM worker serves a network subject (EGRESSD_MITM_WORKERS). Pure: no I/O.

A subject is assigned once, when it first gets its MITM entries, to the least-loaded worker
at that moment (ties: the lowest index), and keeps it until it is removed: the kernel's
``mitm_port`` element of each of its addresses never changes value (a re-add with another
value would fail the transaction), and the worker's vault-snapshot cache stays warm.
"""

from __future__ import annotations

from collections.abc import Sequence


def least_loaded(loads: Sequence[int]) -> int:
    """The index of the smallest load; the lowest such index on a tie."""
    if not loads:
        raise ValueError("no workers")
    return min(range(len(loads)), key=lambda i: (loads[i], i))


def uid_worker(slot: int, workers: int) -> int:
    """The worker that listens on a host-uid subject's own MITM port: the port block is
    partitioned by slot (slot % workers), so every port has exactly one listener."""
    return slot % workers


class WorkerAssignment:
    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError("at least one worker")
        self.workers = workers
        self._of: dict[str, int] = {}

    def loads(self) -> list[int]:
        out = [0] * self.workers
        for w in self._of.values():
            out[w] += 1
        return out

    def of(self, uid: str) -> int:
        """The subject's worker, assigned now if it has none."""
        got = self._of.get(uid)
        if got is None:
            got = self._of[uid] = least_loaded(self.loads())
        return got

    def peek(self, uid: str) -> int | None:
        return self._of.get(uid)

    def release(self, uid: str) -> None:
        self._of.pop(uid, None)
