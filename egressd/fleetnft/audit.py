"""Audit mode in the fleet ruleset (a policy with ``"mode": "audit"``). Pure.

Audit mode is set content too, once the subject has its audit objects
(:func:`egressd.fleetnft.subject.audit_objects`, added in the transaction of its first audit
policy and kept until removal; a subject that never audits has 6 fewer sets, and every
set-name lookup in the kernel walks the table's whole list of sets). Three rule pairs at the
end of ``mark_<id>`` (:func:`audit_mark_rules`) log (``log prefix "egressd would-deny <id> "``),
count (named counters ``subj_<id>_audit_deny`` / ``subj_<id>_audit_default``) and mark new flows
to ``wdeny`` (the user's deny prefixes, moved out of ``deny`` while auditing), to ``wdenyp``
(the user's deny rules with ports, moved out of ``denyp``: docs/reference/behaviour.md §18) and,
if still unmarked, to ``audit`` (``0.0.0.0/0`` / ``::/0`` while auditing). Both are empty unless the
active policy audits, so deny-first (all sets empty) and enforcing subjects are unchanged, and
switching audit on or off is the same atomic swap as any policy change. ``deny`` keeps the
operator's always-deny prefixes in audit mode: those stay hard, like the lateral, DoT and DoH
drops of the header, which audit never touches.
"""

from __future__ import annotations

from egressd.fleetnft.table import AUDIT_COUNTERS, Names
from egressd.kernel.ops import AddRule, AuditRule, Op


def audit_counter_subject(name: str) -> tuple[str, str] | None:
    """``subj_<id>_audit_<kind>`` -> (nft id, kind), else None."""
    for kind in AUDIT_COUNTERS:
        suffix = f"_audit_{kind}"
        if name.startswith("subj_") and name.endswith(suffix):
            return name[len("subj_") : -len(suffix)], kind
    return None


def audit_mark_rules(n: Names) -> list[Op]:
    """The audit rules at the end of the subject's ``mark_<id>`` (with its audit objects): they
    match nothing while ``wdeny`` and ``audit`` are empty."""
    ops: list[Op] = []
    # A user-denied prefix is logged even inside an allowed one (deny beats allow, as enforced).
    for fam in ("v4", "v6"):
        rule = AuditRule(fam, n.set(f"wdeny_{fam}"), n.set(f"deny_{fam}"), n.log_prefix, n.counter("deny"))
        ops.append(AddRule(n.mark_chain, rule))
    # The user's deny rules with ports (docs/reference/behaviour.md §18), likewise.
    for fam in ("v4", "v6"):
        rule = AuditRule(
            fam, n.set(f"wdenyp_{fam}"), n.set(f"deny_{fam}"), n.log_prefix, n.counter("deny"), ports=True
        )
        ops.append(AddRule(n.mark_chain, rule))
    for fam in ("v4", "v6"):
        rule = AuditRule(
            fam,
            n.set(f"audit_{fam}"),
            n.set(f"deny_{fam}"),
            n.log_prefix,
            n.counter("default"),
            unmarked_only=True,
        )
        ops.append(AddRule(n.mark_chain, rule))
    return ops
