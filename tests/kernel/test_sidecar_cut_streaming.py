"""A narrowing's cut holds while the upstream keeps talking (docs/reference/behaviour.md §14.1),
sidecar profile: real TCP and UDP streams from an upstream to the app in the sandbox
namespace, cut by a policy change that refuses their destination.

The sidecar's table hooks output only: the upstream's packets reach the app unfiltered. When
the cut deleted the flow's conntrack entry, the upstream's next packet started a new entry in
reverse (upstream -> app), so the app's own packets were its reply direction, "established",
and accepted: a streamed download, or a channel out, outlived the narrowing. Now the cut marks
the entry and the egress chain judges marked flows' packets like a new flow's."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest

from tests.kernel.sidecar import Sidecar
from tests.kernel.streaming import STREAM_SERVER, TCP_READER, UDP_TALKER
from tests.kernel.topology import UP_NET, UPSTREAM_IPS, Topology, cleanup_stale

CDN_IP = f"{UP_NET}.6"  # api.example.test
TCP_PORT = 9107
UDP_PORT = 9108
RUN_S = 6.0

ALLOWED = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "api.example.test"}]}
NARROWED = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "example.test"}]}


@pytest.fixture(scope="module")
def stopo() -> Iterator[Topology]:
    cleanup_stale()
    t = Topology(prefix=f"egs{os.getpid()}", sandboxes=1).up_()
    try:
        t.spawn(
            t.up,
            "python3",
            "-c",
            STREAM_SERVER,
            ",".join(UPSTREAM_IPS),
            str(TCP_PORT),
            str(UDP_PORT),
            ready_line="ready",
        )
        yield t
    finally:
        t.down()


@pytest.fixture
def sidecar(stopo: Topology) -> Iterator[Sidecar]:
    sc = Sidecar(stopo, sb=1)
    sc.env["OPENSANDBOX_EGRESS_RULES"] = json.dumps(ALLOWED)
    try:
        sc.start()
        assert sc.dig("api.example.test") == ("NOERROR", [CDN_IP])
        yield sc
    finally:
        sc.cleanup()


def test_a_cut_tcp_stream_stays_cut_while_the_upstream_keeps_sending(
    sidecar: Sidecar, stopo: Topology
) -> None:
    reader = stopo.spawn(
        stopo.sb(1), "python3", "-c", TCP_READER, CDN_IP, str(TCP_PORT), str(RUN_S), ready_line="up"
    )
    time.sleep(1.0)
    sidecar.set_policy(NARROWED)
    verdicts = reader.communicate(timeout=30)[0].split()
    assert "ok" in verdicts[:5], f"the stream never flowed: {verdicts}"
    # The upstream's data in flight may still arrive for a moment; then nothing, to the end
    # ("dead" is a second without data, so three of them are the run's last three seconds).
    assert verdicts[-3:] == ["dead"] * 3, f"the cut TCP stream went on: {verdicts}"


def test_a_cut_udp_flow_carries_nothing_out_while_the_upstream_keeps_sending(
    sidecar: Sidecar, stopo: Topology
) -> None:
    talker = stopo.spawn(
        stopo.sb(1), "python3", "-c", UDP_TALKER, CDN_IP, str(UDP_PORT), str(RUN_S), ready_line="up"
    )
    time.sleep(1.0)
    sidecar.set_policy(NARROWED)
    rounds = [tuple(map(int, line.split())) for line in talker.communicate(timeout=30)[0].splitlines()]
    answered = [n for n, acked in rounds if acked]
    assert answered and answered[0] <= 3, f"the flow never worked: {rounds[:10]}"
    # About 20 rounds a second; the last two seconds are well past the change and its cut.
    late = [n for n, acked in rounds[-40:] if acked]
    assert not late, f"the app's datagrams still reached the upstream after the cut: {late}"
