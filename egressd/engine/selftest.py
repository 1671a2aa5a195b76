"""The start-up self-test both profiles run: one runner over a ruleset backend's probes.

Each backend (the fleet's :mod:`egressd.fleetnft.selftest`, the sidecar's
:mod:`egressd.sidecarnft.selftest`) says what it needs from the kernel as a list of
:class:`Probe`, each a feature tried in a scratch table, and a last probe whose answer
configures it (how this kernel renews a DNS lease). This runner tries them in order in a table
``<prefix>-selftest-<pid>`` that is deleted afterwards; the first failure refuses start-up with
a one-line reason (:class:`SelfTestError`) instead of running silently open or silently dead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class SelfTestError(RuntimeError):
    """A kernel feature the ruleset uses is missing: start-up refuses with this one line."""


@dataclass(frozen=True, slots=True)
class Probe[T]:
    """One kernel feature: ``run`` builds it in the scratch table. An exception of ``missing``
    means this kernel lacks ``feature``; any other goes up as it is (``()``: none is a missing
    feature)."""

    feature: str
    run: Callable[[], T]
    missing: type[Exception] | tuple[type[Exception], ...]


@dataclass(frozen=True, slots=True)
class Probes[R]:
    """What a backend needs from the kernel, in the order to try it: ``features``, then
    ``verdict``, whose answer is the self-test's; ``cleanup`` is the libnftables script that
    deletes the scratch table."""

    features: Sequence[Probe[object]]
    verdict: Probe[R]
    cleanup: str


def no_probes(scratch_table: str) -> Probes[object]:
    """The probes of a backend built without any (unit tests): a self-test over it fails."""
    raise SelfTestError("this ruleset backend was built without self-test probes")


def scratch_table(table_prefix: str) -> str:
    """The self-test's table: one per process, so two daemons starting at once never share it."""
    return f"{table_prefix}-selftest-{os.getpid()}"


def attempt[T](probe: Probe[T]) -> T:
    """``probe.run()``; a missing feature becomes the one-line :class:`SelfTestError`."""
    try:
        return probe.run()
    except SelfTestError:
        raise
    except probe.missing as exc:
        raise SelfTestError(f"kernel feature missing: {probe.feature}: {exc}") from None


def run_selftest[R](
    cmd: Callable[[str], None],
    nft_error: type[Exception],
    table_prefix: str,
    probes: Callable[[str], Probes[R]],
) -> R:
    """Probe the kernel through the paths the daemon uses; raise :class:`SelfTestError`.

    ``cmd`` runs one libnftables script and raises ``nft_error``; ``probes`` gives the backend's
    probes for the scratch table it is passed. First a table is created and deleted (without
    that, nothing else can work: the namespace refuses nftables); then every probe in order;
    then the table is deleted, whatever happened (a failing delete is ignored)."""
    t = scratch_table(table_prefix)
    try:
        cmd(f"add table inet {t}\ndelete table inet {t}")
    except nft_error as exc:
        raise SelfTestError(f"nftables unusable in this namespace (need CAP_NET_ADMIN): {exc}") from None
    plan = probes(t)
    try:
        for probe in plan.features:
            attempt(probe)
        return attempt(plan.verdict)
    finally:
        with contextlib.suppress(nft_error):
            cmd(plan.cleanup)
