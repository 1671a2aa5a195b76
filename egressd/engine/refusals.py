"""The refusal counts both profiles export (docs/reference/behaviour.md §15), read from the kernel.

Every refusal of a backend's ruleset is counted in a named kernel counter; the backend says which
counter is whose (:meth:`egressd.engine.backend.RulesetBackend.refusals`) and this module turns
the counts into the samples of ``egressd_subject_dropped_packets_total``, read before each
scrape. A read that fails keeps the last samples (counters only grow), so a scrape never fails
on the kernel.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace

from egressd.engine.backend import Refusals
from egressd.engine.counters import read_or_keep
from egressd.metrics import EgressMetrics

#: The subject label of refusals whose source is no subject (the fleet's unattributed counter).
UNATTRIBUTED = "-"

Counters = Mapping[str, int]


def samples(refusals: Refusals, labels: Mapping[str, str]) -> dict[tuple[str, ...], float]:
    """{(subject,): packets} for the subjects of ``labels`` (nft id -> exported name) and, where
    the backend tells them apart, ``("-",)`` for sources that are no subject. A subject not in
    ``labels`` (being removed) is skipped, so the metric never names a subject that is gone."""
    out: dict[tuple[str, ...], float] = {
        (name,): float(refusals.by_subject[nft_id])
        for nft_id, name in labels.items()
        if nft_id in refusals.by_subject
    }
    if refusals.unattributed is not None:
        out[(UNATTRIBUTED,)] = float(refusals.unattributed)
    return out


def with_extra(refusals: Refusals, extra: Mapping[str, int]) -> Refusals:
    """``refusals`` plus counts kept outside the kernel (by nft id): the MITM's name-check
    refusals (docs/reference/behaviour.md §18), exported in the same per-subject count."""
    if not extra:
        return refusals
    merged = dict(refusals.by_subject)
    for nft_id, count in extra.items():
        merged[nft_id] = merged.get(nft_id, 0) + count
    return replace(refusals, by_subject=merged)


class RefusalSamples:
    """``egressd_subject_dropped_packets_total``: the backend's refusal counts, per subject,
    plus ``extra`` (by nft id): refusals counted outside the kernel (the MITM's name check)."""

    def __init__(
        self,
        metrics: EgressMetrics,
        read: Callable[[], Awaitable[Counters]],
        refusals: Callable[[Counters], Refusals],
        labels: Callable[[], Mapping[str, str]],
        extra: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        self._read = read
        self._kernel_refusals = refusals
        self._extra = extra
        self._labels = labels
        self._samples: dict[tuple[str, ...], float] = {}
        metrics.subject_dropped.collect_from(lambda: dict(self._samples))

    def _refusals(self, counters: Counters) -> Refusals:
        kernel = self._kernel_refusals(counters)
        return with_extra(kernel, self._extra()) if self._extra is not None else kernel

    async def read_kernel(self) -> Refusals:
        """The kernel's counts alone (raises when the kernel cannot be read)."""
        return self._kernel_refusals(await self._read())

    async def read(self) -> Refusals:
        """The counts now (raises when the kernel cannot be read)."""
        return self._refusals(await self._read())

    async def counts(self) -> Refusals | None:
        """The counts now; None when the kernel could not be read (logged)."""
        counters = await read_or_keep(self._read, "drops.counters_unreadable")
        return None if counters is None else self._refusals(counters)

    async def refresh(self) -> None:
        """Before a scrape; a failed read keeps the last samples."""
        counts = await self.counts()
        if counts is not None:
            self._samples = samples(counts, self._labels())
