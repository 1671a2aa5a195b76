"""The thin shell that puts builder output into the kernel: libnftables scripts and netlink batches.

All kernel work runs on one dedicated thread: that serialises every nft transaction of the
daemon (the spec's "all nft transactions serialised"), keeps the blocking libnftables calls
off the event loop, and keeps the libnftables context and the netlink socket in the thread
that created them (a libnftables context is bound to the netns it was created in).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from egressd.engine.errors import RulesetRefused, RulesetUncertain
from egressd.kernel.netlink import NfTablesSocket
from egressd.kernel.netlink_dump import SetElement
from egressd.kernel.netlink_proto import NetlinkError
from egressd.kernel.ops import NetlinkBatch
from egressd.metrics import EgressMetrics

T = TypeVar("T")

#: A light batch (at most this many messages + elements, :meth:`NetlinkBatch.weight`: an
#: in-place swap of a few sets, a dispatch update, a lease add) may be applied on the event
#: loop's thread: at 100 subjects its kernel time (0.3-0.6 ms here) is below what the two
#: hand-offs to the kernel thread and back cost on a busy 2-core machine (scripts/bench/results/report-fleet-2026-12-03.md,
#: issue 28). It is, while the batches' recent kernel time says it will take at most
#: INLINE_BUDGET_S: in a big table every set a batch names costs a walk over all the table's
#: sets (0.5-1 ms each at 1000 subjects), and the loop must keep answering DNS meanwhile.
INLINE_MAX_WEIGHT = 32
INLINE_BUDGET_S = 0.001


class InlineBudget:
    """The recent CPU time (encoding and the kernel's work, the applying thread's own: not the
    time other processes took the core) per unit of batch weight, a moving average over the
    batches applied on either thread; a light batch goes inline while its expected time fits."""

    def __init__(self) -> None:
        self.per_unit = 0.0

    def allows(self, weight: int) -> bool:
        return weight <= INLINE_MAX_WEIGHT and self.per_unit * weight <= INLINE_BUDGET_S

    def observe(self, weight: int, seconds: float) -> None:
        if weight > 0:
            sample = seconds / weight
            self.per_unit = sample if self.per_unit == 0.0 else 0.8 * self.per_unit + 0.2 * sample


class NftError(RulesetRefused):
    """A transaction the kernel refused; nothing of it was applied."""


class NftUncertain(NftError, RulesetUncertain):
    """A transaction whose outcome is unknown: the batch was sent but its answer never came
    (the ack read timed out or the socket failed). The kernel may have applied all of it or
    none of it (never part: a batch is atomic), so the caller must plan for both."""


class Transactions(Protocol):
    """What the control plane needs from the kernel. Swappable for failure injection."""

    async def run_script(self, script: str, *, op: str) -> None: ...

    async def run_batch(self, batch: NetlinkBatch, *, op: str) -> None: ...

    async def run_batch_inline(self, batch: NetlinkBatch, *, op: str) -> None:
        """:meth:`run_batch` without the hop to the kernel thread (a DNS lease add on the reply
        path); the caller holds the control plane's kernel lock. A shell without such a fast
        path runs it as :meth:`run_batch`."""
        ...

    async def list_set_elements(self, table: str, set_name: str) -> list[SetElement]:
        """One set's elements as the kernel holds them (a read, for explain); raises
        :class:`NftError` when the kernel cannot be asked."""
        ...

    async def reset_table(self, header_with_delete: str, header: str) -> None: ...

    async def close(self) -> None: ...


class _Netlink:
    """Applies :class:`NetlinkBatch` es as single nf_tables transactions."""

    def __init__(self) -> None:
        self.sock = NfTablesSocket()

    def run(self, batch: NetlinkBatch) -> None:
        try:
            self.sock.run(batch)
        except NetlinkError as exc:
            if exc.code in (errno.ETIMEDOUT, errno.ENOBUFS):
                # No answer, or answers dropped for a full receive buffer: the batch may have
                # been committed all the same.
                raise NftUncertain(f"netlink batch unanswered: {exc}") from None
            raise NftError(f"netlink batch refused: {exc}") from None
        except ValueError as exc:
            # The encoder refused it before anything was sent (e.g. an attribute over its
            # u16 length): a refusal like the kernel's, never an unhandled error.
            raise NftError(f"netlink batch not encodable: {exc}") from None
        except OSError as exc:
            # A send or recv error: the batch (or part of the stream) may have reached the
            # kernel and been committed; nobody can say which.
            raise NftUncertain(f"netlink batch unanswered: {exc}") from None

    def close(self) -> None:
        self.sock.close()


class KernelTransactions:
    """libnftables (scripts) and pyroute2 (deletions) on one worker thread."""

    def __init__(self, metrics: EgressMetrics | None = None) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nft")
        self._metrics = metrics
        self._nft: Any = None
        self._netlink: _Netlink | None = None
        self._inline: _Netlink | None = None  # owned by the event loop thread
        self.budget = InlineBudget()

    # Runs on the worker thread.
    def _ctx(self) -> Any:
        if self._nft is None:
            import nftables

            ctx = nftables.Nftables()
            ctx.set_echo_output(False)  # echo forces a full cache fill: ~1 s at 1000 subjects
            ctx.set_handle_output(False)
            self._nft = ctx
        return self._nft

    def run_script_sync(self, script: str) -> None:
        """One libnftables script as one transaction, on the calling thread: only on the
        kernel thread (inside :meth:`run_sync`, e.g. the start-up self-test)."""
        rc, _out, err = self._ctx().cmd(script)
        if rc != 0:
            first = next((ln for ln in str(err).splitlines() if ln.strip()), "unknown error")
            raise NftError(first.strip()[:300])

    def _thread_netlink(self) -> _Netlink:
        """The kernel thread's netlink socket, made on first use (on that thread, in its netns)."""
        if self._netlink is None:
            self._netlink = _Netlink()
        return self._netlink

    def _counters(self, table: str) -> dict[str, int]:
        try:
            return self._thread_netlink().sock.counters(table)
        except (NetlinkError, OSError) as exc:
            raise NftError(f"counter dump refused: {exc}") from None

    def set_elements_sync(self, table: str, set_name: str) -> list[SetElement]:
        """One set's elements (one netlink dump), on the calling thread: only on the kernel
        thread (inside :meth:`run_sync`, e.g. the self-test's lease-renewal probe)."""
        try:
            return self._thread_netlink().sock.set_elements(table, set_name)
        except (NetlinkError, OSError) as exc:
            raise NftError(f"set element dump refused: {exc}") from None

    def run_batch_sync(self, batch: NetlinkBatch) -> None:
        """One netlink batch as one transaction, on the calling thread: only on the kernel
        thread (inside :meth:`run_sync`), whose netlink socket it uses."""
        start = time.thread_time()
        self._thread_netlink().run(batch)
        self.budget.observe(batch.weight(), time.thread_time() - start)

    def _reset(self, header_with_delete: str, header: str) -> None:
        try:
            self.run_script_sync(header_with_delete)
        except NftError:
            # "delete table" fails when the table is missing; retry without it.
            self.run_script_sync(header)

    @contextlib.contextmanager
    def _measured(self, op: str) -> Iterator[None]:
        """Count a transaction, its failure and its latency under ``op``."""
        start = time.perf_counter()
        try:
            yield
        except Exception:
            if self._metrics:
                self._metrics.nft_failures.inc(op)
            raise
        finally:
            if self._metrics:
                self._metrics.nft_latency.observe(time.perf_counter() - start, op)
        if self._metrics:
            self._metrics.nft_updates.inc(op)

    async def _call(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        with self._measured(op):
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def run_script(self, script: str, *, op: str) -> None:
        await self._call(op, self.run_script_sync, script)

    async def run_batch(self, batch: NetlinkBatch, *, op: str) -> None:
        if self.budget.allows(batch.weight()):
            # The caller holds the control plane's kernel lock, as for a lease add.
            await self.run_batch_inline(batch, op=op)
            return
        await self._call(op, self.run_batch_sync, batch)

    async def run_batch_inline(self, batch: NetlinkBatch, *, op: str) -> None:
        # A lease add is one tiny transaction (~0.1-0.2 ms in the kernel); the hop to the kernel
        # thread and back costs about as much again on the DNS reply path. The caller holds the
        # control plane's kernel lock, so this never overlaps another egressd transaction.
        if self._inline is None:
            self._inline = _Netlink()
        with self._measured(op):
            start = time.thread_time()
            self._inline.run(batch)
            self.budget.observe(batch.weight(), time.thread_time() - start)

    async def reset_table(self, header_with_delete: str, header: str) -> None:
        await self._call("reset", self._reset, header_with_delete, header)

    async def list_counters(self, table: str) -> dict[str, int]:
        """The table's counter objects (name -> packets), for the audit evidence.

        One netlink dump on the kernel thread (libnftables would fill its whole cache: ~2 s at
        1000 subjects). A read, so not counted as a transaction.
        """
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._counters, table)

    async def list_set_elements(self, table: str, set_name: str) -> list[SetElement]:
        """One set's elements as the kernel holds them (explain: "what the kernel has for it").
        One netlink dump of that set on the kernel thread; a read, not a transaction."""
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self.set_elements_sync, table, set_name
        )

    def run_sync(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the kernel thread and wait (start-up self-test)."""
        return self._pool.submit(fn).result()

    async def close(self) -> None:
        def _close() -> None:
            if self._netlink is not None:
                self._netlink.close()

        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, _close)
        finally:
            if self._inline is not None:
                self._inline.close()
            self._pool.shutdown(wait=False)
