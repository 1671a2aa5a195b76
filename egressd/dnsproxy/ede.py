"""Extended DNS Errors (RFC 8914) on the proxy's own decisions, through dnslib's EDNS0 options. Pure.

The EXTRA-TEXT is the decision's evidence string (``decision=<id> subject=s-<uid> rule=<label>``),
the same as in the log line and the metric exemplar, so an operator handed a failing ``dig``
from inside a sandbox can grep the daemon's log for that one id.

INFO-CODEs: a real policy denial is **15 "Blocked"** (RFC 8914 §4.16: blocked by the operator's
policy). An audit would-deny is **0 "Other"**: the answer is real and usable, and 15 on a
NOERROR answer would tell clients (browsers and stub resolvers surface EDE 15 to users) that
the name was blocked when it was not. RFC 8914 §3 allows EDE on any response, NOERROR included.
A query over the per-subject budget (docs/reference/behaviour.md §14.3) is REFUSED with **15** too (operator
policy; RFC 8914 has no rate-limit code). A message the proxy will not carry (another opcode,
a signed message) is REFUSED with **21 "Not Supported"** (RFC 8914 §4.22).
"""

from __future__ import annotations

import struct
from typing import Final

from dnslib import EDNS0, QTYPE, DNSRecord, EDNSOption

from egressd.dnsproxy.decide import EDNS_UDP_SIZE

EDE_OPTION_CODE: Final = 15
INFO_OTHER: Final = 0
INFO_BLOCKED: Final = 15
INFO_NOT_SUPPORTED: Final = 21
_MAX_TEXT: Final = 255  # keeps the option small: a refusal stays far below 512 bytes


def ede_option(info_code: int, text: str) -> EDNSOption:
    """INFO-CODE (16 bits) then EXTRA-TEXT: UTF-8, not NUL-terminated (RFC 8914 §2)."""
    return EDNSOption(EDE_OPTION_CODE, struct.pack("!H", info_code) + text.encode()[:_MAX_TEXT])


def has_opt(record: DNSRecord) -> bool:
    return any(rr.rtype == QTYPE.OPT for rr in record.ar)


def attach_ede(reply: DNSRecord, info_code: int, text: str) -> DNSRecord:
    """Add the option to the reply's OPT record (created when missing) and return ``reply``.

    Call it only when the *client's query* carried an OPT record: a reply to a non-EDNS query
    must not carry one (RFC 6891 §7), so such a client gets the decision in the log and the
    metric only.
    """
    option = ede_option(info_code, text)
    for rr in reply.ar:
        if rr.rtype == QTYPE.OPT:
            rr.rdata = [*(rr.rdata or []), option]
            return reply
    reply.add_ar(EDNS0(udp_len=EDNS_UDP_SIZE, opts=[option]))
    return reply


def read_ede(record: DNSRecord) -> list[tuple[int, str]]:
    """Every (INFO-CODE, EXTRA-TEXT) of a parsed message; for tests and tools."""
    out: list[tuple[int, str]] = []
    for rr in record.ar:
        if rr.rtype != QTYPE.OPT:
            continue
        for opt in rr.rdata or []:
            if isinstance(opt, EDNSOption) and opt.code == EDE_OPTION_CODE and len(opt.data) >= 2:
                (code,) = struct.unpack("!H", opt.data[:2])
                out.append((code, opt.data[2:].decode("utf-8", "replace")))
    return out
