"""How this kernel renews a DNS lease (a timed set element): the start-up probe's verdict.

The connection refresh (docs/reference/behaviour.md §9) and a repeated DNS answer extend a lease by adding the
element again with a new timeout. Only newer kernels update the timeout and expiry of an
element that exists; older ones (the reference found it on Linux 5.10 with nftables 1.0.2)
keep the old expiry and answer success, so a lease of a live connection would run out
silently. The self-test's last probe (:func:`probe`, in each backend's scratch table) adds an
element, adds it again with a longer timeout and reads the expiry back; where it did not move,
leases are renewed by delete + add in one transaction (preceded by an add, so the delete never
meets a missing or already expired element and aborts the batch).
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Callable

from egressd.engine.selftest import SelfTestError
from egressd.kernel.netlink_dump import SetElement

#: First and second timeout of the probe element, in seconds.
PROBE_FIRST_S = 20
PROBE_SECOND_S = 300
#: The probe element (TEST-NET-1: never a real destination).
PROBE_IP = ipaddress.IPv4Address("192.0.2.9")


class LeaseRenewal(enum.StrEnum):
    READD = "re-add"  # adding an existing element again sets its new timeout and expiry
    REPLACE = "delete+add"  # it does not: delete and add the element in one transaction


def extended(expires_ms: int | None, first_s: int = PROBE_FIRST_S) -> bool:
    """Whether an element first added with ``first_s`` now expires later than that allowed:
    the second add took effect. Unknown (None) counts as not extended."""
    return expires_ms is not None and expires_ms > first_s * 1000


def probe(add: Callable[[int, bool], None], elements: Callable[[], list[SetElement]]) -> LeaseRenewal:
    """How this kernel renews a lease, the way the backend renews one: ``add(seconds, replace)``
    adds (or with ``replace`` deletes and adds) :data:`PROBE_IP` with a timeout, ``elements``
    reads its set back (one netlink dump). Add with a short timeout, add again with a long one:
    if the expiry did not move, the delete+add form must move it, or :class:`SelfTestError`."""

    def expiry() -> int | None:
        hit = next((e for e in elements() if e.key == PROBE_IP.packed), None)
        return hit.expires_ms if hit is not None else None

    add(PROBE_FIRST_S, False)
    add(PROBE_SECOND_S, False)
    if extended(expiry()):
        return LeaseRenewal.READD
    add(PROBE_SECOND_S, True)
    if extended(expiry()):
        return LeaseRenewal.REPLACE
    raise SelfTestError(
        "kernel feature missing: timed set element renewal (neither a re-add nor delete+add "
        "extended a DNS lease)"
    )
