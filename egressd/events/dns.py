"""The DNS proxy's one hook into the visibility events (docs/reference/behaviour.md §15).

:meth:`DnsEvents.denied` runs for every refusal the proxy answers and
:meth:`DnsEvents.answered` for every allowed answer; both return at once (no I/O, no await):
the webhook only queues, the ring only appends, the outbound line is rate-limited.

Which denials count: names a known subject asked that its policy (or its deny-first state)
denies, i.e. NXDOMAIN for reason ``policy`` or ``denying``. Malformed or refused messages and
unknown sources are not a sandbox's denied name: they have no sandbox to name, and an unknown
source could otherwise fill the webhook queue for everybody (they stay in the denial log and
``egress_policy_denied_total``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from egressd.addr import IPAddress
from egressd.events.denials import RecentDenials
from egressd.events.outbound import OutboundLog
from egressd.events.webhook import DenyWebhook
from egressd.policy.audit import safe_token
from egressd.subject.model import subject_for_uid

DENIAL_REASONS = frozenset({"policy", "denying"})


class DnsEvents:
    def __init__(
        self,
        *,
        webhook: DenyWebhook | None = None,
        denials: RecentDenials | None = None,
        outbound: OutboundLog | None = None,
        sandbox_id: Callable[[str], str] = lambda uid: uid,
    ) -> None:
        self.webhook = webhook
        self.denials = denials
        self.outbound = outbound if outbound is not None else OutboundLog()
        # Fleet: the subject's uid; sidecar: OPENSANDBOX_EGRESS_SANDBOX_ID.
        self._sandbox_id = sandbox_id

    def denied(self, uid: str | None, name: str, reason: str, rule: str) -> None:
        if uid is None or reason not in DENIAL_REASONS or not name:
            return
        if self.denials is not None:
            self.denials.add(uid, name, rule)
        if self.webhook is not None:
            self.webhook.publish(name, self._sandbox_id(uid))

    def refused_on_wire(self, uid: str, name: str, rule: str, port: int | None = None) -> None:
        """The MITM refused a connection or request of ``uid`` by the name it asked for
        (docs/reference/behaviour.md §18; ``name``: the SNI or Host, or the address when it named none):
        reported like a denied DNS name."""
        if not name:
            return
        if self.denials is not None:
            self.denials.add(uid, name, rule, port=port)
        if self.webhook is not None:
            self.webhook.publish(name, self._sandbox_id(uid))

    def refused_request(self, uid: str, host: str, port: int | None, method: str, path: str) -> None:
        """The MITM refused a request of ``uid`` by the request rules (docs/reference/behaviour.md
        §19): kept in the recent denials and posted with its method and path (no query)."""
        if not host:
            return
        path = path.split("?", 1)[0]
        if self.denials is not None:
            self.denials.add(uid, host, "request", port=port, method=method, path=path)
        if self.webhook is not None:
            self.webhook.publish(host, self._sandbox_id(uid), method, path)

    def answer_due(self, uid: str) -> bool:
        """Whether :meth:`answered` would log (lets the proxy skip collecting addresses)."""
        return self.outbound.due(uid)

    def answered(self, uid: str, name: str, ips: Sequence[IPAddress], error: str | None = None) -> None:
        """An allowed answer whose line :meth:`answer_due` granted."""
        self.outbound.emit(safe_token(subject_for_uid(uid)), name, ips, error)
