"""Audit-mode evidence of the fleet profile at the IP layer: the kernel's per-subject counters as
``egressd_policy_would_deny_total{layer="ip"}``, and the metric series' lifecycle.

The IP-layer evidence is the named counters ``subj_<id>_audit_deny`` (new flows to a prefix of
the user's deny rules) and ``subj_<id>_audit_default`` (new flows no allow rule, lease or deny
rule matched), incremented by the subject's audit rules, which also write a kernel log line
``egressd would-deny <id> `` (visible only where the kernel logs for this network namespace:
``net.netfilter.nf_log_all_netns=1`` on the host, or the initial namespace). Kernel lines are
not correlated with DNS decision ids: a packet does not know which answer it came from.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from egressd.engine.counters import read_or_keep
from egressd.fleetnft.audit import audit_counter_subject
from egressd.metrics import EgressMetrics
from egressd.policy.audit import safe_token
from egressd.subject.model import subject_for_uid
from egressd.subject.registry import Entry

IP_RULE = {"deny": "egress-deny", "default": "default"}  # counter kind -> metric rule label

Samples = dict[tuple[str, ...], float]


def counter_samples(counters: dict[str, int], subjects: dict[str, str]) -> Samples:
    """The table's counters (name -> packets) -> {(subject, "ip", rule): new flows}.

    ``subjects`` maps nft ids to subject names; counters of ids not in it (a subject being
    removed) are skipped, so the metric never names a subject that is gone.
    """
    out: Samples = {}
    for name, packets in counters.items():
        parsed = audit_counter_subject(name)
        if parsed is None or parsed[0] not in subjects or packets <= 0:
            continue
        out[(subjects[parsed[0]], "ip", IP_RULE[parsed[1]])] = float(packets)
    return out


class AuditEvidence:
    """Reads the kernel counters before each scrape and forgets a subject's DNS series with it.

    ``read`` returns the table's counters (name -> packets; one netlink dump on the kernel
    thread); ``entries`` lists the registered subjects.
    """

    def __init__(
        self,
        metrics: EgressMetrics,
        read: Callable[[], Awaitable[dict[str, int]]],
        entries: Callable[[], Iterable[Entry]],
    ) -> None:
        self.metrics = metrics
        self._read = read
        self._entries = entries
        self._samples: Samples = {}
        metrics.would_deny.collect_from(lambda: dict(self._samples))

    async def refresh(self) -> None:
        """Before a scrape. A failed read keeps the last samples (counters only ever grow)."""
        subjects = {e.nft_id: safe_token(e.subject) for e in self._entries()}
        if not subjects:
            self._samples = {}
            return
        counters = await read_or_keep(self._read, "audit.counters_unreadable")
        if counters is None:
            return
        self._samples = counter_samples(counters, subjects)

    # ---- SubjectListener: a subject's DNS-layer series go with the subject ---------------------

    def _forget(self, uid: str) -> None:
        subject = safe_token(subject_for_uid(uid))
        self.metrics.would_deny.forget(lambda labels: labels[0] != subject)
        self.metrics.dns_rate_limited.forget(lambda labels: labels[0] != subject)

    async def registered(self, entry: Entry) -> None:
        return None

    async def unbound(self, uid: str) -> None:
        return None

    async def reset(self, uid: str) -> None:
        return None

    async def removed(self, uid: str) -> None:
        self._forget(uid)
