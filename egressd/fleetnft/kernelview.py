"""What the fleet's kernel itself holds, read back for /v1/explain and the rules gauge.

Read-only, one netlink dump per set, never egressd's own bookkeeping: the engine's report
(egressd/actionhandler/report.py) asks, this reads (:class:`egressd.engine.plansteps.KernelReader`).
"""

from __future__ import annotations

import ipaddress
import struct
from typing import Any

from egressd.addr import IPAddress, unmap_ip
from egressd.fleetnft.hostuid import UID_DISPATCH
from egressd.fleetnft.subject import rules_per_subject
from egressd.fleetnft.table import TableConfig, dispatch_map, subject_set
from egressd.kernel.applier import Transactions
from egressd.kernel.netlink_dump import element_covering
from egressd.nftsyntax import family


class FleetKernelView:
    def __init__(self, cfg: TableConfig, tx: Transactions) -> None:
        self._cfg = cfg
        self._tx = tx

    async def covering(self, nft_id: str, target: IPAddress) -> list[dict[str, Any]]:
        """Which of the subject's sets cover the address (with the remaining lifetime of a DNS
        lease). Raises NftError when a dump is refused."""
        table, out = self._cfg.table, []
        for kind, interval in (("deny", True), ("allow", True), ("dyn", False)):
            name = subject_set(nft_id, kind, family(target))
            hit = element_covering(target, await self._tx.list_set_elements(table, name), interval=interval)
            if hit is None:
                continue
            element, end = hit
            item: dict[str, Any] = {
                "set": name,
                "element": _element_text(element.key, end, interval=interval),
            }
            if element.expires_ms is not None:
                item["expiresInS"] = round(element.expires_ms / 1000)
            out.append(item)
        return out

    async def dispatched(self, source: IPAddress | int) -> bool:
        """Whether the kernel's dispatch map holds the source (its uid map for a host uid)."""
        dump, table = self._tx.list_set_elements, self._cfg.table
        if isinstance(source, int):
            key = struct.pack("=I", source)  # meta skuid's host-endian u32
            return any(e.key == key for e in await dump(table, UID_DISPATCH))
        source = unmap_ip(source)
        return (
            element_covering(source, await dump(table, dispatch_map(family(source))), interval=False)
            is not None
        )

    def rules_per_subject(self, *, audit: bool, ranges: bool) -> int:
        return rules_per_subject(self._cfg, audit=audit, ranges=ranges)


def _element_text(start: bytes, end: bytes | None, *, interval: bool) -> str:
    """A set element as nft would print it: an address, or an interval [start, end) as CIDR(s)
    (``end`` None in an interval set: up to the top of the address space)."""
    first = ipaddress.ip_address(start)
    if not interval:
        return str(first)
    top = (1 << (8 * len(start))) - 1
    last = ipaddress.ip_address(int.from_bytes(end, "big") - 1 if end is not None else top)
    nets = ipaddress.summarize_address_range(first, last)
    return ", ".join(str(n.network_address) if n.num_addresses == 1 else str(n) for n in nets)
