"""The sidecar's forwarder: the shared one, plus a note of which name each answer was for.

The shared DNS proxy hands the engine only addresses and TTLs; the sidecar also needs the
question name behind each address so that a policy change can keep exactly the leases the
new policy still allows (see :class:`egressd.sidecar.engine.SidecarEngine`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dnslib import DNSRecord

from egressd.dnsproxy.decide import answer_addresses
from egressd.dnsproxy.forwarder import Forwarded, Forwarder
from egressd.dnsproxy.upstreams import Upstream
from egressd.subject.model import IPAddress


class NamingForwarder(Forwarder):
    def __init__(
        self,
        upstreams: Sequence[Upstream],
        timeout: float,
        on_answer: Callable[[str, list[IPAddress]], None],
    ) -> None:
        super().__init__(upstreams, timeout)
        self._on_answer = on_answer

    async def forward(self, query: DNSRecord, *, tcp: bool = False) -> Forwarded:
        result = await super().forward(query, tcp=tcp)
        if result.reply is not None and query.questions:
            ips = [ip for ip, _ in answer_addresses(result.reply)]
            if ips:
                self._on_answer(str(query.q.qname), ips)
        return result
