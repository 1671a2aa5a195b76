"""Decoding of ``binding.input``: a bare policy (§5) or the ``osbEgressInput`` wrapper (§11)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from egressd.policy import NetworkPolicy, PolicyError, parse_policy, parse_policy_obj

_WRAPPER_KEYS = {"osbEgressInput", "policy", "vault"}


class InputError(ValueError):
    """The binding input cannot be used; ``str()`` is a one-line reason without input content."""


@dataclass(frozen=True, slots=True)
class BindingInput:
    policy: NetworkPolicy
    wrapped: bool = False
    # Sealed vault handling arrives with the credential vault; until then a wrapper that
    # carries one is refused (BEHAVIOUR §11: with no key directory every kid is unknown).
    has_vault: bool = False


def parse_binding_input(text: str) -> BindingInput:
    """Parse before any mutation (§3 step 1); raises :class:`InputError` (-> 400)."""
    stripped = text.strip()
    obj: object = None
    if stripped.startswith("{"):
        try:
            obj = json.loads(stripped)
        except (ValueError, RecursionError):
            obj = None
    if isinstance(obj, dict) and "osbEgressInput" in obj:
        return _parse_wrapper(obj)
    try:
        return BindingInput(parse_policy(text))
    except PolicyError as exc:
        raise InputError(f"invalid policy: {_redacted(exc)}") from None


# Policy errors quote the offending value at the end of their reason; the binding input is
# never echoed back (nor logged), so that quote is cut off and only the field is named.
_QUOTE_TAIL = re.compile(r"""(\s*\(got ['"].*|,\s*got ['"].*|(?<=invalid CIDR)\s+['"].*)$""", re.DOTALL)


def _redacted(exc: PolicyError) -> str:
    reason = _QUOTE_TAIL.sub("", exc.reason)
    return f"{exc.field}: {reason}" if exc.field else reason


def _parse_wrapper(obj: dict[str, object]) -> BindingInput:
    if obj.get("osbEgressInput") != 1 or isinstance(obj.get("osbEgressInput"), bool):
        raise InputError("osbEgressInput must be 1")
    unknown = sorted(k for k in obj if k not in _WRAPPER_KEYS)
    if unknown:
        raise InputError("unknown wrapper key (allowed: osbEgressInput, policy, vault)")
    if "policy" not in obj:
        raise InputError("wrapper policy is required")
    try:
        policy = parse_policy_obj(obj["policy"])
    except PolicyError as exc:
        raise InputError(f"invalid policy: {_redacted(exc)}") from None
    vault = obj.get("vault")
    if vault is not None:
        raise InputError("vault: unknown kid (no vault keys are configured)")
    return BindingInput(policy, wrapped=True)
