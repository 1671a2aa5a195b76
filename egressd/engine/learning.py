"""One learning and destination-verification path for both profiles (issue 24 item 1).

The decisions are the lease book's (:mod:`egressd.subject.leases`: which addresses of an answer
are admissible, which leases survive a narrowing, whether an address is verified for a host).
This module is the procedure around them that the fleet (``egressd.actionhandler.learning``)
and the sidecar (``egressd.sidecar.engine``) each ran on their own: normalise the question,
decide against the policy in force now, hand what is admitted to the backend's kernel step,
record what the kernel took, and answer the MITM's destination check (docs/reference/behaviour.md §10,
§14.1, §14.4). Each profile keeps its own guards (the fleet's subject lock, states and closing
subjects; the sidecar's readiness), its kernel step and where its books live. Which leases a
policy change keeps is :func:`egressd.subject.leases.narrowed_for` over the deny sets the
backend's kernel will hold (the fleet's hard denies in audit mode, the sidecar's ``ip_sets``);
the narrowing events (``PolicyApplied``, ``AlwaysRulesChanged``, ``LeasesNarrowed``) stay with
the operation that commits the narrowed book, published before it returns (tests/unit/test_feed.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from egressd.addr import IPAddress
from egressd.engine.batching import merge_grants
from egressd.policy import IpSets, NetworkPolicy, normalise_name
from egressd.subject.leases import (
    Grant,
    LeaseBook,
    admissible_many,
    destination_verified,
    destination_verified_until,
)

#: The backend's kernel step for admitted leases (address, seconds, scope): the fleet's netlink
#: batch on the subject's dyn sets, the sidecar's script on its table's.
AddLeases = Callable[[list[Grant]], Awaitable[None]]


def question(name: str | None) -> str | None:
    """The name an answer was for, as the lease book keeps it (None: the connection refresh).
    A DNS name never has surrounding blanks (the proxy's names escape them), so stripping only
    guards other callers."""
    return normalise_name(name.strip()) if name is not None else None


def _took_nothing(exc: BaseException) -> bool:
    return False


async def learn(
    book: LeaseBook,
    effective: NetworkPolicy,
    leases: Sequence[tuple[IPAddress, int]],
    name: str | None,
    now: float,
    add: AddLeases,
    *,
    kernel_may_hold: Callable[[BaseException], bool] = _took_nothing,
    name_check: bool = False,
    hash_ranges: bool = True,
) -> list[IPAddress]:
    """Learn one answer (``name``: its question; None: a refresh of live addresses) into
    ``book`` under ``effective``, the policy in force now; return the addresses the kernel now
    holds (the reply carries only these, docs/reference/behaviour.md §14.4), each opened only for the
    name's ports and protocols (§18; ``name_check``: UDP 443 only by an explicit udp rule).

    Nothing admissible: nothing reaches the kernel. When ``add`` raises, the leases are recorded
    only if ``kernel_may_hold`` says the kernel may have taken them anyway (an unanswered or
    cancelled step): the book must never be narrower than the kernel, or a later narrowing,
    which rewrites the dyn sets from it, would not revoke them.
    """
    return (
        await learn_many(
            book,
            effective,
            [(leases, name)],
            now,
            add,
            kernel_may_hold=kernel_may_hold,
            name_check=name_check,
            hash_ranges=hash_ranges,
        )
    )[0]


#: One answer to learn: its addresses with their TTLs, and its question (None: a refresh).
Ask = tuple[Sequence[tuple[IPAddress, int]], str | None]


async def learn_many(
    book: LeaseBook,
    effective: NetworkPolicy,
    asks: Sequence[Ask],
    now: float,
    add: AddLeases,
    *,
    kernel_may_hold: Callable[[BaseException], bool] = _took_nothing,
    name_check: bool = False,
    hash_ranges: bool = True,
) -> list[list[IPAddress]]:
    """:func:`learn` for several answers of one subject in ONE kernel step (the group commit,
    :mod:`egressd.engine.batching`): each decided in order as if the earlier ones were
    recorded, their grants merged into one ``add``; each answer's addresses the kernel now
    holds, in order. When ``add`` raises, every answer fails with it (recorded only if
    ``kernel_may_hold``), as each would have on its own."""
    names = [question(name) for _, name in asks]
    per = admissible_many(
        book,
        effective,
        [(leases, n) for (leases, _), n in zip(asks, names, strict=True)],
        now,
        name_check=name_check,
        hash_ranges=hash_ranges,
    )
    merged = merge_grants(per)
    if not merged:
        return [[] for _ in asks]
    try:
        await add(merged)
    except BaseException as exc:
        if kernel_may_hold(exc):
            book.record_batch(merged, zip(per, names, strict=True), now)
        raise
    # The book takes what the one kernel step wrote (the merged grants), not each answer's
    # grants in turn: those would book port elements the step never wrote.
    book.record_batch(merged, zip(per, names, strict=True), now)
    return [[g.ip for g in grants] for grants in per]


def verified(book: LeaseBook | None, sets: IpSets | None, host: str, dst: IPAddress, now: float) -> bool:
    """May the MITM send ``host``'s credentials to ``dst``? (:func:`egressd.subject.leases.destination_verified`
    for the raw host the MITM asks about.)"""
    return destination_verified(book, sets, normalise_name(host), dst, now)


def verified_until(
    book: LeaseBook | None, sets: IpSets | None, host: str, dst: IPAddress, now: float
) -> float:
    """:func:`verified` with its deadline (monotonic; 0.0: not verified), for the MITM's memory
    (docs/reference/behaviour.md §10, "answered from memory")."""
    return destination_verified_until(book, sets, normalise_name(host), dst, now)
