"""The narrowing sequence map: how a MITM worker knows, without a round trip, that what it
remembers of a client is still what egressd would answer (docs/reference/behaviour.md §10, "answered from memory").

egressd owns a small file next to its private ``_active`` socket (same 0700 directory, mode
0600, no secret in it: only counters), mapped into memory by egressd (read-write) and by every
MITM worker (read-only). It holds :data:`SLOTS` little-endian 64-bit counters: slot 0 is
*every client*, the others are the clients whose :func:`slot_of` they are. Whenever something
may narrow what ``_active`` answers (a vault deleted or changed, a subject removed, rebound or
closing, a policy or always-rules change, a lease book narrowed, any mutation through the HTTP
API: the events of the change feed, :mod:`egressd.feed`, to which :class:`MitmMemory`
subscribes), egressd writes a fresh value of one process-wide counter into the slot(s)
concerned, in the same synchronous step that changed the state and before the mutation's
caller is answered.

A worker stamps what it learns from a pull with the two slots it read *before* the pull
(:meth:`SeqReader.stamp`) and answers from memory only while both are unchanged. A narrowing
therefore reaches every worker the moment it happens, whatever the worker is doing, without
egressd waiting for anyone: a worker that is stopped, slow or dead cannot hold a mutation up,
and cannot answer from a stale memory either (its next request finds a changed slot and
pulls). Slots are shared by many clients (a hash): a change of one client costs its slot-mates
one pull each, never a stale answer. Values only grow, so a slot never returns to a stamp.

egressd also writes its monotonic clock into the last slot every :data:`BEAT_S`: a worker
whose egressd has fallen silent for more than :data:`MAX_SILENCE_S` (stopped, wedged) stops
answering from memory and pulls, so §10's lookup-failure rule (refuse the client's requests)
holds for it as before.

Widening changes (a new DNS answer, a new vault) need no bump of their own when nothing was
remembered in between; but the memory also holds refusals (a 404: no vault for this client), so
a widening that a worker may have pulled a refusal across (an await between the narrowing bump
and installing the new state) bumps again once the new state is in place.

The MITM's upstream TLS session resumption (:mod:`egressd.mitmchild.tlsresume`) reads the client's
slot too, as the epoch a client connection starts under (:meth:`SeqReader.value`): a session
learned under an older value never resumes on a newer connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

from egressd.feed import Narrowing, VaultChanged

SLOTS: Final = 4096
SLOT_BYTES: Final = 8
MAP_BYTES: Final = SLOTS * SLOT_BYTES
BEAT_SLOT: Final = SLOTS - 1  # egressd's heartbeat (monotonic ns), not a client slot
BEAT_S: Final = 0.05
MAX_SILENCE_S: Final = 0.25  # as long as one pull may take (LOOKUP_TIMEOUT_S)
_U64: Final = struct.Struct("<Q")

Stamp = tuple[int, int]  # (slot 0, the client's slot) as read before a pull


def slot_of(key: str) -> int:
    """The slot of one client key (an address as egressd and the addon print it, or a
    ``port:<n>`` key): stable across processes (crc32, not Python's salted hash), never 0."""
    return 1 + zlib.crc32(key.encode()) % (SLOTS - 2)


def seq_path(socket_path: Path | str) -> Path:
    """The map's file, beside the private socket (its directory is the one that is 0700)."""
    return Path(f"{socket_path}.seq")


class SeqWriter:
    """egressd's side: creates the file (replacing any old one), bumps slots."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seq = 0
        self._beat: asyncio.TimerHandle | None = None
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, MAP_BYTES)
            self._map: mmap.mmap | None = mmap.mmap(
                fd, MAP_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)

    def bump(self, keys: Iterable[object] | None) -> None:
        """Something about these clients (None: any client) may have narrowed."""
        m = self._map
        if m is None:
            return
        self._seq += 1
        value = _U64.pack(self._seq)
        slots = [0] if keys is None else sorted({slot_of(str(k)) for k in keys})
        for slot in slots:
            m[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES] = value

    def beat(self) -> None:
        """egressd is alive now (monotonic clocks are one clock across the host's processes)."""
        if self._map is not None:
            off = BEAT_SLOT * SLOT_BYTES
            self._map[off : off + SLOT_BYTES] = _U64.pack(time.monotonic_ns())

    def start_heartbeat(self) -> None:
        """Beat every :data:`BEAT_S` on the running loop: it stops when the loop does."""
        self.beat()
        self._beat = asyncio.get_running_loop().call_later(BEAT_S, self.start_heartbeat)

    def close(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None
        if self._map is not None:
            # Every reader's memory becomes unusable first: the last value seen is never
            # seen again once the file is gone (a reader of a closed map pulls).
            self.bump(None)
            self._map.close()
            self._map = None
        with contextlib.suppress(OSError):
            self.path.unlink()


class SeqReader:
    """A worker's side: the map, read-only. Any failure reads as None (pull)."""

    def __init__(self, path: str, max_silence: float = MAX_SILENCE_S) -> None:
        self._map: mmap.mmap | None = None
        self.max_silence_ns = int(max_silence * 1e9)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != MAP_BYTES:
                raise OSError("sequence map of the wrong size")
            self._map = mmap.mmap(fd, MAP_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)

    def _read(self, slot: int) -> int:
        assert self._map is not None
        off = slot * SLOT_BYTES
        # Read until two reads agree: an 8-byte store is one instruction on the platforms we
        # run on, the second read only guards against a torn copy elsewhere.
        for _ in range(4):
            first = _U64.unpack_from(self._map, off)[0]
            if _U64.unpack_from(self._map, off)[0] == first:
                return int(first)
        raise OSError("sequence slot kept changing")

    def stamp(self, key: str) -> Stamp | None:
        """The client's stamp, or None (pull) when egressd has been silent too long."""
        if self._map is None:
            return None
        try:
            if time.monotonic_ns() - self._read(BEAT_SLOT) > self.max_silence_ns:
                return None
            return self._read(0), self._read(slot_of(key))
        except (OSError, ValueError):
            return None

    def value(self, key: str) -> int | None:
        """The client's slot as it is now, whatever the heartbeat (None: unreadable). Values
        only grow, and the slot changes synchronously at the client's removal or rebind."""
        if self._map is None:
            return None
        try:
            return self._read(slot_of(key))
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


class MitmMemory:
    """The MITM memory's subscription to the daemon's change feed (:mod:`egressd.feed`), the only
    way in: every narrowing bumps the slot(s) concerned, first (the worker's memory is void from
    then on); a vault change then also tells the workers to drop those clients' vault snapshots
    (``forget``: :meth:`egressd.mitm.pool.MitmPool.forget`), delivered asynchronously, in order,
    never blocking the publisher (docs/reference/behaviour.md §14.9)."""

    def __init__(self, seq: SeqWriter | None, forget: Callable[[list[object] | None], None] | None = None) -> None:
        self.seq = seq
        self.forget = forget

    def __call__(self, event: Narrowing) -> None:
        clients = None if event.clients is None else list(event.clients)
        if self.seq is not None:
            self.seq.bump(clients)
        if self.forget is not None and isinstance(event, VaultChanged):
            self.forget(clients)
