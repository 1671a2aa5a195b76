"""Fixtures for tests against the real kernel in throwaway network namespaces.

Without root or the tools these tests skip, unless EGRESS_REQUIRE_NETNS=1 (set in CI), in
which case a missing privilege or tool fails the run instead of hiding behind a skip.
"""

from __future__ import annotations

import itertools
import os
import shutil
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
