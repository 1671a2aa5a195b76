"""The always-rules reload's kernel side: every subject's sets re-filled in ONE transaction.

The engine (egressd/actionhandler/always.py) decides which subjects are re-applied and with
what; this builds the batch (each subject's static sets swapped, its dyn sets replaced by the
leases it keeps) and sends it: :class:`egressd.engine.plansteps.ContentsSwap`.
"""

from __future__ import annotations

from collections.abc import Callable

from egressd.engine.plansteps import Leases
from egressd.fleetnft.contents import Contents, contents_swap, dyn_replace
from egressd.fleetnft.mitmports import Interception, NamedPorts
from egressd.kernel.applier import Transactions
from egressd.kernel.ops import NetlinkBatch
from egressd.policy import NetworkPolicy
from egressd.policy.mitmports import named_ports


class FleetContentsSwap:
    """``named``/``fixed``: the subjects' named-port interception and the ports intercepted for
    everyone (an always-rule with ``http``/``https`` ports changes what a subject's named
    ports are: docs/reference/behaviour.md §18)."""

    def __init__(
        self, table: str, tx: Transactions, named: NamedPorts | None = None, fixed: tuple[int, ...] = ()
    ) -> None:
        self._tx = tx
        self._batch = NetlinkBatch(table)
        self._named = named
        self._fixed = fixed
        self._wants: dict[str, Interception] = {}

    def add(
        self,
        nft_id: str,
        contents: Contents,
        *,
        audit_objects: bool,
        kept: Leases,
        uid: str = "",
        effective: NetworkPolicy | None = None,
    ) -> None:
        """The subject's static sets swapped to ``contents`` (contents_swap refuses an audit
        policy without audit objects) and its dyn sets flushed to ``kept``, even when that is
        nothing (docs/reference/behaviour.md §14.1); with ``effective``, its named ports follow."""
        table = self._batch.table
        self._batch = self._batch + contents_swap(table, nft_id, contents, audit_objects=audit_objects)
        self._batch = self._batch + dyn_replace(table, nft_id, kept)
        if self._named is not None and effective is not None:
            held = self._named.wanted(uid)
            self._wants[uid] = Interception(held.keys, named_ports(effective, self._fixed))

    def __bool__(self) -> bool:
        return bool(self._batch)

    async def send(self) -> None:
        batch, commit = self._with_named()
        await self._tx.run_batch(batch, op="static_apply")
        commit()

    def _with_named(self) -> tuple[NetlinkBatch, Callable[[], None]]:
        if self._named is None or not self._wants:
            return self._batch, lambda: None
        return self._named.changed_many(self._batch, self._wants)
