"""Decoding of a SET_BINDING: ``binding.input``, a bare policy (§5) or the ``osbEgressInput``
wrapper (§11), and the attachment's dispatch key.

Everything is decided here, before any mutation, in the order of §11: wrapper JSON -> policy
(400) -> AEAD open (400, never 500) -> §6 validation against the wrapper's policy plus the
always-rules (400). Reasons never contain input content, ciphertext or plaintext.
"""

from __future__ import annotations

import enum
import functools
import json
from dataclasses import dataclass, field

from egressd.actionhandler.envelope import SetBinding
from egressd.addr import IPAddress
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
from egressd.subject.registry import Binding, SetBindingRequest
from egressd.vault.keys import KeyStore
from egressd.vault.offload import off_loop
from egressd.vault.parse import parse_create
from egressd.vault.sealed import (
    WRAPPER_MARKER,
    SealError,
    decode_vault_plaintext,
    is_wrapper,
    open_sealed,
    parse_sealed,
    parse_wrapper,
)
from egressd.vault.store import VaultStore
from egressd.vault.types import DEFAULT_LIMITS, VaultContent, VaultError, VaultLimits


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


class BadRequest(ValueError):
    """A SET_BINDING that cannot be used; ``str()`` is the whole 400 reason (never input content)."""


async def read_set_binding(
    action: SetBinding,
    *,
    keys: KeyStore | None,
    always: AlwaysRules,
    max_rules: int,
    limits: VaultLimits,
) -> tuple[SetBindingRequest, BindingInput | None]:
    """A SET_BINDING's input and attachment, decided before anything changes (§3 step 1): a
    400 never changes anything. Raises :class:`BadRequest`.

    A due key-directory rescan runs in a thread, not on the loop that serves DNS (the lookup
    inside then finds it done; §11, at most one scan a second). A sealed vault (decryption,
    up to 1 MiB of validation) is parsed in the vault worker (14.7); a bare policy stays on
    the loop, so a busy vault worker never delays it.
    """
    parsed: BindingInput | None = None
    if action.input is not None:
        if keys is not None:
            await keys.refresh_async()
        parse = functools.partial(
            parse_binding_input,
            action.input,
            uid=action.uid,
            keys=keys,
            always=always,
            max_rules=max_rules,
            limits=limits,
        )
        try:
            parsed = await off_loop(parse) if WRAPPER_MARKER in action.input else parse()
        except InputError as exc:
            raise BadRequest(f"invalid binding input: {exc}") from None
    binding = None
    if (att := action.attachment) is not None:
        problem = _dispatch_key_problem(att.ip, att.gateway)
        if problem is not None:
            raise BadRequest(f"invalid action envelope: {problem}")
        binding = Binding(att.ip, att.gateway, att.private_cidr, att.host_veth or None)
    policy = parsed.policy if parsed is not None else None
    return SetBindingRequest(action.uid, action.fence, action.spec_generation, binding, policy), parsed


def _dispatch_key_problem(ip: IPAddress, gateway: IPAddress | None) -> str | None:
    """A source IP that cannot identify one sandbox would dispatch someone else's traffic."""
    if ip.is_unspecified or ip.is_loopback or ip.is_multicast or ip.is_link_local:
        return f"attachment.network.ip {ip} cannot identify a sandbox"
    if gateway is not None and gateway == ip:
        return "attachment.network.gateway equals the sandbox ip"
    return None


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
