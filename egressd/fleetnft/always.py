"""The always-rules reload's kernel side: every subject's sets re-filled in ONE transaction.

The engine (egressd/actionhandler/always.py) decides which subjects are re-applied and with
what; this builds the batch (each subject's static sets swapped, its dyn sets replaced by the
leases it keeps) and sends it: :class:`egressd.engine.plansteps.ContentsSwap`.
"""

from __future__ import annotations

from egressd.engine.plansteps import Leases
from egressd.fleetnft.contents import Contents, contents_swap, dyn_replace
from egressd.fleetnft.subject import lazy_objects
from egressd.fleetnft.table import TableConfig
from egressd.kernel.applier import Transactions
from egressd.kernel.ops import NetlinkBatch


class FleetContentsSwap:
    def __init__(self, cfg: TableConfig, tx: Transactions) -> None:
        self._cfg = cfg
        self._tx = tx
        self._batch = NetlinkBatch(cfg.table)

    def add(
        self,
        nft_id: str,
        contents: Contents,
        *,
        audit_objects: bool,
        range_objects: bool,
        kept: Leases,
        unsure: bool = False,
    ) -> None:
        """The subject's static sets swapped to ``contents`` (contents_swap refuses an audit
        policy without audit objects, shared ranges without range objects) and its dyn sets
        flushed to ``kept``, even when that is
        nothing (docs/reference/behaviour.md §14.1).

        ``unsure`` (an unanswered step: either state): its lazy objects may or may not be in
        the kernel, so they are declared (a no-op when present) and its chains rebuilt with
        their rules first; naming a missing set would refuse the whole fleet's reload."""
        table = self._batch.table
        if unsure:
            self._batch = self._batch + lazy_objects(
                self._cfg, nft_id, audit=False, ranges=False, make_audit=audit_objects, make_ranges=range_objects
            )
        swap = contents_swap(table, nft_id, contents, audit_objects=audit_objects, range_objects=range_objects)
        self._batch = self._batch + swap + dyn_replace(table, nft_id, kept, ranges=range_objects)

    def __bool__(self) -> bool:
        return bool(self._batch)

    async def send(self) -> None:
        await self._tx.run_batch(self._batch, op="static_apply")
