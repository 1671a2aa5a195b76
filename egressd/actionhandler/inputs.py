"""Decoding of ``binding.input``: a bare policy (§5) or the ``osbEgressInput`` wrapper (§11).

Everything is decided here, before any mutation, in the order of §11: wrapper JSON -> policy
(400) -> AEAD open (400, never 500) -> §6 validation against the wrapper's policy plus the
always-rules (400). Reasons never contain input content, ciphertext or plaintext.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

from egressd.policy import (
    EMPTY_ALWAYS,
    AlwaysRules,
    NetworkPolicy,
    PolicyError,
    effective_policy,
    parse_policy,
    parse_policy_obj,
    rule_cap_problem,
)
from egressd.vault.model import DEFAULT_LIMITS, VaultContent, VaultError, VaultLimits, parse_create
from egressd.vault.sealed import (
    KeyStore,
    SealError,
    decode_vault_plaintext,
    is_wrapper,
    open_sealed,
    parse_sealed,
    parse_wrapper,
)
from egressd.vault.store import VaultStore


class InputError(ValueError):
    """The binding input cannot be used; ``str()`` is a one-line reason without input content."""


class VaultAction(enum.StrEnum):
    KEEP = "keep"  # a bare policy string: the vault (e.g. from proxy-route pushes) stays
    REMOVE = "remove"  # a wrapper without a vault, or "vault": null
    SET = "set"  # a wrapper with a sealed vault


@dataclass(frozen=True, slots=True)
class BindingInput:
    policy: NetworkPolicy
    vault: VaultAction = VaultAction.KEEP
    content: VaultContent | None = field(default=None, repr=False)
    #: The coverage policy ``content`` was validated against (14.7): activating it under an
    #: equal policy needs no second validation on the event loop.
    validated_against: NetworkPolicy | None = field(default=None, repr=False)


def parse_binding_input(
    text: str,
    *,
    uid: str = "",
    keys: KeyStore | None = None,
    always: AlwaysRules = EMPTY_ALWAYS,
    max_rules: int = 0,
    limits: VaultLimits = DEFAULT_LIMITS,
) -> BindingInput:
    """Parse before any mutation (§3 step 1); raises :class:`InputError` (-> 400).

    ``max_rules``: OPENSANDBOX_EGRESS_MAX_RULES (0 = unlimited), checked on the user policy
    of a bare policy and of a sealed wrapper alike, before a sealed vault is opened. A sealed
    vault is held to ``limits`` (14.7) like a vault pushed through the proxy route. Pure: the
    daemon runs it in the vault worker thread."""
    stripped = text.strip()
    obj: object = None
    if stripped.startswith("{"):
        try:
            obj = json.loads(stripped)
        except (ValueError, RecursionError):
            obj = None
    if is_wrapper(obj):
        return _parse_wrapper(obj, uid, keys, always, max_rules, limits)
    try:
        # Already decoded above when it looked like an object: not parsed a second time.
        policy = parse_policy_obj(obj) if isinstance(obj, dict) else parse_policy(text)
    except PolicyError as exc:
        raise InputError(f"invalid policy: {exc.without_input()}") from None
    _check_cap(policy, max_rules)
    return BindingInput(policy)


def _check_cap(policy: NetworkPolicy, max_rules: int) -> None:
    problem = rule_cap_problem(policy, max_rules)
    if problem is not None:
        raise InputError(problem)


def _parse_wrapper(
    obj: object, uid: str, keys: KeyStore | None, always: AlwaysRules, max_rules: int, limits: VaultLimits
) -> BindingInput:
    try:
        wrapper = parse_wrapper(obj)
    except SealError as exc:
        raise InputError(str(exc)) from None
    try:
        policy = parse_policy_obj(wrapper.policy)
    except PolicyError as exc:
        raise InputError(f"invalid policy: {exc.without_input()}") from None
    _check_cap(policy, max_rules)  # before any decryption: an over-cap input costs no AEAD work
    if wrapper.vault is None:
        return BindingInput(policy, VaultAction.REMOVE)
    try:
        sealed = parse_sealed(wrapper.vault)
        ring = keys.lookup(sealed.kid) if keys is not None else KeyStore(None).ring
        content = parse_create(decode_vault_plaintext(open_sealed(sealed, uid, ring)), limits)
        coverage = effective_policy(policy, always)
        VaultStore(limits=limits).check_content(content, coverage)
    except SealError as exc:
        raise InputError(str(exc)) from None
    except VaultError as exc:
        # The plaintext was sealed for a reason: name the field, never quote what it held.
        raise InputError(f"vault: {exc.without_values()}") from None
    return BindingInput(policy, VaultAction.SET, content, coverage)
