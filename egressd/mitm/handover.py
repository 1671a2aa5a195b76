"""The supervisor's half of the listener handover (docs/reference/behaviour.md §20.1): the sockets it binds
and marks for the MITM child, passed as inherited descriptors named in
:data:`egressd.mitm.protocol.LISTEN_FDS_ENV`. The child's half, which listens on them, is
:mod:`egressd.mitmchild.handover`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from egressd.mitm.protocol import LISTEN_FDS_ENV


@dataclass(frozen=True, slots=True)
class Listen:
    """The ports a child listens on (its worker port first, then its subject ports) and the
    SO_MARK they carry (None: unmarked, the sidecar)."""

    ports: tuple[int, ...]
    mark: int | None = None


def handover_env(socks: Sequence[socket.socket]) -> dict[str, str]:
    """The child's environment: the parent's, plus the inherited descriptors."""
    return {**os.environ, LISTEN_FDS_ENV: ",".join(str(s.fileno()) for s in socks)}
