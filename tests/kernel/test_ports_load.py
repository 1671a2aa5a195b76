"""The port-scoped objects of docs/reference/behaviour.md §18 (sets keyed ``addr . inet_proto .
inet_service``, their interval and timed elements, the rules that look them up, and the name
check's guards on the dyn sets) load into the real kernel through egressd's own netlink
encoder exactly as nft 1.0.6 loads the same text: the kernel's listing of both tables, and its
expression dump (``nft --debug=netlink``), are equal. Also what this kernel does with them:
an element that partly overlaps another is refused (why leases replace their elements, and
overlapping rules are cut into disjoint elements), and re-adding an element renews its timeout.

Each case runs in a scratch namespace of its own, with only this test's tables in it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

_SCRIPT = textwrap.dedent(
    """
    import ipaddress, re, subprocess, sys
    from egressd.kernel.netlink import NfTablesSocket
    from egressd.kernel.ops import (
        AddCounter, AddPortElems, AddRule, AddSet, AuditRule, DeletePortElems, L4Guard, MatchRule, NetlinkBatch,
        PortRule, RuleAction,
    )

    def sh(*a, inp=None, check=True):
        return subprocess.run(a, input=inp, capture_output=True, text=True, check=check)

    for t in ("A", "B"):
        sh("nft", "delete", "table", "inet", t, check=False)
        sh("nft", "-f", "-", inp=f'''
    add table inet {t}
    add chain inet {t} c
    add chain inet {t} denied
    add set inet {t} d4 {{ type ipv4_addr; flags timeout; timeout 360s; }}
    ''')
    # What nft itself makes of the text egressd's batches describe ...
    net = ipaddress.ip_network
    ops = (
        AddSet("p4", "v4", "timeout", 360, size=8192, ports=True),
        AddSet("p6", "v6", "interval", ports=True),
        AddRule("c", PortRule("v4", "p4", RuleAction.MARK)),
        AddRule("c", PortRule("v6", "p6", RuleAction.DROP, drop_chain="denied")),
        AddRule("c", MatchRule("v4", "d4", RuleAction.MARK, guard=L4Guard.NOT_UDP)),
        AddRule("c", MatchRule("v4", "d4", RuleAction.MARK, guard=L4Guard.UDP_NOT_443)),
        # Audit mode's would-deny by port: logged, counted, marked; a hard deny is left alone.
        AddSet("h4", "v4", "interval"),
        AddCounter("k"),
        AddRule("c", AuditRule("v4", "p4", "h4", "egressd would-deny x ", "k", ports=True)),
        AddPortElems(
            "p4", "v4", ((net("1.2.3.4/32"), "tcp", 443, 443), (net("10.0.0.0/8"), "udp", 1000, 2000)), (90, 30)
        ),
        AddPortElems("p6", "v6", ((net("2001:db8::/32"), "tcp", 5432, 5433), (net("::1/128"), "udp", 0, 65535))),
        # The leases' single ports: hash sets (no interval flag), key-only elements.
        AddSet("x4", "v4", "timeout", 360, size=8192, ports=True, exact=True),
        AddSet("x6", "v6", "timeout", 360, size=8192, ports=True, exact=True),
        AddRule("c", PortRule("v4", "x4", RuleAction.MARK, exact=True)),
        AddRule("c", PortRule("v6", "x6", RuleAction.MARK, exact=True)),
        AddPortElems(
            "x4", "v4", ((net("1.2.3.5/32"), "tcp", 443, 443), (net("1.2.3.5/32"), "udp", 443, 443)), (90, 30),
            exact=True,
        ),
        AddPortElems("x6", "v6", ((net("2001:db8::7/128"), "tcp", 22, 22),), (60,), exact=True),
        DeletePortElems("x4", "v4", ((net("1.2.3.5/32"), "udp", 443, 443),), exact=True),
    )
    text = NetlinkBatch("A", ops).describe()
    sh("nft", "-f", "-", inp=text)
    # ... and what the kernel makes of egressd's own encoding of the same batch.
    NfTablesSocket().run(NetlinkBatch("B", ops))
    # The intercepted path's shape (nft 1.0.6 cannot parse it; the kernel takes it and lists it).
    NfTablesSocket().run(NetlinkBatch("B", (AddRule("c", PortRule("v4", "p4", RuleAction.ACCEPT, ct_original=True)),)))

    def norm(out, t):
        out = re.sub(r"expires \\S+", "", out).replace(f"inet {t}", "inet T")
        return re.sub(r"# handle \\d+", "", out)

    for what in (("list", "table"), ("--debug=netlink", "list", "table")):
        print(norm(sh("nft", *what[:-1], what[-1], "inet", "A").stdout, "A"))
        print("=====")
        print(norm(sh("nft", *what[:-1], what[-1], "inet", "B").stdout, "B"))
        print("=====")

    # The kernel's own rules for these sets.
    s = NfTablesSocket()
    def refused(op):
        try:
            s.run(NetlinkBatch("B", (op,)))
        except Exception:
            return True
        return False
    overlap = AddPortElems("p4", "v4", ((net("1.2.3.4/32"), "tcp", 443, 444),), (60,))
    same = AddPortElems("p4", "v4", ((net("1.2.3.4/32"), "tcp", 443, 443),), (200,))
    # Replacing in one transaction: add (so it exists), delete, add the wider one.
    old = ((net("1.2.3.4/32"), "tcp", 443, 443),)
    swap = NetlinkBatch("B", (
        AddPortElems("p4", "v4", old, (60,)), DeletePortElems("p4", "v4", old),
        AddPortElems("p4", "v4", ((net("1.2.3.4/32"), "tcp", 80, 443),), (60,)),
    ))
    print(refused(overlap), refused(same))
    print(norm(sh("nft", "list", "set", "inet", "B", "p4").stdout, "B"))
    s.run(swap)
    print("=====")
    print(norm(sh("nft", "list", "set", "inet", "B", "p4").stdout, "B"))
    """
)


@pytest.fixture(scope="module")
def scratch() -> Iterator[str]:
    ns = f"egpl{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def _handles(dump: str) -> str:
    """An expression dump without rule handles (``inet T c 7 6``: the rule's and its predecessor's)."""
    return re.sub(r"^(inet T \S+)[\d ]*$", r"\1", dump, flags=re.M)


def test_port_scoped_objects_load_as_nft_loads_them(scratch: str) -> None:
    r = subprocess.run(
        ["ip", "netns", "exec", scratch, sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    nft_listing, ours, nft_exprs, our_exprs, rest = r.stdout.split("=====\n", 4)
    ct_rule = "ct original ip daddr . meta l4proto . ct original proto-dst @p4 accept"
    assert ct_rule in ours
    # Everything else is exactly what nft made of the text (sets, elements, rules).
    assert ours.replace(f"\t\t{ct_rule}\n", "") == nft_listing
    assert "ip daddr . meta l4proto . th dport @p4 meta mark set 0x00000002" in ours
    assert "10.0.0.0/8 . udp . 1000-2000 timeout 30s" in ours
    assert "2001:db8::/32 . tcp . 5432-5433" in ours
    # The hash sets: no interval flag, their elements (and the delete) as nft made them.
    assert "1.2.3.5 . tcp . 443 timeout 1m30s" in ours and "1.2.3.5 . udp" not in ours
    assert "2001:db8::7 . tcp . 22 timeout 1m" in ours
    assert "ip6 daddr . meta l4proto . th dport @x6 meta mark set 0x00000002" in ours
    assert "ip daddr @d4 udp dport != 443 meta mark set 0x00000002" in ours
    assert (
        'ip daddr . meta l4proto . th dport @p4 ip daddr != @h4 ct state new log prefix "egressd would-deny x " '
        'counter name "k" meta mark set 0x00000002'
    ) in ours
    # Register by register, the kernel holds the same expressions (the ct rule is ours alone).
    ct_block = re.search(r"inet T c [\d ]+\n  \[ ct load dst_ip.*?\n\n", our_exprs, re.S)
    assert ct_block is not None and "[ ct load proto_dst => reg 10 , dir original ]" in ct_block.group(0)
    ours_only = our_exprs.replace(ct_block.group(0), "").replace(f"\t\t{ct_rule}\n", "")
    assert _handles(ours_only) == _handles(nft_exprs)
    verdicts, before, after = rest.split("\n", 1)[0], *rest.split("\n", 1)[1].split("=====\n")
    # A partly overlapping element is refused; the same element again renews its timeout.
    assert verdicts == "True False"
    assert "1.2.3.4 . tcp . 443 timeout 3m20s" in before
    assert "1.2.3.4 . tcp . 80-443 timeout 1m" in after and "1.2.3.4 . tcp . 443 " not in after
