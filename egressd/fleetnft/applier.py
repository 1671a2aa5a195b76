"""The thin shell that puts builder output into the kernel.

All kernel work runs on one dedicated thread: that serialises every nft transaction of the
daemon (the spec's "all nft transactions serialised"), keeps the blocking libnftables calls
off the event loop, and keeps the libnftables context and the netlink socket in the thread
that created them (a libnftables context is bound to the netns it was created in).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from egressd.fleetnft.builder import DeleteBatch, ObjKind
from egressd.metrics import EgressMetrics

T = TypeVar("T")


class NftError(RuntimeError):
    """A transaction the kernel refused; nothing of it was applied."""


class Transactions(Protocol):
    """What the control plane needs from the kernel. Swappable for failure injection."""

    async def run_script(self, script: str, *, op: str) -> None: ...

    async def run_deletes(self, batch: DeleteBatch, *, op: str) -> None: ...

    async def reset_table(self, header_with_delete: str, header: str) -> None: ...

    async def close(self) -> None: ...


class _NetlinkDeleter:
    """Raw netlink (pyroute2) batches of deletions: no libnftables cache fill."""

    def __init__(self) -> None:
        from pyroute2.nftables.main import NFTables

        self._nft = NFTables(nfgen_family=1)  # NFPROTO_INET

    def run(self, batch: DeleteBatch) -> None:
        from pyroute2.netlink import NLM_F_ACK, NLM_F_REQUEST
        from pyroute2.netlink.nfnetlink.nftsocket import (
            NFNL_SUBSYS_NFTABLES,
            NFT_MSG_DELCHAIN,
            NFT_MSG_DELSET,
            NFT_MSG_DELSETELEM,
            nfgen_msg,
            nft_chain_msg,
            nft_set_elem_list_msg,
            nft_set_msg,
        )
        from pyroute2.nftables.main import DATA_TYPE_NAME_TO_INFO, NFTSetElem

        def msg(cls: Any, cmd: int, attrs: list[list[Any]]) -> Any:
            m = cls()
            m["attrs"] = attrs
            m["header"]["type"] = (NFNL_SUBSYS_NFTABLES << 8) | cmd
            m["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK
            m["nfgen_family"] = 1
            return m

        msgs: list[Any] = []
        for op in batch.ops:
            if op.kind is ObjKind.ELEMENT:
                _, _, atom = DATA_TYPE_NAME_TO_INFO[op.key_type]
                modifier = atom()
                modifier.header = None
                elem = NFTSetElem(value=str(op.key)).as_netlink(modifier)
                msgs.append(
                    msg(
                        nft_set_elem_list_msg,
                        NFT_MSG_DELSETELEM,
                        [
                            ["NFTA_SET_ELEM_LIST_TABLE", batch.table],
                            ["NFTA_SET_ELEM_LIST_SET", op.name],
                            ["NFTA_SET_ELEM_LIST_ELEMENTS", [elem]],
                        ],
                    )
                )
            elif op.kind is ObjKind.CHAIN:
                msgs.append(
                    msg(
                        nft_chain_msg,
                        NFT_MSG_DELCHAIN,
                        [["NFTA_CHAIN_TABLE", batch.table], ["NFTA_CHAIN_NAME", op.name]],
                    )
                )
            else:
                msgs.append(
                    msg(
                        nft_set_msg,
                        NFT_MSG_DELSET,
                        [["NFTA_SET_TABLE", batch.table], ["NFTA_SET_NAME", op.name]],
                    )
                )
        if not msgs:
            return
        begin = nfgen_msg()
        begin["res_id"] = NFNL_SUBSYS_NFTABLES
        begin["header"]["type"] = 0x10  # NFNL_MSG_BATCH_BEGIN
        begin["header"]["flags"] = NLM_F_REQUEST
        end = nfgen_msg()
        end["res_id"] = NFNL_SUBSYS_NFTABLES
        end["header"]["type"] = 0x11  # NFNL_MSG_BATCH_END
        end["header"]["flags"] = NLM_F_REQUEST
        core = self._nft.asyncore

        async def send() -> None:
            async for _ in core.nlm_request_batch([begin, *msgs, end]):
                pass

        try:
            core.event_loop.run_until_complete(send())
        except Exception as exc:  # NetlinkError carries (errno, text)
            raise NftError(f"netlink delete batch failed: {exc}") from None

    def close(self) -> None:
        self._nft.close()


class KernelTransactions:
    """libnftables (scripts) and pyroute2 (deletions) on one worker thread."""

    def __init__(self, metrics: EgressMetrics | None = None) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nft")
        self._metrics = metrics
        self._nft: Any = None
        self._deleter: _NetlinkDeleter | None = None

    # Runs on the worker thread.
    def _ctx(self) -> Any:
        if self._nft is None:
            import nftables

            ctx = nftables.Nftables()
            ctx.set_echo_output(False)  # echo forces a full cache fill: ~1 s at 1000 subjects
            ctx.set_handle_output(False)
            self._nft = ctx
        return self._nft

    def _cmd(self, script: str) -> None:
        rc, _out, err = self._ctx().cmd(script)
        if rc != 0:
            first = next((ln for ln in str(err).splitlines() if ln.strip()), "unknown error")
            raise NftError(first.strip()[:300])

    def _deletes(self, batch: DeleteBatch) -> None:
        if self._deleter is None:
            self._deleter = _NetlinkDeleter()
        self._deleter.run(batch)

    def _reset(self, header_with_delete: str, header: str) -> None:
        try:
            self._cmd(header_with_delete)
        except NftError:
            # "delete table" fails when the table is missing; retry without it.
            self._cmd(header)

    async def _call(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        try:
            result = await loop.run_in_executor(self._pool, fn, *args)
        except Exception:
            if self._metrics:
                self._metrics.nft_failures.inc(op)
            raise
        finally:
            if self._metrics:
                self._metrics.nft_latency.observe(time.perf_counter() - start, op)
        if self._metrics:
            self._metrics.nft_updates.inc(op)
        return result

    async def run_script(self, script: str, *, op: str) -> None:
        await self._call(op, self._cmd, script)

    async def run_deletes(self, batch: DeleteBatch, *, op: str) -> None:
        await self._call(op, self._deletes, batch)

    async def reset_table(self, header_with_delete: str, header: str) -> None:
        await self._call("reset", self._reset, header_with_delete, header)

    def run_sync(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the kernel thread and wait (start-up self-test)."""
        return self._pool.submit(fn).result()

    def cmd_sync(self, script: str) -> None:
        self.run_sync(lambda: self._cmd(script))

    def deletes_sync(self, batch: DeleteBatch) -> None:
        self.run_sync(lambda: self._deletes(batch))

    async def close(self) -> None:
        def _close() -> None:
            if self._deleter is not None:
                self._deleter.close()

        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, _close)
        finally:
            self._pool.shutdown(wait=False)
