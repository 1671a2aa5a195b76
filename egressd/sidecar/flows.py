"""Cutting established flows the sidecar's policy no longer allows (best effort, off the reply).

``ct state established,related accept`` comes first in the output chain, so narrowing a
policy does not end connections the kernel already accepted. After every change the sidecar
reads the conntrack table and deletes the flows whose original destination the new ruleset
would drop; flows to allowed destinations keep running. Flows whose destination is one of the
namespace's own addresses (clients of the API, loopback) are never touched.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Iterable

import structlog

from egressd.addr import IPAddress, unmap_ip
from egressd.engine.flows import cut_refused
from egressd.kernel.conntrack import conntrack_delete, original_tuple, read_table

log = structlog.get_logger("egressd.sidecar.flows")


def outbound_destinations(conntrack_text: str, local: Iterable[IPAddress]) -> set[IPAddress]:
    """Original destinations of tracked flows, minus the namespace's own addresses (pure)."""
    own = set(local)
    out: set[IPAddress] = set()
    for line in conntrack_text.splitlines():
        t = original_tuple(line)
        if t is None:
            continue
        dst = t[1]
        if dst in own or dst.is_loopback:
            continue
        out.add(dst)
    return out


def local_addresses() -> set[IPAddress]:
    """Every address configured in this network namespace (netlink)."""
    from pyroute2 import IPRoute

    addrs: set[IPAddress] = set()
    with IPRoute() as ipr:
        for msg in ipr.get_addr():
            raw = msg.get_attr("IFA_ADDRESS")
            if raw:
                try:
                    addrs.add(unmap_ip(ipaddress.ip_address(str(raw).split("%", 1)[0])))
                except ValueError:
                    continue
    return addrs


async def cut_disallowed(allowed: Callable[[IPAddress], bool]) -> int:
    """Delete the conntrack entries of outbound flows whose destination is no longer allowed."""
    text = await read_table()
    if text is None:
        return 0
    try:
        local = await asyncio.to_thread(local_addresses)
    except Exception as exc:  # without the local set we could cut the API's own clients
        log.warning("conntrack.cut_skipped", error=str(exc)[:200])
        return 0
    cut = await cut_refused(
        sorted(outbound_destinations(text, local), key=str),
        allowed,
        lambda dst: conntrack_delete(["-d", str(dst)], dst.version),
        lambda dst: {"destination": str(dst)},
    )
    if cut:
        log.info("conntrack.cut", destinations=cut)
    return cut
