"""Per-subject refusal counts of the fleet profile (docs/reference/behaviour.md §15), read from the kernel.

Every refusal of the table goes through the ``denied`` chain, which counts it in the source's
named counter ``subj_<id>_dropped`` (or ``unattributed_dropped`` for a source that is no
subject, exported as ``subject="-"``). A scrape, ``/v1/subjects`` (``egressctl subjects``,
``status``, ``watch``) and the audit evidence all read the same counter objects; concurrent
readers share one netlink dump (:class:`CounterDump`).

The recent-denials ring (DNS layer) is attached to the same subject documents here and
follows the subject's lifecycle as a :class:`~egressd.actionhandler.control.SubjectListener`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from egressd.engine.backend import Refusals
from egressd.engine.refusals import RefusalSamples
from egressd.events.denials import RecentDenials
from egressd.fleetnft.backend import fleet_refusals
from egressd.metrics import EgressMetrics
from egressd.mitm.names import NameReport
from egressd.policy.audit import safe_token
from egressd.subject.registry import Entry

Counters = dict[str, int]


class CounterDump:
    """The table's counter objects; callers that arrive while a dump runs get that dump's
    answer instead of starting another one (a scrape reads audit and drop counters at once)."""

    def __init__(self, read: Callable[[], Awaitable[Counters]]) -> None:
        self._read = read
        self._inflight: asyncio.Future[Counters] | None = None
        self.dumps = 0

    async def __call__(self) -> Counters:
        if self._inflight is None or self._inflight.done():
            self.dumps += 1
            self._inflight = asyncio.ensure_future(self._read())
        return await asyncio.shield(self._inflight)


class DropCounters:
    """``egressd_subject_dropped_packets_total`` and the per-subject fields of ``/v1/subjects``."""

    def __init__(
        self,
        metrics: EgressMetrics,
        read: Callable[[], Awaitable[Counters]],
        entries: Callable[[], Iterable[Entry]],
        denials: RecentDenials | None = None,
        refusals: Callable[[Mapping[str, int]], Refusals] = fleet_refusals,
        names: NameReport | None = None,
    ) -> None:
        self._entries = entries
        self.denials = denials
        self.names = names
        # The engine's samples over the fleet backend's counters (plus the MITM's name-check
        # refusals, docs/reference/behaviour.md §18); the registry names the subjects.
        self._samples = RefusalSamples(
            metrics,
            read,
            refusals,
            lambda: {e.nft_id: safe_token(e.subject) for e in self._entries()},
            extra=self._name_refusals if names is not None else None,
        )

    def _name_refusals(self) -> dict[str, int]:
        assert self.names is not None
        counts = self.names.refusals.by_uid()
        if not counts:
            return {}
        return {e.nft_id: counts[e.uid] for e in self._entries() if e.uid in counts}

    async def refresh(self) -> None:
        """Before a scrape. A failed read keeps the last samples (counters only ever grow)."""
        await self._samples.refresh()

    async def annotate(self, subjects: list[dict[str, Any]]) -> dict[str, Any]:
        """Add ``droppedPackets`` (None when the kernel could not be read) and
        ``recentDenials`` (oldest first) to each subject document of ``/v1/subjects``; return
        the document's extra top-level fields."""
        counts = await self._samples.counts()
        by_id = counts.by_subject if counts is not None else {}
        nft_ids = {e.uid: e.nft_id for e in self._entries()}
        for doc in subjects:
            uid = str(doc.get("uid", ""))
            nft_id = nft_ids.get(uid)
            doc["droppedPackets"] = None if counts is None or nft_id is None else by_id.get(nft_id, 0)
            denials = self.denials.of(uid) if self.denials is not None else []
            doc["recentDenials"] = [d.as_json() for d in denials]
        return {"unattributedDroppedPackets": None if counts is None else counts.unattributed}

    # ---- SubjectListener: the ring of a subject goes with it (and with its old instance) ---------

    async def registered(self, entry: Entry) -> None:
        return None

    async def unbound(self, uid: str) -> None:
        return None

    async def reset(self, uid: str) -> None:
        self._forget(uid)

    async def removed(self, uid: str) -> None:
        self._forget(uid)

    def _forget(self, uid: str) -> None:
        # The kernel's counter goes with the subject's objects; its name-check count too.
        if self.denials is not None:
            self.denials.forget(uid)
        if self.names is not None:
            self.names.forget(uid)
