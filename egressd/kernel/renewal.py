"""How this kernel renews a DNS lease (a timed set element): the start-up probe's verdict.

The connection refresh (docs/behaviour.md §9) and a repeated DNS answer extend a lease by adding the
element again with a new timeout. Only newer kernels update the timeout and expiry of an
element that exists; older ones (the reference found it on Linux 5.10 with nftables 1.0.2)
keep the old expiry and answer success, so a lease of a live connection would run out
silently. The self-tests (:mod:`egressd.fleetnft.selftest`, :mod:`egressd.sidecarnft.selftest`)
add an element, add it again with a longer timeout and read the expiry back; where it did not
move, leases are renewed by delete + add in one transaction (preceded by an add, so the
delete never meets a missing or already expired element and aborts the batch).
"""

from __future__ import annotations

import enum

#: First and second timeout of the probe element, in seconds.
PROBE_FIRST_S = 20
PROBE_SECOND_S = 300


class LeaseRenewal(enum.StrEnum):
    READD = "re-add"  # adding an existing element again sets its new timeout and expiry
    REPLACE = "delete+add"  # it does not: delete and add the element in one transaction


def extended(expires_ms: int | None, first_s: int = PROBE_FIRST_S) -> bool:
    """Whether an element first added with ``first_s`` now expires later than that allowed:
    the second add took effect. Unknown (None) counts as not extended."""
    return expires_ms is not None and expires_ms > first_s * 1000
