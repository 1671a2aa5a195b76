"""``egressctl watch``: a live table of the fleet's subjects, their refusals and recent denials.

Every ``--interval`` seconds one ``GET /v1/subjects`` (which reads the kernel's drop counters
in one dump); the frame shows each subject's refused packets, how many more since the previous
frame, and its latest denied names. On a terminal each frame replaces the previous one; into a
pipe frames follow each other, separated by a blank line. ``--count N`` stops after N frames
(scripts, tests); otherwise Ctrl-C ends it (exit 0).

The rendering is pure (:func:`frame`); :func:`run_watch` is the loop, with its clock, sleep and
output injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from egressd.cli.client import one_line
from egressd.cli.render import table
from egressd.terminal import visible

CLEAR = "\x1b[H\x1b[2J"
DENIALS_SHOWN = 3
HEADERS = ("SUBJECT", "STATE", "SOURCE-IP", "DROPPED", "NEW", "RECENT-DENIALS")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One ``/v1/subjects`` answer, or why there is none."""

    subjects: Sequence[dict[str, Any]] = ()
    unattributed: int | None = None
    error: str | None = None


@dataclass
class History:
    """Drop counts of the previous frame, for the NEW column."""

    dropped: dict[str, int] = field(default_factory=dict)
    unattributed: int | None = None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    # One field per column, whatever a name holds: no blanks, bounded.
    return one_line(str(value), limit=60).replace(" ", "_")


def _delta(now: int | None, before: int | None) -> str:
    if now is None or before is None:
        return "-"
    return f"+{now - before}" if now >= before else "reset"


def denials_cell(items: Any) -> str:
    """The newest denied names first, at most three (``,+N`` for the rest), one field."""
    if not isinstance(items, list):
        return "-"
    names = [_cell(d.get("name")) for d in items if isinstance(d, dict) and d.get("name")]
    if not names:
        return "-"
    newest = list(reversed(names))[:DENIALS_SHOWN]
    more = len(names) - len(newest)
    return ",".join(newest) + (f",+{more}" if more > 0 else "")


def frame(
    snap: Snapshot, history: History, *, addr: str, now: float, interval: float, index: int, count: int | None
) -> list[str]:
    """The lines of one frame; ``history`` is updated to this frame's counts."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    progress = f"frame {index}/{count}" if count is not None else f"frame {index}"
    lines = [f"egressd {addr}  {stamp}  every {interval:g}s  {progress}"]
    if snap.error is not None:
        lines.append(f"unavailable: {one_line(snap.error)}")
        return lines
    rows = []
    total = 0
    seen: dict[str, int] = {}
    for s in snap.subjects:
        uid = str(s.get("uid", ""))
        dropped = _int(s.get("droppedPackets"))
        if dropped is not None:
            total += dropped
            seen[uid] = dropped
        state = "revoking" if s.get("revoking") else s.get("state")
        rows.append(
            (
                _cell(s.get("subject")),
                _cell(state),
                _cell(s.get("sourceIp")),
                _cell(dropped),
                _delta(dropped, history.dropped.get(uid)),
                denials_cell(s.get("recentDenials")),
            )
        )
    summary = f"subjects {len(snap.subjects)}  dropped {total}"
    if snap.unattributed is not None:
        summary += f"  unattributed {snap.unattributed} ({_delta(snap.unattributed, history.unattributed)})"
    lines.append(summary)
    lines.extend(table(HEADERS, rows))
    history.dropped = seen
    history.unattributed = snap.unattributed
    return lines


def run_watch(
    fetch: Callable[[], Snapshot],
    out: Callable[[str], None],
    *,
    addr: str,
    interval: float,
    count: int | None,
    tty: bool,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.time,
) -> None:
    history = History()
    index = 0
    while count is None or index < count:
        index += 1
        lines = frame(fetch(), history, addr=addr, now=clock(), interval=interval, index=index, count=count)
        text = "\n".join(visible(line) for line in lines)  # docs/reference/behaviour.md §20.3
        if tty:
            out(CLEAR + text)
        else:
            out(text if index == 1 else "\n" + text)
        if count is None or index < count:
            sleep(interval)
