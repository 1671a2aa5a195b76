"""Fixtures for tests against the real kernel in throwaway network namespaces.

Without root or the tools these tests skip, unless EGRESS_REQUIRE_NETNS=1 (set in CI), in
which case a missing privilege or tool fails the run instead of hiding behind a skip.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from tests.kernel.topology import Daemon, Topology, cleanup_stale

REQUIRED_TOOLS = ("ip", "nft", "curl", "conntrack")


def _netns_problem() -> str | None:
    if os.geteuid() != 0:
        return "kernel tests need root"
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        return f"kernel tests need {', '.join(missing)} (run scripts/install.sh)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problem = _netns_problem()
    for item in items:
        if "tests/kernel/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.netns)
            if problem:
                if os.environ.get("EGRESS_REQUIRE_NETNS") == "1":
                    item.add_marker(pytest.mark.xfail(reason=problem, run=False, strict=True))
                    raise pytest.UsageError(f"EGRESS_REQUIRE_NETNS=1 but {problem}")
                item.add_marker(pytest.mark.skip(reason=problem))


def _root_tables() -> set[str] | None:
    """The nftables tables of the machine's own network namespace (None: cannot tell)."""
    if os.geteuid() != 0 or shutil.which("nft") is None:
        return None
    r = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, timeout=30, check=False)
    return set(r.stdout.split("\n")) - {""} if r.returncode == 0 else None


_ROOT_TABLES_BEFORE = _root_tables()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """No test may leave a table in the machine's own namespace: every table belongs in a
    namespace the test created. The run fails when one appeared (a guard, not a cleanup)."""
    after = _root_tables()
    if _ROOT_TABLES_BEFORE is None or after is None:
        return
    new = sorted(after - _ROOT_TABLES_BEFORE)
    if new:
        print(f"\nFAIL: the root network namespace gained nftables tables during the run: {new}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def topo() -> Iterator[Topology]:
    cleanup_stale()
    t = Topology(prefix=f"egt{os.getpid()}", sandboxes=4).up_()
    try:
        yield t
    finally:
        t.down()


_tables = itertools.count(1)
_ports = itertools.count(18100)


@pytest.fixture
def daemon(topo: Topology) -> Iterator[Daemon]:
    d = Daemon(topo, table=f"egt-{next(_tables)}", port=next(_ports)).start()
    try:
        yield d
    finally:
        d.kill(15)
        topo.ns(topo.pod, "nft", "delete", "table", "inet", d.table, check=False)
