"""Process hygiene (docs/reference/behaviour.md §14.9): no core dumps, no same-uid peeking at memory.

egressd holds every sandbox's credential vault in memory and the MITM child holds vault
snapshots plus the CA key. A core dump (crash, ``SIGQUIT``, ``gcore``) would write all of it
to disk, wherever ``core_pattern`` points. So both processes, as their first act:

* set ``RLIMIT_CORE`` to 0 soft *and* hard (a later ``setrlimit`` cannot raise it again, and
  children inherit it);
* clear the dumpable flag (``PR_SET_DUMPABLE 0``): the kernel then writes no core even when
  ``core_pattern`` is a pipe (which ignores ``RLIMIT_CORE``), ``/proc/<pid>/{mem,environ,maps}``
  and ``ptrace`` need ``CAP_SYS_PTRACE`` even for a process with the same uid and gid, and
  ``/proc/<pid>/`` is owned by root.

The flag is per process image: ``execve`` resets it, so the MITM child (which execs a fresh
interpreter) calls this itself; the window between its exec and this call holds no secret
(it has not read the CA or any vault yet). egressd itself never execs.
"""

from __future__ import annotations

import ctypes
import resource
from typing import Final

PR_GET_DUMPABLE: Final = 3
PR_SET_DUMPABLE: Final = 4


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def disable_core_dumps() -> None:
    """No core file, no same-uid ``ptrace``/``/proc`` memory access for this process."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if _libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "prctl(PR_SET_DUMPABLE, 0)")


def dumpable() -> bool:
    """This process's dumpable flag (only a process can ask about itself)."""
    return bool(_libc().prctl(PR_GET_DUMPABLE, 0, 0, 0, 0))
