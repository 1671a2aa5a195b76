"""Where a rule, a name or an address is open: protocols and ports (docs/reference/behaviour.md §18).

A :class:`Scope` is what the kernel can enforce per destination: TCP port ranges, UDP port
ranges, and whether the other protocols (ICMP, SCTP, ...) are open. A rule without
``protocol`` and ``ports`` is :data:`Scope.WHOLE` (today's address-level meaning). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

PortRange = tuple[int, int]  # inclusive

PORT_MIN: Final = 0
PORT_MAX: Final = 65535
_ALL_PORTS: Final[tuple[PortRange, ...]] = ((PORT_MIN, PORT_MAX),)


def _merge(ranges: tuple[PortRange, ...] | list[PortRange]) -> tuple[PortRange, ...]:
    """Sorted, with overlapping and adjacent ranges joined."""
    out: list[PortRange] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
            continue
        out.append((lo, hi))
    return tuple(out)


def _minus(have: tuple[PortRange, ...], take: tuple[PortRange, ...]) -> tuple[PortRange, ...]:
    out: list[PortRange] = []
    for lo, hi in have:
        start = lo
        for tlo, thi in take:
            if thi < start or tlo > hi:
                continue
            if tlo > start:
                out.append((start, tlo - 1))
            start = max(start, thi + 1)
            if start > hi:
                break
        if start <= hi:
            out.append((start, hi))
    return tuple(out)


def _holds(ranges: tuple[PortRange, ...], port: int) -> bool:
    return any(lo <= port <= hi for lo, hi in ranges)


@dataclass(frozen=True, slots=True)
class Scope:
    """Protocols and ports: ``tcp``/``udp`` are merged, sorted inclusive port ranges; ``other``
    covers every protocol that has no ports. Only :data:`WHOLE` has ``other`` in practice: a
    rule that names a protocol or ports never opens ICMP and the like."""

    tcp: tuple[PortRange, ...] = ()
    udp: tuple[PortRange, ...] = ()
    other: bool = False

    WHOLE: ClassVar[Scope]
    EMPTY: ClassVar[Scope]

    @staticmethod
    def of(
        tcp: tuple[PortRange, ...] | list[PortRange] = (),
        udp: tuple[PortRange, ...] | list[PortRange] = (),
        other: bool = False,
    ) -> Scope:
        return Scope(_merge(tcp), _merge(udp), other)

    def is_whole(self) -> bool:
        return self.other and self.tcp == _ALL_PORTS and self.udp == _ALL_PORTS

    def is_empty(self) -> bool:
        return not self.other and not self.tcp and not self.udp

    def admits(self, proto: str, port: int | None) -> bool:
        """A packet of ``proto`` (``"tcp"``, ``"udp"``, anything else) to ``port``."""
        if proto == "tcp":
            return port is not None and _holds(self.tcp, port)
        if proto == "udp":
            return port is not None and _holds(self.udp, port)
        return self.other

    def union(self, o: Scope) -> Scope:
        return Scope(_merge(self.tcp + o.tcp), _merge(self.udp + o.udp), self.other or o.other)

    def minus(self, o: Scope) -> Scope:
        return Scope(_minus(self.tcp, o.tcp), _minus(self.udp, o.udp), self.other and not o.other)

    def intersect(self, o: Scope) -> Scope:
        return self.minus(self.minus(o))

    def elements(self) -> tuple[tuple[str, int, int], ...]:
        """What a port-scoped kernel set holds for this scope: ``(proto, lo, hi)``. ``other``
        has no element (callers use the address-only sets for :data:`WHOLE`)."""
        return tuple(("tcp", lo, hi) for lo, hi in self.tcp) + tuple(("udp", lo, hi) for lo, hi in self.udp)

    def describe(self) -> str:
        """``any``, ``none`` or ``tcp 80,443 udp 53`` (for explanations and logs)."""
        if self.is_whole():
            return "any"
        if self.is_empty():
            return "none"
        parts = []
        for proto, ranges in (("tcp", self.tcp), ("udp", self.udp)):
            if ranges:
                text = ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)
                parts.append(f"{proto} {text}")
        if self.other:
            parts.append("other protocols")
        return " ".join(parts)


Scope.WHOLE = Scope(_ALL_PORTS, _ALL_PORTS, True)
Scope.EMPTY = Scope()


#: The rule ``protocol`` values (§18); ``http``/``https`` are TCP with a default port.
PROTOCOLS: Final = ("tcp", "udp", "http", "https")
DEFAULT_PORTS: Final = {"http": ((80, 80),), "https": ((443, 443),)}


def rule_scope(protocol: str | None, ports: tuple[PortRange, ...] | None) -> Scope:
    """What a rule with these fields opens or denies."""
    if protocol is None and ports is None:
        return Scope.WHOLE
    if ports is None:
        ports = DEFAULT_PORTS.get(protocol or "", _ALL_PORTS)
    if protocol == "udp":
        return Scope.of(udp=ports)
    if protocol is None:
        return Scope.of(tcp=ports, udp=ports)
    return Scope.of(tcp=ports)
