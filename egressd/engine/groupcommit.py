"""Group commit of DNS learning, the shell: waiters, one committer task per key, the guard.

Both profiles learn through one :class:`GroupCommit` (the fleet per subject, the sidecar for
its one subject): an answer to learn is queued for its key and its caller waits for the
transaction that carries it. The key's committer takes the waiting answers under the profile's
guard (the fleet's subject lock, the sidecar's nothing: its kernel lock is taken by the commit
itself), commits them as one, and hands each waiter its own result, or, when the transaction
failed, the same exception every waiter would have had on its own (fail closed: no waiter is
released before the transaction that carries its addresses ended). What waits, in which
order and how many at once is :class:`egressd.engine.batching.GroupQueue`'s.

A waiter that stops waiting (the DNS proxy's bound) leaves its answer in the batch: the kernel
step may already be under way, and the book must record what the kernel took.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from contextlib import AbstractAsyncContextManager

from egressd.engine.batching import MAX_BATCH, MAX_BATCH_ADDRESSES, GroupQueue

#: Commit one batch of requests for a key: one result per request, in order; raises when the
#: transaction failed (every waiter of the batch gets the exception).
type Commit[K, R, T] = Callable[[K, list[R]], Awaitable[Sequence[T]]]


@contextlib.asynccontextmanager
async def _unguarded(_key: object) -> AsyncIterator[None]:
    yield


class GroupCommit[K: Hashable, R, T]:
    def __init__(
        self,
        commit: Commit[K, R, T],
        *,
        guard: Callable[[K], AbstractAsyncContextManager[object]] | None = None,
        max_items: int = MAX_BATCH,
        max_weight: int = MAX_BATCH_ADDRESSES,
        weight: Callable[[R], int] = lambda _request: 1,
    ) -> None:
        self._commit = commit
        self._guard: Callable[[K], AbstractAsyncContextManager[object]] = guard or _unguarded
        self._queue: GroupQueue[K, tuple[R, asyncio.Future[T]]] = GroupQueue(
            max_items, max_weight, lambda item: weight(item[0])
        )
        self._tasks: set[asyncio.Task[None]] = set()
        #: Transactions run and requests they carried (tests, the benchmark's splits).
        self.batches = 0
        self.requests = 0

    async def submit(self, key: K, request: R) -> T:
        """``request``'s result once the transaction that carries it ended (or its exception)."""
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        if self._queue.put(key, (request, fut)):
            task = asyncio.create_task(self._run(key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        # Shielded: a waiter that leaves does not cancel its request's part of the batch.
        return await asyncio.shield(fut)

    async def _run(self, key: K) -> None:
        try:
            while True:
                async with self._guard(key):
                    # One turn of the loop first: the answers already received (their
                    # datagrams are read in that turn) join this transaction.
                    await asyncio.sleep(0)
                    # Taken under the guard: what arrived while the last transaction ran, or
                    # while the guard was held by someone else, goes in this one.
                    batch = self._queue.take(key)
                    if not batch:
                        return
                    await self._one(key, batch)
        except BaseException as exc:
            # The guard or the loop failed (cancelled at shutdown): nothing still waiting is
            # committed, every waiter is failed.
            for _request, fut in self._queue.drain(key):
                _fail(fut, exc)
            if not isinstance(exc, Exception):
                raise

    async def _one(self, key: K, batch: list[tuple[R, asyncio.Future[T]]]) -> None:
        self.batches += 1
        self.requests += len(batch)
        try:
            results = await self._commit(key, [request for request, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"group commit: {len(results)} results for {len(batch)} requests")
        except BaseException as exc:
            for _request, fut in batch:
                _fail(fut, exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_request, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)

    async def close(self) -> None:
        """Cancel the committers (shutdown); their waiters are failed."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


def _fail[T](fut: asyncio.Future[T], exc: BaseException) -> None:
    if fut.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        fut.cancel()
    else:
        fut.set_exception(exc)
