"""Flow lookup before cutting (conntrack -D is only spawned when the source has flows)."""

from __future__ import annotations

import asyncio
from ipaddress import ip_address
from pathlib import Path

import pytest

from egressd.kernel import conntrack

V4 = (
    "ipv4     2 tcp      6 431999 ESTABLISHED src=10.203.0.11 dst=10.204.0.2 sport=40000 dport=80 "
    "src=10.204.0.2 dst=10.203.0.11 sport=80 dport=40000 [ASSURED] mark=0 zone=0 use=2\n"
)
V6 = (
    "ipv6     10 tcp      6 117 TIME_WAIT src=fd00:0203:0000:0000:0000:0000:0000:0011 "
    "dst=fd00:0204:0000:0000:0000:0000:0000:0002 sport=1 dport=80 src=fd00:0204:0000:0000:0000:0000:0000:0002 "
    "dst=fd00:0203:0000:0000:0000:0000:0000:0011 sport=80 dport=1 [ASSURED] mark=0 zone=0 use=2\n"
)


def test_original_source_only() -> None:
    assert conntrack.has_flows_from(V4, ip_address("10.203.0.11"))
    # The reply tuple's source is the upstream: not a flow "from" it.
    assert not conntrack.has_flows_from(V4, ip_address("10.204.0.2"))
    assert not conntrack.has_flows_from(V4, ip_address("10.203.0.1"))  # prefix of .11, not equal


def test_ipv6_full_form() -> None:
    assert conntrack.has_flows_from(V6, ip_address("fd00:203::11"))
    assert not conntrack.has_flows_from(V6, ip_address("fd00:203::12"))


def test_no_flows_means_no_exec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "nf_conntrack"
    table.write_text(V4)
    monkeypatch.setattr(
        "egressd.kernel.conntrack.shutil.which", lambda _: pytest.fail("must not spawn conntrack")
    )
    asyncio.run(conntrack.flush_source(ip_address("10.203.0.99"), table))


def test_flows_from_keeps_only_the_given_sources(tmp_path: Path) -> None:
    table = tmp_path / "nf_conntrack"
    table.write_text(V4 + "\n" + V6 + "\n")
    want = {ip_address("10.203.0.11"), ip_address("fd00:203::11")}
    got = asyncio.run(conntrack.read_flows(want, table))
    assert got == {
        ip_address("10.203.0.11"): {ip_address("10.204.0.2")},
        ip_address("fd00:203::11"): {ip_address("fd00:204::2")},
    }
    assert conntrack.flows_from(V4.splitlines(), {ip_address("10.203.0.1")}) == {}
    assert asyncio.run(conntrack.read_flows(want, tmp_path / "missing")) is None


@pytest.mark.parametrize(
    ("code", "stderr", "ok"),
    [
        (0, "conntrack v1.4.7 (conntrack-tools): 2 flow entries have been deleted.\n", True),
        (1, "conntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.\n", True),
        (1, "conntrack v1.4.7 (conntrack-tools): 0 flow entries have been updated.\n", True),
        # The kernel refused: the same exit code, and a cut that did nothing must say so.
        (
            1,
            "conntrack v1.4.7 (conntrack-tools): Operation failed: sorry, you must be root or get "
            "CAP_NET_ADMIN capability to do this\n",
            False,
        ),
        (
            1,
            "conntrack v1.4.7 (conntrack-tools): Operation failed: invalid parameters\n"
            "conntrack v1.4.7 (conntrack-tools): 0 flow entries have been updated.\n",
            False,
        ),
        (1, "", False),
        # One entry refused, another updated: exit 0, and still a failure to report.
        (
            0,
            "conntrack v1.4.7 (conntrack-tools): Operation failed: No such file or directory\n"
            "conntrack v1.4.7 (conntrack-tools): 1 flow entries have been updated.\n",
            False,
        ),
        (2, "conntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.\n", False),
    ],
)
def test_exit_1_is_success_only_with_the_summary_and_no_failure(code: int, stderr: str, ok: bool) -> None:
    assert conntrack.conntrack_succeeded(code, stderr) is ok
