"""Host-uid sandboxes (docs/reference/behaviour.md §17): the uid range, the per-subject port block, slot choice.

A host-uid sandbox shares egressd's network namespace and differs from the host's own
processes only by its uid, so that uid is its dispatch key (``meta skuid``). Every subject of
this kind also gets a *slot*, a small number that names its own DNS port (the proxy knows who
asks by the port the kernel redirected the query to) and, with the MITM, its own MITM port.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

#: Host uids a SET_BINDING may name in ``attachment.process.uid``: 1..2^32-2 (0 is root,
#: 2^32-1 is the kernel's "no uid", ``(uid_t)-1``).
HOST_UID_MIN = 1
HOST_UID_MAX = 2**32 - 2


@dataclass(frozen=True, slots=True)
class UidRange:
    """``EGRESSD_UID_RANGE``: the host uids that belong to sandboxes (inclusive bounds)."""

    first: int
    last: int

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, int) and not isinstance(uid, bool) and self.first <= uid <= self.last

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


DEFAULT_UID_RANGE = UidRange(100000, 165535)


def host_uid_problem(uid: int, uid_range: UidRange, own_uid: int | None) -> str | None:
    """Why the host uid ``uid`` cannot key a sandbox (400), or None when it can.

    Outside the range run the host's own processes: keying one of them would put a host
    process under a sandbox's policy. egressd's own sockets are exempt from its rules, so a
    subject keyed by egressd's uid would be no subject at all.
    """
    if not HOST_UID_MIN <= uid <= HOST_UID_MAX:
        return f"must be in {HOST_UID_MIN}..{HOST_UID_MAX}"
    if uid not in uid_range:
        return f"{uid} is outside EGRESSD_UID_RANGE {uid_range}"
    if own_uid is not None and uid == own_uid:
        return f"{uid} is egressd's own uid"
    return None


@dataclass(frozen=True, slots=True)
class UidPorts:
    """The uid range and the host-uid subjects' ports, all from ``EGRESSD_UID_DNS_PORT_BASE``:

    * ``base + slot`` (slot 0..max_subjects-1): the subject's own DNS port;
    * ``base + max_subjects``: DNS of in-range uids that are no subject (always NXDOMAIN,
      like an unknown source address);
    * ``base + max_subjects + 1 + slot``: the subject's own MITM port.
    """

    uid_range: UidRange = DEFAULT_UID_RANGE
    base: int = 16000
    max_subjects: int = 256

    def dns_port(self, slot: int) -> int:
        return self.base + slot

    @property
    def unknown_dns_port(self) -> int:
        return self.base + self.max_subjects

    def mitm_port(self, slot: int) -> int:
        return self.base + self.max_subjects + 1 + slot

    @property
    def dns_ports(self) -> tuple[int, int]:
        """First and last DNS port, the unknown uids' included."""
        return self.base, self.unknown_dns_port

    @property
    def mitm_ports(self) -> tuple[int, int]:
        return self.mitm_port(0), self.mitm_port(self.max_subjects - 1)

    @property
    def last(self) -> int:
        return self.mitm_port(self.max_subjects - 1)

    def slot_of_dns_port(self, port: int) -> int | None:
        slot = port - self.base
        return slot if 0 <= slot < self.max_subjects else None

    def slot_of_mitm_port(self, port: int) -> int | None:
        slot = port - self.mitm_port(0)
        return slot if 0 <= slot < self.max_subjects else None


DEFAULT_UID_PORTS = UidPorts()


def free_slot(used: Collection[int], max_subjects: int) -> int | None:
    """The lowest slot nobody uses (None: all taken). Lowest-first keeps the ports of a
    small fleet at the bottom of the block, where an operator looks for them."""
    for slot in range(max_subjects):
        if slot not in used:
            return slot
    return None
