"""STUB of i25-core's scope API (replaced by the lead's module at merge)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

Ranges = tuple[tuple[int, int], ...]


def _merge(r: list[tuple[int, int]]) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def _minus(a: Ranges, b: Ranges) -> Ranges:
    out: list[tuple[int, int]] = []
    for lo, hi in a:
        cur = lo
        for blo, bhi in b:
            if bhi < cur or blo > hi:
                continue
            if blo > cur:
                out.append((cur, blo - 1))
            cur = max(cur, bhi + 1)
        if cur <= hi:
            out.append((cur, hi))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Scope:
    tcp: Ranges = ()
    udp: Ranges = ()
    other: bool = False
    WHOLE: ClassVar[Scope]
    EMPTY: ClassVar[Scope]

    def is_whole(self) -> bool:
        return self == Scope.WHOLE

    def is_empty(self) -> bool:
        return not self.tcp and not self.udp and not self.other

    def admits(self, proto: str, port: int | None) -> bool:
        if proto not in ("tcp", "udp"):
            return self.other
        ranges = self.tcp if proto == "tcp" else self.udp
        if port is None:
            return ranges == ((0, 65535),)
        return any(lo <= port <= hi for lo, hi in ranges)

    def union(self, o: Scope) -> Scope:
        return Scope(_merge([*self.tcp, *o.tcp]), _merge([*self.udp, *o.udp]), self.other or o.other)

    def minus(self, o: Scope) -> Scope:
        return Scope(_minus(self.tcp, o.tcp), _minus(self.udp, o.udp), self.other and not o.other)

    def intersect(self, o: Scope) -> Scope:
        return self.minus(self.minus(o))

    def elements(self) -> tuple[tuple[str, int, int], ...]:
        return tuple(("tcp", lo, hi) for lo, hi in self.tcp) + tuple(("udp", lo, hi) for lo, hi in self.udp)


Scope.WHOLE = Scope(((0, 65535),), ((0, 65535),), True)
Scope.EMPTY = Scope()


def name_scope(policy: object, name: str) -> Scope:
    return Scope.WHOLE
