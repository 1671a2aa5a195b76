"""What egressd and its MITM child say to each other: the one module both sides import.

The child (:mod:`egressd.mitmchild`, its own process: ``python -m egressd.mitmchild.runner``)
and the daemon's supervisor side (:mod:`egressd.mitm`) share only these formats, and the
narrowing sequence map (:mod:`egressd.mitm.seqmap`, a file both map):

* the listening sockets the supervisor binds and hands over (docs/reference/behaviour.md §20.1):
  :data:`LISTEN_FDS_ENV` in the child's environment;
* the child's JSON event lines on stdout that the supervisor reads: :data:`READY_EVENT`,
  :data:`CACHE_EVENT`, :data:`CONNECTION_EVENT`;
* egressd's *forget* lines on the child's stdin (docs/reference/behaviour.md §14.9): :func:`forget_message`
  / :func:`parse_forget`, in batches of :data:`FORGET_BATCH`; an entry is a client address or a
  :func:`port_key`;
* the ``_active`` lookup over the private unix socket (docs/reference/behaviour.md §10): :data:`ACTIVE_PATH`,
  the egressd extension headers, entity tags (:func:`bare_etag`). The body's strict reading
  is the child's (:mod:`egressd.mitmchild.wire`).

Pure: no I/O, no mitmproxy.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from typing import Final

from egressd.addr import unmap_ip
from egressd.feed import port_key

#: The child's environment variable naming the inherited listening descriptors (comma list).
LISTEN_FDS_ENV: Final = "EGRESSD_MITM_LISTEN_FDS"

READY_EVENT = "mitm.ready"  # the addon's JSON line once its listener is bound
CACHE_EVENT = (
    "mitm.cache"  # the child's snapshot cache size, whenever it changed (docs/reference/behaviour.md §14.9)
)
#: The addon's JSON line for every connection decision (the supervisor counts and logs it).
CONNECTION_EVENT: Final = "mitm.connection"

ACTIVE_PATH = "/credential-vault/_active"
#: The name check (docs/reference/behaviour.md §18): may this SNI / Host reach that address?
NAMES_PATH: Final = "/_names"
#: Request rules (docs/reference/behaviour.md §19, :mod:`egressd.mitm.requests`): GET a subject's
#: view for a name, POST a refusal report.
REQUESTS_PATH: Final = "/_requests"
DESTINATION_HEADER = "X-Egressd-Destination"
DESTINATION_TTL_HEADER = "X-Egressd-Destination-Ttl"

CACHE_MAX_ENTRIES: Final = 4096  # a fleet host runs far fewer sandboxes; evicting only costs a 200
FORGET_BATCH: Final = 256  # addresses per forget line (a line stays well under the reader's limit)


def bare_etag(value: str) -> str:
    """An entity tag without ``W/`` and quotes (``W/"a-1"`` -> ``a-1``)."""
    tag = value.strip()
    if tag.startswith("W/"):
        tag = tag[2:]
    return tag[1:-1] if len(tag) >= 2 and tag[0] == tag[-1] == '"' else tag


def _canonical_key(text: str) -> str:
    """A forget line's entry as a cache key; raises ValueError when it is neither an address
    nor a :func:`port_key`."""
    if text.startswith("port:"):
        digits = text[5:]
        if not digits.isascii() or not digits.isdigit() or not 1 <= int(digits) <= 65535:
            raise ValueError(text)
        return port_key(int(digits))
    return str(unmap_ip(ipaddress.ip_address(text)))


def forget_message(ips: Iterable[str] | None) -> bytes:
    """One line for the child's stdin: forget these clients (None: every client). An entry is
    a client address or a :func:`port_key`."""
    doc: dict[str, object] = {"op": "forget"}
    if ips is not None:
        doc["ips"] = list(ips)
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def parse_forget(line: bytes) -> list[str] | None:
    """The canonical addresses a forget line names; None means every client.

    Anything that is not a well-formed forget line also means every client: dropping the whole
    cache only costs revalidating lookups, keeping a snapshot egressd wanted gone does not.
    """
    try:
        doc = json.loads(line)
        if not isinstance(doc, dict) or doc.get("op") != "forget" or "ips" not in doc:
            return None
        raw = doc["ips"]
        if not isinstance(raw, list) or not all(isinstance(ip, str) for ip in raw):
            return None
        return [_canonical_key(ip) for ip in raw]
    except ValueError:  # bad JSON, a bad address or a bad port
        return None
