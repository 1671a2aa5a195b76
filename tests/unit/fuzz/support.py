"""Shared pieces of the fuzz suite: budgets, case counters, state snapshots.

Budgets: ``EGRESSD_FUZZ_PROFILE`` selects ``ci`` (default: small, derandomised, so the whole
fuzz set stays well under a minute on a shared runner and never flakes) or ``campaign`` (large,
random: the long run recorded in docs/security.md). Each target names its own example
counts; :func:`fuzz` turns them into a ``hypothesis.settings`` decorator without loading a
global profile (the compat tests' schemathesis also uses hypothesis and must keep its own).

Every example calls :func:`hit` once, so the session summary (conftest.py) reports exactly how
many cases each target ran, whatever hypothesis decided to stop at.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from collections.abc import Coroutine, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

from hypothesis import HealthCheck, settings
from structlog.testing import capture_logs

PROFILE = os.environ.get("EGRESSD_FUZZ_PROFILE", "ci").strip().lower() or "ci"
if PROFILE not in ("ci", "campaign"):
    raise RuntimeError(f"EGRESSD_FUZZ_PROFILE must be 'ci' or 'campaign', got {PROFILE!r}")

SCALE = float(os.environ.get("EGRESSD_FUZZ_SCALE", "1") or "1")

#: Cases run per target in this process (reported by conftest.py's terminal summary).
COUNTS: Counter[str] = Counter()


def fuzz(target: str, *, ci: int, campaign: int) -> settings:
    """The settings of one fuzz target under the selected profile."""
    del target  # named at the call site for the reader; counting is done by hit()
    if PROFILE == "campaign":
        # Random (a different seed every run), no example database (nothing written into
        # the worktree), shrinking kept so a finding arrives minimal. EGRESSD_FUZZ_SCALE
        # multiplies the campaign counts (a longer campaign without editing each target).
        return settings(
            max_examples=max(1, int(campaign * SCALE)),
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            print_blob=True,
        )
    return settings(
        max_examples=ci,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


def hit(target: str) -> None:
    COUNTS[target] += 1


# --------------------------------------------------------------------------- event loop

_LOOP: asyncio.AbstractEventLoop | None = None


def run[T](coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on one long-lived loop: a fresh loop per example would cost more than the
    example itself. hypothesis calls the test body synchronously, so no loop is running here."""
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    return _LOOP.run_until_complete(coro)


# --------------------------------------------------------------------------- canaries


def canary(n: int) -> str:
    """A credential value no fuzzed field can produce by accident (uppercase marker + hex id)."""
    return f"zzCANARY{n:08x}SECRETzz"


CANARY_MARK = "CANARY"


@contextmanager
def captured_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    with capture_logs() as logs:
        yield logs


def assert_not_in_logs(logs: list[MutableMapping[str, Any]], *secrets: str) -> None:
    for event in logs:
        # Case-insensitive: a normaliser (host names, policy targets) may have lower-cased it.
        rendered = (repr(event) + json.dumps(event, default=repr)).lower()
        for secret in secrets:
            assert secret.lower() not in rendered, f"secret in log event {event.get('event')!r}"


def assert_no_crash_logged(logs: list[MutableMapping[str, Any]]) -> None:
    """A handler that had to catch an unexpected exception logs it with exc_info: a finding."""
    for event in logs:
        assert not event.get("exc_info"), f"unexpected exception logged: {event.get('event')!r}"


def only_in_value_fields(body: bytes, secret: str) -> bool:
    """True when ``secret`` occurs in ``body`` only as the value of a ``"value"`` key (where the
    generator planted it) or the body is not JSON at all. A byte mutation can move the canary
    into a name or host field, whose echo in a 400 reason is legitimate; the secrecy oracle is
    then skipped for that case."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return True

    def ok(node: object, key: str | None) -> bool:
        if isinstance(node, dict):
            return all(secret not in k and ok(v, k) for k, v in node.items())
        if isinstance(node, list):
            return all(ok(v, None) for v in node)
        if isinstance(node, str):
            return secret not in node or key == "value"
        return True

    try:
        return ok(doc, None)
    except RecursionError:
        return False
