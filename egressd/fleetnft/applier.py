"""The thin shell that puts builder output into the kernel: libnftables scripts and netlink batches.

All kernel work runs on one dedicated thread: that serialises every nft transaction of the
daemon (the spec's "all nft transactions serialised"), keeps the blocking libnftables calls
off the event loop, and keeps the libnftables context and the netlink socket in the thread
that created them (a libnftables context is bound to the netns it was created in).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from egressd.fleetnft.ops import (
    ALLOW_MARK,
    AddIntervals,
    AddRule,
    AddTimed,
    DeleteChain,
    DeleteElement,
    FlushSet,
    IPNetwork,
    NetlinkBatch,
    Outcome,
    Rule,
    VerdictRule,
)
from egressd.metrics import EgressMetrics
from egressd.subject.model import IPAddress

T = TypeVar("T")


class NftError(RuntimeError):
    """A transaction the kernel refused; nothing of it was applied."""


class Transactions(Protocol):
    """What the control plane needs from the kernel. Swappable for failure injection."""

    async def run_script(self, script: str, *, op: str) -> None: ...

    async def run_batch(self, batch: NetlinkBatch, *, op: str) -> None: ...

    async def reset_table(self, header_with_delete: str, header: str) -> None: ...

    async def close(self) -> None: ...


_NFPROTO = {"v4": 2, "v6": 10}  # NFPROTO_IPV4 / NFPROTO_IPV6
_META_NFPROTO = 15
_META_MARK = 3
_CT_DST_IP = {"v4": 0x14, "v6": 0x16}
_VERDICT = {Outcome.DROP: 0, Outcome.ACCEPT: 1}  # NF_DROP / NF_ACCEPT
_BATCH_BEGIN = 0x10
_BATCH_END = 0x11


def _expr(name: str, attrs: list[tuple[str, Any]]) -> dict[str, Any]:
    return {"attrs": [("NFTA_EXPR_NAME", name), ("NFTA_EXPR_DATA", {"attrs": attrs})]}


def _verdict(outcome: Outcome) -> dict[str, Any]:
    data = {"attrs": [("NFTA_DATA_VERDICT", {"attrs": [("NFTA_VERDICT_CODE", _VERDICT[outcome])]})]}
    return _expr("immediate", [("NFTA_IMMEDIATE_DREG", 0), ("NFTA_IMMEDIATE_DATA", data)])


def rule_expressions(rule: Rule) -> list[dict[str, Any]]:
    """nf_tables bytecode for our two rule shapes, exactly what nft 1.0.6 generates for them."""
    if isinstance(rule, VerdictRule):
        return [_verdict(rule.outcome)]
    exprs: list[dict[str, Any]] = []
    if rule.ct_original:
        exprs.append(
            _expr(
                "ct",
                [("NFTA_CT_DREG", 1), ("NFTA_CT_KEY", _CT_DST_IP[rule.fam]), ("NFTA_CT_DIRECTION", 0)],
            )
        )
    else:
        # inet table: match the L3 protocol before loading its destination address.
        exprs.append(_expr("meta", [("NFTA_META_DREG", 1), ("NFTA_META_KEY", _META_NFPROTO)]))
        exprs.append(
            _expr(
                "cmp",
                [
                    ("NFTA_CMP_SREG", 1),
                    ("NFTA_CMP_OP", 0),
                    ("NFTA_CMP_DATA", {"attrs": [("NFTA_DATA_VALUE", bytes([_NFPROTO[rule.fam]]))]}),
                ],
            )
        )
        offset, length = (16, 4) if rule.fam == "v4" else (24, 16)
        exprs.append(
            _expr(
                "payload",
                [
                    ("NFTA_PAYLOAD_DREG", 1),
                    ("NFTA_PAYLOAD_BASE", 1),  # network header
                    ("NFTA_PAYLOAD_OFFSET", offset),
                    ("NFTA_PAYLOAD_LEN", length),
                ],
            )
        )
    exprs.append(_expr("lookup", [("NFTA_LOOKUP_SET", rule.set_name), ("NFTA_LOOKUP_SREG", 1)]))
    if rule.outcome is Outcome.MARK:
        mark = {"attrs": [("NFTA_DATA_VALUE", struct.pack("=I", ALLOW_MARK))]}  # host byte order
        exprs.append(_expr("immediate", [("NFTA_IMMEDIATE_DREG", 1), ("NFTA_IMMEDIATE_DATA", mark)]))
        exprs.append(_expr("meta", [("NFTA_META_KEY", _META_MARK), ("NFTA_META_SREG", 1)]))
    else:
        exprs.append(_verdict(rule.outcome))
    return exprs


def _key(ip: IPAddress | int, fam: str) -> dict[str, Any]:
    size = 4 if fam == "v4" else 16
    value = int(ip).to_bytes(size, "big")
    return {"attrs": [("NFTA_DATA_VALUE", value)]}


# pyroute2 0.9.7 encodes nft_flags_be32 by enumerating the ops dict's *keys*, so the
# INTERVAL_END flag (bit 0, key 1) is requested with [1], not with its name.
_INTERVAL_END = [1]


def interval_elements(nets: Sequence[IPNetwork], fam: str) -> list[dict[str, Any]]:
    """Interval-set elements as nft 1.0.6 sends them: a zero end-marker, then start/end+1 pairs."""
    bits = 32 if fam == "v4" else 128
    ordered = sorted(nets, key=lambda n: int(n.network_address))
    keys: list[tuple[int, bool]] = []
    if ordered and int(ordered[0].network_address) != 0:
        keys.append((0, True))
    for net in ordered:
        keys.append((int(net.network_address), False))
        end = int(net.broadcast_address) + 1
        if end < 1 << bits:
            keys.append((end, True))
    out: list[dict[str, Any]] = []
    for key, is_end in keys:
        attrs: list[tuple[str, Any]] = [("NFTA_SET_ELEM_KEY", _key(key, fam))]
        if is_end:
            attrs.append(("NFTA_SET_ELEM_FLAGS", _INTERVAL_END))
        out.append({"attrs": attrs})
    return out


class _Netlink:
    """Applies :class:`NetlinkBatch` es as single nf_tables transactions (pyroute2)."""

    def __init__(self) -> None:
        from pyroute2.nftables.main import NFTables

        self._nft = NFTables(nfgen_family=1)  # NFPROTO_INET

    def run(self, batch: NetlinkBatch) -> None:
        from pyroute2.netlink import NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REQUEST
        from pyroute2.netlink.nfnetlink.nftsocket import (
            NFNL_SUBSYS_NFTABLES,
            NFT_MSG_DELCHAIN,
            NFT_MSG_DELSET,
            NFT_MSG_DELSETELEM,
            NFT_MSG_NEWRULE,
            NFT_MSG_NEWSETELEM,
            nfgen_msg,
            nft_chain_msg,
            nft_rule_msg,
            nft_set_elem_list_msg,
            nft_set_msg,
        )

        table = batch.table

        def msg(cls: Any, cmd: int, attrs: list[tuple[str, Any]], flags: int = 0) -> Any:
            m = cls()
            m["attrs"] = attrs
            m["header"]["type"] = (NFNL_SUBSYS_NFTABLES << 8) | cmd
            m["header"]["flags"] = NLM_F_REQUEST | NLM_F_ACK | flags
            m["nfgen_family"] = 1
            return m

        def elems(name: str, cmd: int, elements: list[dict[str, Any]] | None, flags: int = 0) -> Any:
            attrs: list[tuple[str, Any]] = [
                ("NFTA_SET_ELEM_LIST_TABLE", table),
                ("NFTA_SET_ELEM_LIST_SET", name),
            ]
            if elements is not None:
                attrs.append(("NFTA_SET_ELEM_LIST_ELEMENTS", elements))
            return msg(nft_set_elem_list_msg, cmd, attrs, flags)

        msgs: list[Any] = []
        for op in batch.ops:
            if isinstance(op, AddRule):
                attrs = [
                    ("NFTA_RULE_TABLE", table),
                    ("NFTA_RULE_CHAIN", op.chain),
                    ("NFTA_RULE_EXPRESSIONS", rule_expressions(op.rule)),
                ]
                msgs.append(msg(nft_rule_msg, NFT_MSG_NEWRULE, attrs, NLM_F_CREATE | NLM_F_APPEND))
            elif isinstance(op, FlushSet):
                msgs.append(elems(op.name, NFT_MSG_DELSETELEM, None))  # no element list = flush
            elif isinstance(op, AddIntervals):
                msgs.append(
                    elems(op.name, NFT_MSG_NEWSETELEM, interval_elements(op.nets, op.fam), NLM_F_CREATE)
                )
            elif isinstance(op, AddTimed):
                timed = [
                    {
                        "attrs": [
                            ("NFTA_SET_ELEM_KEY", _key(ip, op.fam)),
                            ("NFTA_SET_ELEM_TIMEOUT", seconds * 1000),
                            ("NFTA_SET_ELEM_EXPIRATION", seconds * 1000),
                        ]
                    }
                    for ip, seconds in op.leases
                ]
                msgs.append(elems(op.name, NFT_MSG_NEWSETELEM, timed, NLM_F_CREATE))
            elif isinstance(op, DeleteElement):
                fam = "v4" if op.key.version == 4 else "v6"
                key = [{"attrs": [("NFTA_SET_ELEM_KEY", _key(op.key, fam))]}]
                msgs.append(elems(op.name, NFT_MSG_DELSETELEM, key))
            elif isinstance(op, DeleteChain):
                msgs.append(
                    msg(
                        nft_chain_msg,
                        NFT_MSG_DELCHAIN,
                        [("NFTA_CHAIN_TABLE", table), ("NFTA_CHAIN_NAME", op.name)],
                    )
                )
            else:
                msgs.append(
                    msg(nft_set_msg, NFT_MSG_DELSET, [("NFTA_SET_TABLE", table), ("NFTA_SET_NAME", op.name)])
                )
        if not msgs:
            return
        begin = nfgen_msg()
        begin["res_id"] = NFNL_SUBSYS_NFTABLES
        begin["header"]["type"] = _BATCH_BEGIN
        begin["header"]["flags"] = NLM_F_REQUEST
        end = nfgen_msg()
        end["res_id"] = NFNL_SUBSYS_NFTABLES
        end["header"]["type"] = _BATCH_END
        end["header"]["flags"] = NLM_F_REQUEST
        core = self._nft.asyncore

        async def send() -> None:
            async for _ in core.nlm_request_batch([begin, *msgs, end]):
                pass

        try:
            core.event_loop.run_until_complete(send())
        except Exception as exc:  # NetlinkError carries (errno, text)
            raise NftError(f"netlink batch refused: {exc}") from None

    def close(self) -> None:
        self._nft.close()


class KernelTransactions:
    """libnftables (scripts) and pyroute2 (deletions) on one worker thread."""

    def __init__(self, metrics: EgressMetrics | None = None) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nft")
        self._metrics = metrics
        self._nft: Any = None
        self._netlink: _Netlink | None = None

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

    def _batch(self, batch: NetlinkBatch) -> None:
        if self._netlink is None:
            self._netlink = _Netlink()
        self._netlink.run(batch)

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

    async def run_batch(self, batch: NetlinkBatch, *, op: str) -> None:
        await self._call(op, self._batch, batch)

    async def reset_table(self, header_with_delete: str, header: str) -> None:
        await self._call("reset", self._reset, header_with_delete, header)

    def run_sync(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the kernel thread and wait (start-up self-test)."""
        return self._pool.submit(fn).result()

    def cmd_sync(self, script: str) -> None:
        self.run_sync(lambda: self._cmd(script))

    def batch_sync(self, batch: NetlinkBatch) -> None:
        self.run_sync(lambda: self._batch(batch))

    async def close(self) -> None:
        def _close() -> None:
            if self._netlink is not None:
                self._netlink.close()

        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, _close)
        finally:
            self._pool.shutdown(wait=False)
