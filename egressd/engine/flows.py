"""The flow cut both profiles run after a narrowing (docs/reference/behaviour.md §8.3): best effort.

The kernel refuses new flows the moment a change narrows access, but established ones are
accepted first, so each profile reads the conntrack table, judges every tracked flow by its
new policy, and deletes the ones it refuses. What a flow is and how it is judged and deleted
belongs to the profile (the fleet: one subject's source addresses, per (source, destination);
the sidecar: every outbound destination of the namespace); the loop, its order and its failure
handling are this one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

import structlog

log = structlog.get_logger("egressd.engine.flows")

async def cut_refused[Flow](
    flows: Iterable[Flow],
    allowed: Callable[[Flow], bool],
    delete: Callable[[Flow], Awaitable[None]],
    fields: Callable[[Flow], dict[str, str]],
) -> int:
    """Delete, in the order given, every flow ``allowed`` refuses; returns how many were cut.

    A failed delete is logged (``conntrack.cut_failed`` with ``fields(flow)``) and the rest go
    on: the kernel already refuses new flows, so a cut that fails leaves nothing open."""
    cut = 0
    for flow in flows:
        if allowed(flow):
            continue
        try:
            await delete(flow)
            cut += 1
        except Exception as exc:
            log.warning("conntrack.cut_failed", **fields(flow), error=str(exc)[:200])
    return cut
