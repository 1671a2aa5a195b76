"""The lease book and the real kernel's port-scoped dyn sets agree (docs/reference/behaviour.md §18,
§14.4; tests/unit/subject/test_lease_grace_and_batches.py and test_lease_model.py hold the
pure side): a subject's dyn sets as the fleet declares them, DNS answers learned through
egressd.engine.learning.learn_many, each kernel step the fleet's own netlink batch
(egressd.fleetnft.contents.dyn_add).

* One group-commit batch, a port-scoped answer (tcp 1500-3000) then a whole one for an address
  that holds tcp 1000-2000: the merged step writes no port element. A later answer that
  changes the lease's port elements (udp/443) must then replace what the kernel holds; it
  once replaced tcp 1000-3000, a range the book had booked but the kernel never got, and the
  kernel refused the transaction (the range partly overlaps tcp 1000-2000).
* An answer for an address whose lease ended (still in the book for its count grace) opens
  only its own name's ports: it once renewed the ended lease's tcp/22 beside tcp/443.

The book's clock is the script's (answers at chosen times); the kernel's timeouts run on its
own, long enough not to end during the script. Runs in a scratch namespace of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

_SCRIPT = textwrap.dedent(
    """
    import asyncio, ipaddress, json, subprocess
    from egressd.engine import learning
    from egressd.fleetnft.contents import dyn_add
    from egressd.fleetnft.subject import subject_objects
    from egressd.fleetnft.table import TableConfig
    from egressd.kernel.netlink import NfTablesSocket
    from egressd.policy import parse_policy
    from egressd.subject.leases import LeaseBook

    T = "egl"
    subprocess.run(["nft", "add", "table", "inet", T], check=True)
    sock = NfTablesSocket()
    sock.run(subject_objects(TableConfig(table=T), "s"))
    X = ipaddress.ip_address("192.0.2.7")
    POLICY = parse_policy(json.dumps({"defaultAction": "deny", "egress": [
        {"action": "allow", "target": "a.test", "protocol": "tcp", "ports": [22]},
        {"action": "allow", "target": "b.test", "protocol": "tcp", "ports": [443]},
        {"action": "allow", "target": "c.test", "protocol": "tcp", "ports": ["1000-2000"]},
        {"action": "allow", "target": "r.test", "protocol": "tcp", "ports": ["1500-3000"]},
        {"action": "allow", "target": "w.test"},
        {"action": "allow", "target": "q.test", "protocol": "udp", "ports": [443]},
    ]}))

    async def add(grants):
        sock.run(dyn_add(T, "s", grants))

    def learn(book, asks, now):
        try:
            asyncio.run(learning.learn_many(book, POLICY, asks, now, add, hash_ranges=False))
            return "ok"
        except Exception as exc:
            return f"refused: {exc}"

    def held():
        out = []
        for kind in ("dyn_v4", "dynp_v4", "dynpx_v4"):
            text = subprocess.run(["nft", "list", "set", "inet", T, f"subj_s_{kind}"],
                                  capture_output=True, text=True, check=True).stdout
            body = text.split("elements = {", 1)[1].split("}", 1)[0] if "elements" in text else ""
            for el in body.split(","):
                if el.strip():
                    out.append(kind + " " + el.split(" timeout")[0].split(" expires")[0].strip())
        return sorted(out)

    def flush():
        for kind in ("dyn_v4", "dynp_v4", "dynpx_v4"):
            subprocess.run(["nft", "flush", "set", "inet", T, f"subj_s_{kind}"], check=True)

    report = {}
    # 1. The batch that ends whole, then a change of port elements.
    book = LeaseBook()
    steps = [learn(book, [([(X, 600)], "c.test")], 0.0)]
    steps.append(learn(book, [([(X, 600)], "r.test"), ([(X, 600)], "w.test")], 1.0))
    report["batch_kernel"] = held()
    steps.append(learn(book, [([(X, 600)], "q.test")], 2.0))
    report["batch_steps"] = steps
    report["batch_after"] = held()
    # 2. An ended lease (book time 61 of a 60 s answer, in its grace) and a new name's answer.
    flush()
    book = LeaseBook()
    steps = [learn(book, [([(X, 60)], "a.test")], 0.0)]
    steps.append(learn(book, [([(X, 60)], "b.test")], 61.0))
    report["grace_steps"] = steps
    report["grace_after"] = held()
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def scratch() -> Iterator[str]:
    ns = f"eglb{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


@pytest.fixture(scope="module")
def report(scratch: str) -> dict[str, list[str]]:
    r = subprocess.run(
        ["ip", "netns", "exec", scratch, sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    doc: dict[str, list[str]] = json.loads(r.stdout.strip().splitlines()[-1])
    return doc


def test_a_batch_ending_whole_leaves_the_book_able_to_replace_what_the_kernel_holds(
    report: dict[str, list[str]],
) -> None:
    # The merged step wrote X whole; the kernel kept tcp 1000-2000 (it expires by itself).
    assert report["batch_kernel"] == ["dyn_v4 192.0.2.7", "dynp_v4 192.0.2.7 . tcp . 1000-2000"]
    # q.test's answer replaces it with udp/443: the kernel takes the step.
    assert report["batch_steps"] == ["ok", "ok", "ok"]
    assert report["batch_after"] == ["dyn_v4 192.0.2.7", "dynpx_v4 192.0.2.7 . udp . 443"]


def test_an_ended_lease_lends_its_ports_to_no_new_answer(report: dict[str, list[str]]) -> None:
    assert report["grace_steps"] == ["ok", "ok"]
    # tcp/22 (the ended lease's, maybe still in the kernel) replaced by b.test's tcp/443 alone.
    assert report["grace_after"] == ["dynpx_v4 192.0.2.7 . tcp . 443"]
