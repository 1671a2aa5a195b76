"""Incremental edits behind the ``/policy`` PATCH and DELETE endpoints (§5)."""

from __future__ import annotations

import contextlib
from dataclasses import replace

from egressd.policy.idn import IdnaError, to_alabels
from egressd.policy.ipsets import ip_sets
from egressd.policy.model import NetworkPolicy, PolicyError, Rule, json_type, parse_rule
from egressd.policy.portmatch import MAX_PORT_ELEMENTS, port_elements_needed
from egressd.policy.requests import unenforceable_problem


def merge_patch(policy: NetworkPolicy, patch_body: object) -> NetworkPolicy:
    """Patch rules then existing rules, keyed by lower-cased target, first occurrence kept.

    An existing rule is replaced by any patch rule on its target. Rules on one target that
    differ in protocol or ports (§18) are different keys, all kept (a patch
    ``[allow x.io ports 443, deny x.io]`` means both). ``patch_body`` is the decoded JSON body and must be a non-empty array
    of rule objects. The defaultAction and mode are unchanged.
    """
    if not isinstance(patch_body, list):
        raise PolicyError(f"PATCH body must be a non-empty JSON array of rules, got {json_type(patch_body)}")
    if not patch_body:
        raise PolicyError("PATCH body must be a non-empty JSON array of rules, got an empty array")
    patch = [parse_rule(item, f"[{i}]") for i, item in enumerate(patch_body)]
    patched = {rule.target.lower() for rule in patch}
    existing = (rule for rule in policy.egress if rule.target.lower() not in patched)
    merged: dict[str, list[Rule]] = {}
    order: list[Rule] = []
    for rule in (*patch, *existing):
        same_target = merged.setdefault(rule.target.lower(), [])
        if any(rule.same_match(kept) for kept in same_target):
            continue
        same_target.append(rule)
        order.append(rule)
    return replace(policy, egress=tuple(order))


def delete_targets(policy: NetworkPolicy, body: object) -> tuple[NetworkPolicy, int]:
    """Remove rules whose lower-cased target equals a trimmed, lower-cased entry of ``body``.

    ``body`` must be a non-empty array of strings; blank entries match nothing. Returns the
    new policy (``policy`` itself when nothing matched) and the number of rules removed.
    """
    if not isinstance(body, list) or not body:
        got = "an empty array" if isinstance(body, list) else json_type(body)
        raise PolicyError(f"DELETE body must be a non-empty JSON array of target strings, got {got}")
    keys: set[str] = set()
    for i, entry in enumerate(body):
        if not isinstance(entry, str):
            raise PolicyError(f"must be a string, got {json_type(entry)}", f"[{i}]")
        key = entry.strip()
        # Stored domain targets are A-labels: DELETE ["évil.com"] removes what
        # {"target": "évil.com"} added. An entry that is no valid name matches nothing.
        with contextlib.suppress(IdnaError):
            key = to_alabels(key)
        key = key.lower()
        if key:
            keys.add(key)
    kept = tuple(r for r in policy.egress if r.target.lower() not in keys)
    removed = len(policy.egress) - len(kept)
    if not removed:
        return policy, 0
    return replace(policy, egress=kept), removed


#: Where the cap comes from, named in every refusal so the operator knows what to raise.
RULE_CAP_SETTING = "OPENSANDBOX_EGRESS_MAX_RULES"


def check_rule_cap(policy: NetworkPolicy, cap: int) -> bool:
    """True when ``policy`` has at most ``cap`` rules; ``cap`` 0 means unlimited.

    Counted: the entries of the policy's ``egress`` list as the tenant sent them (after a
    PATCH merge), domains and IP/CIDR rules alike. Not counted: the operator's always-rules
    (``deny.always`` / ``allow.always``) and the sidecar's resolver addresses. They join the
    effective policy on every apply, but they are not the tenant's to trim, so they never use
    up the tenant's cap (the kernel sets are sized by content, not by this cap).
    """
    if cap < 0:
        raise ValueError(f"rule cap must be >= 0, got {cap}")
    return cap == 0 or len(policy.egress) <= cap


def rule_cap_problem(policy: NetworkPolicy, cap: int) -> str | None:
    """One-line refusal naming the limit, or None when ``policy`` is within ``cap``, its
    address rules with ports fit the kernel's bound (docs/reference/behaviour.md §18,
    :data:`egressd.policy.portmatch.MAX_PORT_ELEMENTS`) and its request rules can be enforced
    (§19, :func:`egressd.policy.requests.unenforceable_problem`): every entry point of a user
    policy checks here."""
    problem = unenforceable_problem(policy)
    if problem is not None:
        return problem
    if not check_rule_cap(policy, cap):
        return f"policy has {len(policy.egress)} rules, more than {RULE_CAP_SETTING}={cap}"
    needed = port_elements_needed(ip_sets(policy))
    if needed > MAX_PORT_ELEMENTS:
        return (
            f"the address rules with ports need {needed} port ranges in the kernel, "
            f"more than {MAX_PORT_ELEMENTS}"
        )
    return None
