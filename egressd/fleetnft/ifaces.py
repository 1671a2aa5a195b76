"""Sandbox-facing interface names (docs/reference/behaviour.md §20.2): which names egressd may put into the
table as "packets arriving here are a sandbox's". Pure.

Two sources: the attachments' ``hostVeth`` (exact names, in the set ``sandbox_ifaces``) and
``EGRESSD_SANDBOX_IFACES`` (names or ``prefix*``, rules of the header). Loopback is never one:
the pod talks to itself (and the Fastlet to egressd's API) over ``lo``, and treating it as a
sandbox's interface would cut egressd off from its own callers.
"""

from __future__ import annotations

from typing import Final

IFNAMSIZ: Final = 16  # the kernel's interface name buffer: 15 bytes and a NUL
LOOPBACK: Final = "lo"
# What an nft script may quote without escapes, and every name a runtime gives a veth or bridge.
_NAME_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-@+")


def iface_problem(name: str, *, prefix_ok: bool = False) -> str | None:
    """Why ``name`` cannot name a sandbox-facing interface (None when it can). With
    ``prefix_ok`` a trailing ``*`` makes it a prefix, which must be non-empty."""
    stem = name[:-1] if prefix_ok and name.endswith("*") else name
    if not stem:
        return "is empty" if not prefix_ok else "an empty prefix would match every interface"
    if len(stem.encode()) >= IFNAMSIZ:
        return f"is longer than {IFNAMSIZ - 1} bytes"
    if stem in (".", "..") or not set(stem) <= _NAME_CHARS:
        return "is not an interface name (letters, digits and _ . - @ + only)"
    matches_lo = LOOPBACK.startswith(stem) if stem != name else stem == LOOPBACK
    if matches_lo:
        return "would match the loopback interface"
    return None


def usable_host_veth(name: str | None) -> str | None:
    """An attachment's ``hostVeth`` as the set ``sandbox_ifaces`` may hold it, or None for a
    name that can be no interface a packet arrives on (absent, too long, loopback): the
    sandbox is then recognised by its addresses only, as before §20.2."""
    if not name or iface_problem(name) is not None:
        return None
    return name
