"""The vault's ambiguity analyser (docs/reference/behaviour.md §6 Ambiguity, 14.7): two bindings that could
both claim one request at the same precedence are refused, in O(N log N) mask operations."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence

from egressd.vault.types import Binding, VaultError, _ancestors, _wildcard_suffix, echo

__all__ = ["check_ambiguity"]


def _path_pair(a: Sequence[str], b: Sequence[str]) -> tuple[str, str] | None:
    """The first overlapping pattern pair: equal, or ``p*`` whose prefix ``p`` starts the other.

    Only used for the one pair that is reported (at most 64 x 64 patterns, 14.7)."""
    for pa in a:
        for pb in b:
            if pa == pb:
                return pa, pb
            if pa.endswith("*") and pb.startswith(pa[:-1]):
                return pa, pb
            if pb.endswith("*") and pa.startswith(pb[:-1]):
                return pa, pb
    return None


def _lowest_bit(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


def _host_neighbours(bindings: Sequence[Binding]) -> list[int]:
    """For each binding, the bitmask of the other bindings it shares a same-kind overlapping
    host with: an equal exact host, or wildcard suffixes equal or nested.

    ``*.s`` of binding i meets the owners of ``*.s``, the bindings with a wildcard strictly
    below ``s`` and the owners of every wildcard above ``s``; siblings (``*.a.s`` /
    ``*.b.s``) never meet. O(hosts + labels) mask operations.
    """
    exact: dict[str, int] = {}
    own: dict[str, int] = {}
    below: dict[str, int] = {}  # suffix -> bindings with a wildcard strictly below it
    for i, b in enumerate(bindings):
        bit = 1 << i
        for host in b.match.hosts:
            suffix = _wildcard_suffix(host)
            if suffix is None:
                exact[host] = exact.get(host, 0) | bit
                continue
            own[suffix] = own.get(suffix, 0) | bit
            for ancestor in list(_ancestors(suffix))[1:]:
                below[ancestor] = below.get(ancestor, 0) | bit
    out: list[int] = []
    for b in bindings:
        mask = 0
        for host in b.match.hosts:
            suffix = _wildcard_suffix(host)
            if suffix is None:
                mask |= exact[host]
                continue
            mask |= own[suffix] | below.get(suffix, 0)
            for ancestor in list(_ancestors(suffix))[1:]:
                mask |= own.get(ancestor, 0)
        out.append(mask)
    return out


def _value_neighbours(values: Sequence[Sequence[str]]) -> list[int]:
    """For each binding, the bitmask of the bindings sharing at least one of its values."""
    holders: dict[str, int] = {}
    for i, items in enumerate(values):
        for v in items:
            holders[v] = holders.get(v, 0) | (1 << i)
    out: list[int] = []
    for items in values:
        mask = 0
        for v in items:
            mask |= holders[v]
        out.append(mask)
    return out


def _prefix_end(fulls: Sequence[str], lo: int, stem: str) -> int:
    """End of the run of ``fulls[lo:]`` starting with ``stem`` (sorted, so it is contiguous)."""
    hi = len(fulls)
    while lo < hi:
        mid = (lo + hi) // 2
        if fulls[mid].startswith(stem):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _path_reach(bindings: Sequence[Binding]) -> list[int]:
    """For each binding i, the bitmask of the bindings j with a path that one of i's patterns
    reaches: an equal string, or, for ``p*``, any string starting with ``p``. Overlap is
    "j in reach[i] or i in reach[j]" (a literal inside someone's ``q*`` is seen from there).

    All paths are sorted once; each pattern's partners are one contiguous range of that
    order, whose OR comes from a segment tree: O(m log m) for m paths in all.
    """
    entries = sorted((p, i) for i, b in enumerate(bindings) for p in b.match.paths)
    fulls = [p for p, _ in entries]
    size = 1
    while size < max(1, len(entries)):
        size *= 2
    tree = [0] * (2 * size)
    for k, (_, i) in enumerate(entries):
        tree[size + k] = 1 << i
    for k in range(size - 1, 0, -1):
        tree[k] = tree[2 * k] | tree[2 * k + 1]

    def range_or(lo: int, hi: int) -> int:
        mask = 0
        lo += size
        hi += size
        while lo < hi:
            if lo & 1:
                mask |= tree[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                mask |= tree[hi]
            lo //= 2
            hi //= 2
        return mask

    reach = [0] * len(bindings)
    for path, i in entries:
        if path.endswith("*"):
            lo = bisect_left(fulls, path[:-1])
            hi = _prefix_end(fulls, lo, path[:-1])
        else:
            lo, hi = bisect_left(fulls, path), bisect_right(fulls, path)
        reach[i] |= range_or(lo, hi)
    return reach


def _first_ambiguous(bindings: Sequence[Binding]) -> tuple[int, int] | None:
    """The smallest index pair ``(i, j)``, ``i < j``, of bindings that overlap on all four
    dimensions: the very pair the old all-pairs check reported first.

    Each dimension is a symmetric "shares something" relation held as one bitmask of
    bindings per binding (hosts, schemes, methods), or, for paths, a one-sided reach; their
    AND is the set of colliding partners. Nothing is ever built per pair or per
    (host, method, path) combination: O(N log N) for N hosts, methods and paths in all, in
    operations on n-bit masks (n bindings: at most 256 under the caps, four machine words).
    """
    n = len(bindings)
    hosts = _host_neighbours(bindings)
    schemes = _value_neighbours([b.match.schemes for b in bindings])
    methods = _value_neighbours([b.match.methods for b in bindings])
    reach = _path_reach(bindings)
    common = [hosts[i] & schemes[i] & methods[i] & ~(1 << i) for i in range(n)]
    # j collides with i iff j in common[i] & reach[i], or i in common[j] & reach[j].
    collide = [common[i] & reach[i] for i in range(n)]
    first: int | None = None
    for i, mask in enumerate(collide):
        if mask >> (i + 1):
            first = i if first is None else min(first, i)
        if mask and (low := _lowest_bit(mask)) < i:
            first = low if first is None else min(first, low)
    if first is None:
        return None
    above = collide[first] >> (first + 1)
    best = first + 1 + _lowest_bit(above) if above else n
    for j in range(first + 1, best):
        if collide[j] >> first & 1:
            best = j
            break
    return first, best


def _host_witness(bindings: Sequence[Binding], i: int, j: int) -> tuple[str, str]:
    """The host pair the old check named for ``(i, j)``: the exact host both list that
    appears first in the vault, else the first wildcard pair met in the old loop order."""
    exact_rank: dict[str, int] = {}
    wild_rank: dict[str, int] = {}
    for binding in bindings:
        for host in binding.match.hosts:
            suffix = _wildcard_suffix(host)
            if suffix is None:
                exact_rank.setdefault(host, len(exact_rank))
            else:
                wild_rank.setdefault(suffix, len(wild_rank))
    a, b = bindings[i].match.hosts, bindings[j].match.hosts
    shared = set(a) & {h for h in b if not h.startswith("*.")}
    if shared:
        host = min(shared, key=exact_rank.__getitem__)
        return host, host
    wild = {i: {h[2:] for h in a if h.startswith("*.")}, j: {h[2:] for h in b if h.startswith("*.")}}
    for suffix in sorted(wild[i] | wild[j], key=wild_rank.__getitem__):
        for ancestor in _ancestors(suffix):
            for x, y in ((i, j), (j, i)):
                if suffix in wild[x] and ancestor in wild[y]:
                    return (f"*.{suffix}", f"*.{ancestor}") if x == i else (f"*.{ancestor}", f"*.{suffix}")
    raise AssertionError("no overlapping host pair")  # _first_ambiguous established one


def check_ambiguity(bindings: Iterable[Binding]) -> None:
    """Refuse two bindings that could both claim one request at the same precedence (§6).

    Overlap = schemes overlap ∧ methods overlap ∧ a path pair overlaps ∧ a same-kind host pair
    overlaps. Exact and wildcard hosts never conflict (the exact one wins in the MITM). The
    pair named is the first in name order, with the same witnesses as before 14.7.
    """
    ordered = sorted(bindings, key=lambda b: b.name)
    found = _first_ambiguous(ordered)
    if found is None:
        return
    i, j = found
    a, b = ordered[i], ordered[j]
    host_a, host_b = _host_witness(ordered, i, j)
    b_methods = frozenset(b.match.methods)
    schemes = [s for s in a.match.schemes if s in b.match.schemes]
    methods = [m for m in a.match.methods if m in b_methods]
    paths = _path_pair(a.match.paths, b.match.paths)
    assert schemes and methods and paths is not None  # what _first_ambiguous established
    hosts = echo(host_a) if host_a == host_b else f"{echo(host_a)} / {echo(host_b)}"
    raise VaultError(
        f"{echo(a.name)} and {echo(b.name)} are ambiguous: both match host {hosts}, "
        f"scheme {echo(schemes[0])}, method {echo(methods[0])} and path {echo(paths[0])} / {echo(paths[1])}",
        "bindings",
    )
