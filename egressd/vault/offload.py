"""Vault validation off the event loop (BEHAVIOUR 14.7).

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final

__all__ = ["off_loop"]

_WORKER: Final = ThreadPoolExecutor(max_workers=1, thread_name_prefix="egressd-vault")


async def off_loop[**P, T](fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` in the vault worker thread. If the awaiting task is cancelled
    the call still finishes in the thread and its result is dropped: it only ever touched
    private copies, so nothing is half-applied."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_WORKER, functools.partial(fn, *args, **kwargs))
