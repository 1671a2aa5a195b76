"""Network policy (§5): parsing, DNS evaluation, IP sets, always-rules and /policy edits."""

from egressd.policy.always import (
    EMPTY_ALWAYS,
    AlwaysRules,
    AlwaysRulesError,
    effective_policy,
    load_always_rules,
    parse_always_text,
)
from egressd.policy.edit import check_rule_cap, delete_targets, merge_patch
from egressd.policy.evaluate import Decision, domain_matches, evaluate_domain, normalise_name
from egressd.policy.ipsets import IpSets, format_element, ip_sets, normalise_networks
from egressd.policy.model import (
    DENY_ALL,
    IPNetwork,
    NetworkPolicy,
    PolicyError,
    PolicyMode,
    Rule,
    TargetKind,
    Verdict,
    parse_policy,
    parse_policy_obj,
    parse_rule,
    parse_target,
    policy_mode,
)

__all__ = [
    "DENY_ALL",
    "EMPTY_ALWAYS",
    "AlwaysRules",
    "AlwaysRulesError",
    "Decision",
    "IPNetwork",
    "IpSets",
    "NetworkPolicy",
    "PolicyError",
    "PolicyMode",
    "Rule",
    "TargetKind",
    "Verdict",
    "check_rule_cap",
    "delete_targets",
    "domain_matches",
    "effective_policy",
    "evaluate_domain",
    "format_element",
    "ip_sets",
    "load_always_rules",
    "merge_patch",
    "normalise_name",
    "normalise_networks",
    "parse_always_text",
    "parse_policy",
    "parse_policy_obj",
    "parse_rule",
    "parse_target",
    "policy_mode",
]
