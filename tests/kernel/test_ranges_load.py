"""The hash path for leases' port ranges (docs/concepts/ruleset.md, "port-scoped sets"): an
``inet_proto . inet_service`` interval set, its elements, and the rule ``ip daddr @dynr meta
l4proto . th dport @dynrports`` load into the real kernel through egressd's own netlink encoder
exactly as nft 1.0.6 loads the same text (listing and expression dump equal); the intercepted
path's shape (which nft cannot parse) loads and lists. A scratch namespace of its own.
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
    import re, subprocess
    from egressd.kernel.netlink import NfTablesSocket
    from egressd.kernel.ops import AddRule, AddServices, AddSet, AddTimed, NetlinkBatch, RangeRule, RuleAction
    import ipaddress

    def sh(*a, inp=None, check=True):
        return subprocess.run(a, input=inp, capture_output=True, text=True, check=check)

    for t in ("A", "B"):
        sh("nft", "delete", "table", "inet", t, check=False)
        sh("nft", "-f", "-", inp=f'''
    add table inet {t}
    add chain inet {t} c
    add chain inet {t} denied
    ''')
    ops = (
        AddSet("r4", "v4", "timeout", 360, size=4096),
        AddSet("r6", "v6", "timeout", 360, size=4096),
        AddSet("s4", "v4", "interval", services=True),
        AddSet("s6", "v6", "interval", services=True),
        AddRule("c", RangeRule("v4", "r4", "s4", RuleAction.MARK)),
        AddRule("c", RangeRule("v6", "r6", "s6", RuleAction.ACCEPT)),
        AddServices("s4", (("tcp", 8000, 8999), ("udp", 9000, 9100))),
        AddServices("s6", (("tcp", 8000, 8999),)),
        AddTimed("r4", "v4", ((ipaddress.ip_address("1.2.3.4"), 90),)),
    )
    sh("nft", "-f", "-", inp=NetlinkBatch("A", ops).describe())
    NfTablesSocket().run(NetlinkBatch("B", ops))
    ct = RangeRule("v4", "r4", "s4", RuleAction.ACCEPT, ct_original=True)
    NfTablesSocket().run(NetlinkBatch("B", (AddRule("c", ct),)))

    def norm(out, t):
        out = re.sub(r"expires \\S+", "", out).replace(f"inet {t}", "inet T")
        return re.sub(r"# handle \\d+", "", out)

    for what in (("list", "table"), ("--debug=netlink", "list", "table")):
        print(norm(sh("nft", *what[:-1], what[-1], "inet", "A").stdout, "A"))
        print("=====")
        print(norm(sh("nft", *what[:-1], what[-1], "inet", "B").stdout, "B"))
        print("=====")
    """
)


@pytest.fixture(scope="module")
def scratch() -> Iterator[str]:
    ns = f"egrl{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def _handles(dump: str) -> str:
    return re.sub(r"^(inet T \S+)[\d ]*$", r"\1", dump, flags=re.M)


def test_range_rule_and_services_set_load_as_nft_loads_them(scratch: str) -> None:
    r = subprocess.run(
        ["ip", "netns", "exec", scratch, sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    nft_listing, ours, nft_exprs, our_exprs, _ = r.stdout.split("=====\n", 4)
    ct_rule = "ct original ip daddr @r4 meta l4proto . ct original proto-dst @s4 accept"
    assert ct_rule in ours
    assert ours.replace(f"\t\t{ct_rule}\n", "") == nft_listing
    assert "ip daddr @r4 meta l4proto . th dport @s4 meta mark set 0x00000002" in ours
    assert "ip6 daddr @r6 meta l4proto . th dport @s6 accept" in ours
    assert "tcp . 8000-8999" in ours and "udp . 9000-9100" in ours
    assert "type inet_proto . inet_service" in ours
    ct_block = re.search(r"inet T c [\d ]+\n  \[ ct load dst_ip.*?\n\n", our_exprs, re.S)
    assert ct_block is not None and "[ ct load proto_dst => reg 9 , dir original ]" in ct_block.group(0)
    ours_only = our_exprs.replace(ct_block.group(0), "").replace(f"\t\t{ct_rule}\n", "")
    assert _handles(ours_only) == _handles(nft_exprs)
