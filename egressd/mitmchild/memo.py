"""What a MITM worker remembers of ``_active`` answers, and when it may answer from it (pure).

docs/reference/behaviour.md §10, "answered from memory". Keyed like the snapshot cache (an address, or a
``port:<n>`` key of a host-uid subject). An entry is usable only under the exact
:data:`~egressd.mitm.seqmap.Stamp` it was learned under (read before the pull that taught it):
any narrowing since has changed the stamp, and the caller pulls. A destination verdict is kept
only when positive and only until the lease that verified it ends (the ``_active`` reply's
``X-Egressd-Destination-Ttl``, counted from before the pull was sent); unverified pairs are not
kept, because a new DNS answer can verify them without any narrowing.

Bounded: at most ``max_clients`` clients and ``max_pairs`` (host, destination) pairs, least
recently used evicted first; eviction only costs a pull.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final

from egressd.mitm.seqmap import Stamp
from egressd.vault.snapshot import VaultSnapshot

MAX_CLIENTS: Final = 4096
MAX_PAIRS: Final = 16384
MAX_TTL_S: Final = 300.0  # egressd's header is capped too; this is the worker's own bound


@dataclass(frozen=True, slots=True)
class Remembered:
    snapshot: VaultSnapshot | None = field(repr=False)  # None: no vault (404)
    stamp: Stamp


@dataclass(slots=True)
class Memo:
    max_clients: int = MAX_CLIENTS
    max_pairs: int = MAX_PAIRS
    clients: OrderedDict[str, Remembered] = field(default_factory=OrderedDict)
    pairs: OrderedDict[tuple[str, str, str], tuple[float, Stamp]] = field(default_factory=OrderedDict)

    def recall(
        self, key: str, host: str | None, dst: str | None, stamp: Stamp | None, now: float
    ) -> tuple[VaultSnapshot | None, bool] | None:
        """(snapshot, destination verified) from memory, or None: pull.

        ``host``/``dst`` None asks for the snapshot only (connection-time decisions). With
        both given and a vault, the pair must be remembered as verified, still running.
        """
        if stamp is None:
            return None
        entry = self.clients.get(key)
        if entry is None or entry.stamp != stamp:
            return None
        self.clients.move_to_end(key)
        if entry.snapshot is None or not (host and dst):
            return entry.snapshot, False
        pair = (key, host, dst)
        verdict = self.pairs.get(pair)
        if verdict is None or verdict[1] != stamp or verdict[0] <= now:
            return None
        self.pairs.move_to_end(pair)
        return entry.snapshot, True

    def learn(
        self,
        key: str,
        host: str | None,
        dst: str | None,
        snapshot: VaultSnapshot | None,
        verified_ttl: float | None,
        stamp: Stamp | None,
        sent_at: float,
    ) -> None:
        """A pull's answer, stamped with what was read before it was sent (``sent_at``)."""
        if stamp is None:
            return
        self.clients[key] = Remembered(snapshot, stamp)
        self.clients.move_to_end(key)
        while len(self.clients) > max(1, self.max_clients):
            self.clients.popitem(last=False)
        if snapshot is None or not (host and dst) or verified_ttl is None or verified_ttl <= 0:
            return
        pair = (key, host, dst)
        self.pairs[pair] = (sent_at + min(verified_ttl, MAX_TTL_S), stamp)
        self.pairs.move_to_end(pair)
        while len(self.pairs) > max(1, self.max_pairs):
            self.pairs.popitem(last=False)

    def forget(self, key: str | None) -> None:
        """Drop one client (None: everyone). Pairs of a dropped client die with their stamp."""
        if key is None:
            self.clients.clear()
            self.pairs.clear()
        else:
            self.clients.pop(key, None)


def parse_ttl(text: str | None) -> float | None:
    """``X-Egressd-Destination-Ttl``: seconds, finite and positive, else None (not kept)."""
    if text is None:
        return None
    try:
        value = float(text.strip())
    except ValueError:
        return None
    if not 0 < value < float("inf"):
        return None
    return value
