"""Reading and cutting tracked flows (conntrack-tools and /proc/net/nf_conntrack, off the hot path).

Revoking access does not end flows the kernel already accepted (``ct state established``
is accepted first), so a revert, rebind or removal deletes the source's conntrack entries,
and a narrowing deletes (fleet) or marks (sidecar) the flows it no longer allows. The line
parsers here read the table's text for both profiles.
"""

from __future__ import annotations

import asyncio
import ipaddress
import shutil
from collections.abc import Collection, Iterable
from pathlib import Path

from egressd.addr import IPAddress, unmap_ip

_TIMEOUT_S = 3.0


class ConntrackError(RuntimeError):
    pass


CONNTRACK_TABLE = Path("/proc/net/nf_conntrack")


def original_tuple(line: str) -> tuple[IPAddress, IPAddress] | None:
    """(source, destination) of a /proc/net/nf_conntrack line's original direction: the first
    ``src=`` and ``dst=`` fields (/proc prints IPv6 addresses in full, so they are parsed)."""
    src = dst = None
    for field in line.split():
        if src is None and field.startswith("src="):
            src = field[4:]
        elif dst is None and field.startswith("dst="):
            dst = field[4:]
        if src is not None and dst is not None:
            try:
                return unmap_ip(ipaddress.ip_address(src)), unmap_ip(ipaddress.ip_address(dst))
            except ValueError:
                return None
    return None


def reply_source(line: str) -> IPAddress | None:
    """The source of a /proc/net/nf_conntrack line's reply direction (the second ``src=``):
    where the answers come from, which a redirect (DNAT to this host) makes a local address."""
    seen = 0
    for field in line.split():
        if field.startswith("src="):
            seen += 1
            if seen == 2:
                try:
                    return unmap_ip(ipaddress.ip_address(field[4:]))
                except ValueError:
                    return None
    return None


#: A tracked flow's original direction past its source: (destination, protocol, destination
#: port). The protocol is conntrack's name (``tcp``, ``udp``, ``icmp``, ...); the port is None
#: for a protocol without ports.
Dest = tuple[IPAddress, str, int | None]


def original_flow(line: str) -> tuple[IPAddress, Dest] | None:
    """(source, (destination, protocol, destination port)) of a /proc/net/nf_conntrack line's
    original direction (docs/reference/behaviour.md §18: a narrowing judges flows by port and
    protocol too). The protocol is the third field; the port the first ``dport=``."""
    t = original_tuple(line)
    if t is None:
        return None
    fields = line.split()
    proto = fields[2] if len(fields) > 2 else ""
    dport: int | None = None
    for field in fields:
        if field.startswith("dport="):
            try:
                dport = int(field[6:])
            except ValueError:
                return None
            break
    return t[0], (t[1], proto, dport)


def carries_mark(line: str, bits: int) -> bool:
    """Does this tracked flow's conntrack mark carry any of ``bits`` (e.g. the sidecar's cut)?"""
    for field in line.split():
        if field.startswith("mark="):
            try:
                return bool(int(field[5:], 0) & bits)
            except ValueError:
                return False
    return False


def zoned(line: str) -> bool:
    """Is this tracked flow in a conntrack zone other than the default (``zone-orig=1``: the DNS
    forwarder's, nftsyntax.forwarder_zone)? It is egressd's own traffic, which the tables pass
    whatever the policy, and conntrack-tools cannot update an entry outside zone 0 by its tuple
    alone: a cut would only fail on it."""
    return any(
        field.startswith(("zone=", "zone-orig=", "zone-reply=")) and field.partition("=")[2] not in ("", "0")
        for field in line.split()
    )


def flow_dests_from(lines: Iterable[str], sources: Collection[IPAddress]) -> dict[IPAddress, set[Dest]]:
    """Original (destination, protocol, port) of the tracked flows per original source, for
    ``sources`` only."""
    out: dict[IPAddress, set[Dest]] = {}
    for line in lines:
        t = original_flow(line)
        if t is not None and t[0] in sources:
            out.setdefault(t[0], set()).add(t[1])
    return out


def _scan_dests(table: Path, sources: frozenset[IPAddress]) -> dict[IPAddress, set[Dest]]:
    with table.open() as f:
        return flow_dests_from(f, sources)


async def read_flow_dests(
    sources: Collection[IPAddress], table: Path = CONNTRACK_TABLE
) -> dict[IPAddress, set[Dest]] | None:
    """:func:`read_flows` with each flow's protocol and destination port (None if unreadable)."""
    try:
        return await asyncio.to_thread(_scan_dests, table, frozenset(sources))
    except OSError:
        return None


def has_flows_from(text: str, ip: IPAddress) -> bool:
    """Whether any tracked flow's original source is ``ip``."""
    return any(t is not None and t[0] == ip for t in map(original_tuple, text.splitlines()))


def flows_from(lines: Iterable[str], sources: Collection[IPAddress]) -> dict[IPAddress, set[IPAddress]]:
    """Original destinations of the tracked flows per original source, for ``sources`` only."""
    out: dict[IPAddress, set[IPAddress]] = {}
    for line in lines:
        t = original_tuple(line)
        if t is not None and t[0] in sources:
            out.setdefault(t[0], set()).add(t[1])
    return out


def _scan_flows(table: Path, sources: frozenset[IPAddress]) -> dict[IPAddress, set[IPAddress]]:
    with table.open() as f:
        return flows_from(f, sources)


async def read_flows(
    sources: Collection[IPAddress], table: Path = CONNTRACK_TABLE
) -> dict[IPAddress, set[IPAddress]] | None:
    """``flows_from`` over the live table, streamed line by line on a worker thread (None if
    unreadable). Every in-place policy change calls this; reading the whole table into one
    string instead (hundreds of KiB at a few thousand flows, at 100 changes/s) spread large
    short-lived blocks over the default executor's malloc arenas, whose RSS then crept by
    ~1 MiB/min in the soak (docs/security.md, "Soak") while the Python heap stayed flat."""
    try:
        return await asyncio.to_thread(_scan_flows, table, frozenset(sources))
    except OSError:
        return None


async def read_table(table: Path = CONNTRACK_TABLE) -> str | None:
    try:
        return await asyncio.to_thread(table.read_text)
    except OSError:
        return None


async def flush_flow(src: IPAddress, dst: IPAddress, proto: str = "", dport: int | None = None) -> None:
    """Cut the tracked flows from ``src`` to ``dst`` (an in-place narrowing), only those of
    ``proto`` to ``dport`` when given (a narrowing that takes one port away keeps the others)."""
    await conntrack_delete(["-s", str(src), "-d", str(dst), *flow_selector(proto, dport)], src.version)


def flow_selector(proto: str, dport: int | None) -> list[str]:
    """conntrack-tools' selector for one protocol and destination port (none when unknown)."""
    if proto in ("tcp", "udp", "sctp", "dccp", "udplite") and dport is not None:
        return ["-p", proto, "--dport", str(dport)]
    if proto:
        return ["-p", proto]
    return []


async def flush_source(ip: IPAddress, table: Path = CONNTRACK_TABLE) -> None:
    # Spawning conntrack costs ~11 ms; most removals have nothing to cut, so look first.
    text = await read_table(table)
    if text is not None and not has_flows_from(text, ip):
        return
    await conntrack_delete(["-s", str(ip)], ip.version)


async def conntrack_delete(selector: list[str], version: int) -> None:
    await _conntrack("-D", selector, version)


async def conntrack_mark(selector: list[str], version: int, bit: int) -> None:
    """Set ``bit`` in the conntrack mark of the entries ``selector`` matches (other bits kept).
    An entry that already carries it is not updated, which conntrack-tools reports as exit 1."""
    await _conntrack("-U", [*selector, "--mark", f"{bit:#x}/{bit:#x}"], version)


async def _conntrack(op: str, args: list[str], version: int) -> None:
    exe = shutil.which("conntrack")
    if exe is None:
        raise ConntrackError("conntrack binary not found")
    family = "ipv4" if version == 4 else "ipv6"
    proc = await asyncio.create_subprocess_exec(
        exe,
        op,
        "-f",
        family,
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), _TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise ConntrackError(f"conntrack {op} timed out") from None
    text = err.decode(errors="replace")
    if proc.returncode is None or not conntrack_succeeded(proc.returncode, text):
        raise ConntrackError(f"conntrack {op} exited {proc.returncode}: {text.strip()[:200]}")


def conntrack_succeeded(returncode: int, stderr: str) -> bool:
    """conntrack-tools exits 1 both when nothing matched (or, with ``-U``, nothing changed:
    "0 flow entries have been updated") and when the kernel refused (EPERM: "Operation
    failed"); it also goes on past an entry it failed to update and exits 0 if another one
    worked. So any "Operation failed" is a failure, and exit 1 is success only with the
    summary line."""
    if "Operation failed" in stderr:
        return False
    return returncode == 0 or (returncode == 1 and "flow entries have been" in stderr)
