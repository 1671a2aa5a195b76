"""Vault validation off the event loop (docs/reference/behaviour.md §14.7).

Parsing and validating a vault body (JSON decode, §6 checks, ambiguity, coverage, a sealed
vault's AEAD open) is pure CPU work of up to a 1 MiB body. On the event loop it would stall
DNS answers, actions and the MITM's ``_active`` lookups of every other subject, so it runs
here, in **one** dedicated worker thread:

* one thread, not the default pool: the loop thread then competes with at most one
  validating thread for the GIL (the interpreter hands the GIL over every switch interval,
  5 ms), however many tenants upload at once; further bodies queue behind it;
* the worker only ever sees immutable inputs and a private :meth:`VaultStore.fork`, and
  returns a result; the store the daemon serves from is changed on the loop, by the caller,
  under the subject's lock (see :func:`vault_write`).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final

__all__ = ["off_loop"]

_WORKER: Final = ThreadPoolExecutor(max_workers=1, thread_name_prefix="egressd-vault")
#: GIL hand-over interval while the worker runs (the interpreter's default is 5 ms).
SWITCH_INTERVAL_S: Final = 0.001


def _run[T](call: Callable[[], T]) -> T:
    """One call in the worker, with two process-wide settings changed for its duration only
    (the worker is the only thread that changes them, and runs one call at a time):

    * the GIL is handed over every 1 ms instead of 5: every wake-up of the event loop (a
      DNS datagram, a MITM lookup) waits for the GIL at most that long while we hold it;
    * automatic garbage collection is paused: a 1 MiB body is up to a million short-lived
      objects, and a collection started by one of our allocations walks them all while
      holding the GIL (measured: 20-90 ms stalls of the loop). They die by reference count
      when the call returns; collection resumes afterwards.
    """
    interval = sys.getswitchinterval()
    collecting = gc.isenabled()
    sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
    gc.disable()
    try:
        return call()
    finally:
        if collecting:
            gc.enable()
        sys.setswitchinterval(interval)


async def off_loop[**P, T](fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` in the vault worker thread. If the awaiting task is cancelled
    the call still finishes in the thread and its result is dropped: it only ever touched
    private copies, so nothing is half-applied."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_WORKER, _run, functools.partial(fn, *args, **kwargs))
