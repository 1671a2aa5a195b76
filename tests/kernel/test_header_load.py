"""Every shape of the fleet header loads into the real nft 1.0.6 / kernel.

The unit tests pin the header's text; only the kernel says whether nft parses it. Each case
loads the script into a scratch namespace of its own (nothing else in it), then removes it.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from collections.abc import Iterator

import pytest

from egressd.fleetnft.header import header_script
from egressd.fleetnft.table import TableConfig
from egressd.subject.hostuid import UidPorts, UidRange

BLOCKLIST = (ipaddress.ip_network("1.1.1.1/32"), ipaddress.ip_network("2606:4700::/32"))
CASES = {
    "plain": TableConfig(table="T"),
    "mitm": TableConfig(table="T", mitm=True),
    "doh-all": TableConfig(table="T", block_doh_443=True),
    "doh-list": TableConfig(table="T", block_doh_443=True, doh_blocklist=BLOCKLIST),
    # Failed to parse before ("ct original proto-dst 443" without a protocol context).
    "mitm-doh-all": TableConfig(table="T", mitm=True, block_doh_443=True),
    "mitm-doh-list": TableConfig(table="T", mitm=True, block_doh_443=True, doh_blocklist=BLOCKLIST),
    # Host-uid subjects (docs/reference/behaviour.md §17): egressd's own uid inside the range, a one-uid range
    # and a one-subject port block (single ports instead of ranges).
    "uid-own-inside": TableConfig(table="T", mitm=True, own_uid=100500),
    "uid-single": TableConfig(table="T", mitm=True, uids=UidPorts(UidRange(7, 7), 30000, 1)),
    "uid-doh-v6-only": TableConfig(
        table="T", mitm=True, block_doh_443=True, doh_blocklist=(ipaddress.ip_network("2606:4700::/32"),)
    ),
}


@pytest.fixture(scope="module")
def scratch() -> Iterator[str]:
    ns = f"eghl{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_header_loads(scratch: str, name: str) -> None:
    script = header_script(CASES[name], delete_existing=False)
    r = subprocess.run(
        ["ip", "netns", "exec", scratch, "nft", "-f", "-"], input=script, capture_output=True, text=True
    )
    subprocess.run(["ip", "netns", "exec", scratch, "nft", "delete", "table", "inet", "T"], check=False)
    assert r.returncode == 0, r.stderr
