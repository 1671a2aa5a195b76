"""Resolving the webhook's host name through egressd's own upstream forwarder (sidecar).

In the sidecar every DNS packet of the namespace is redirected to egressd's proxy and judged
by the sandbox's policy: resolving the webhook host the ordinary way would be denied, and that
denial would queue another webhook event. The forwarder's sockets carry ``SO_MARK 0x1``,
exempt from the redirect, so the lookup reaches the upstream resolvers directly, and it never
passes the policy (the operator chose the URL, not the sandbox).
"""

from __future__ import annotations

import ipaddress
import socket

from aiohttp.abc import AbstractResolver, ResolveResult
from dnslib import QTYPE, DNSRecord

from egressd.dnsproxy.forwarder import Forwarder


class ForwarderResolver(AbstractResolver):
    def __init__(self, forwarder: Forwarder) -> None:
        self._forwarder = forwarder

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        out: list[ResolveResult] = []
        for qtype, fam in (("A", socket.AF_INET), ("AAAA", socket.AF_INET6)):
            if family not in (socket.AF_UNSPEC, fam):
                continue
            forwarded = await self._forwarder.forward(DNSRecord.question(host, qtype))
            reply = forwarded.reply
            if reply is None:
                continue
            for rr in reply.rr:
                if rr.rtype != getattr(QTYPE, qtype):
                    continue
                try:
                    addr = ipaddress.ip_address(str(rr.rdata))
                except ValueError:
                    continue
                out.append(
                    ResolveResult(
                        hostname=host,
                        host=str(addr),
                        port=port,
                        family=fam,
                        proto=0,
                        flags=socket.AI_NUMERICHOST,
                    )
                )
        if not out:
            raise OSError(f"cannot resolve {host!r} through the upstream resolvers")
        return out

    async def close(self) -> None:
        return None
