"""Runs egressd's own main() (from whatever ``egressd`` the interpreter imports: the tree's
editable install) with a call recorder that is off until SIGUSR1 and off again at SIGUSR2.

While on, every Python function call (profile "call" event, any thread: the asyncio loop and
the executor threads) whose frame's module is egressd or egressd.* is recorded as
(module, qualname, first line). SIGUSR1 clears the record, installs the profiler in all
threads (threading.setprofile_all_threads, 3.12+) and writes "on" to $WALK_DIR/state.
SIGUSR2 removes it, writes the record to $WALK_DIR/window-<n>.json and "off <n>" to the state.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

WALK_DIR = os.environ["WALK_DIR"]
_seen: dict[tuple[str, str, int], list] = {}
_n = 0
_t0 = 0.0


def _prof(frame, event, arg):
    if event != "call":
        return
    mod = frame.f_globals.get("__name__", "")
    if mod == "egressd" or mod.startswith("egressd."):
        c = frame.f_code
        q = c.co_qualname
        if c.co_filename.startswith("<"):  # generated (dataclass __init__/__eq__...): name it by its class
            try:
                owner = frame.f_locals[c.co_varnames[0]] if c.co_argcount else None
                cls = owner if isinstance(owner, type) else type(owner)
                q = f"<generated>{cls.__qualname__}.{c.co_name}"
            except Exception:
                q = f"<generated>{q}"
        k = (mod, q, c.co_firstlineno)
        e = _seen.get(k)
        if e is None:
            _seen[k] = [1, threading.current_thread().name]
        else:
            e[0] += 1


def _write(name: str, text: str) -> None:
    tmp = os.path.join(WALK_DIR, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(WALK_DIR, name))


def _on(signum, frame):
    global _t0
    _seen.clear()
    _t0 = time.monotonic()
    threading.setprofile_all_threads(_prof)
    _write("state", "on")


def _off(signum, frame):
    global _n
    threading.setprofile_all_threads(None)
    dt = time.monotonic() - _t0
    snap = None
    for _ in range(10):  # an executor thread may still be inside _prof
        try:
            snap = [[m, q, ln, v[0], v[1]] for (m, q, ln), v in list(_seen.items())]
            break
        except RuntimeError:
            time.sleep(0.01)
    _n += 1
    _write(f"window-{_n}.json", json.dumps({"seconds": dt, "calls": snap}))
    _write("state", f"off {_n}")


signal.signal(signal.SIGUSR1, _on)
signal.signal(signal.SIGUSR2, _off)
with open(os.path.join(WALK_DIR, "pid"), "w") as f:
    f.write(str(os.getpid()))

import egressd  # noqa: E402

print(f"walk: egressd from {egressd.__file__}", file=sys.stderr, flush=True)
from egressd.main import main  # noqa: E402

sys.exit(main())
