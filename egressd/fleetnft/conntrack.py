"""Cutting established flows of one source address (conntrack-tools, off the hot path).

Revoking access does not end flows the kernel already accepted (``ct state established``
is accepted first), so a revert, rebind or removal deletes the source's conntrack entries.
"""

from __future__ import annotations

import asyncio
import shutil

from egressd.subject.model import IPAddress

_TIMEOUT_S = 3.0


class ConntrackError(RuntimeError):
    pass


async def flush_source(ip: IPAddress) -> None:
    exe = shutil.which("conntrack")
    if exe is None:
        raise ConntrackError("conntrack binary not found")
    family = "ipv4" if ip.version == 4 else "ipv6"
    proc = await asyncio.create_subprocess_exec(
        exe,
        "-D",
        "-f",
        family,
        "-s",
        str(ip),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), _TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise ConntrackError("conntrack -D timed out") from None
    # Exit 1 with "0 flow entries" just means there was nothing to cut.
    if proc.returncode not in (0, 1):
        raise ConntrackError(
            f"conntrack -D exited {proc.returncode}: {err.decode(errors='replace').strip()[:200]}"
        )
