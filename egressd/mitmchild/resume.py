"""Upstream TLS sessions kept for resumption (``EGRESSD_MITM_TLS_RESUME``, docs/reference/behaviour.md §10).

A resumed handshake skips the upstream's certificate chain and its verification, so a session
may only be offered where the full handshake it came from would have been accepted again, and
never where it links tenants:

* the key holds the **client** (the sandbox: its address on the shared listener, its port key
  on a per-subject port), so a ticket never crosses sandboxes (the upstream would see two
  tenants' connections as one client), and a forgotten client (removed or rebound subject:
  the forget lines of docs/reference/behaviour.md §14.9) loses its sessions;
* the client's **epoch** when its connection started (its slot in egressd's narrowing sequence
  map, which egressd bumps synchronously at a removal or rebind; without the map, a local
  count of forget lines): a session learned under an older epoch never resumes on a newer
  connection, also when it was stored after the forget (a connection that began before it)
  or when a worker's forget line has not arrived yet;
* the **SNI** (the name the session was verified for) and the **upstream address**: a changed
  address never resumes; a changed server at the same address cannot (it does not hold the
  ticket's key), so it meets the full handshake and its verification;
* the **verification mode and trust configuration**: a session of an unverified handshake is
  never offered to a verified one, or the reverse.

A session is handed out once (RFC 8446 §C.4: a reused ticket links connections for a passive
observer); the connection that used it stores its own fresh one. Bounded (entries per key and in
all, least recently stored dropped first) and expired after :data:`SESSION_TTL_S`, whatever the
ticket's own lifetime.

Pure: the session objects are opaque here, time is passed in.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

SESSION_TTL_S: Final = 300.0
MAX_KEYS: Final = 4096
PER_KEY: Final = 4  # concurrent connections to one upstream from one sandbox that can resume


@dataclass(frozen=True, slots=True)
class SessionKey:
    client: str  # the sandbox: a canonical address or a per-subject port key
    sni: str
    address: tuple[str, int]  # the upstream the handshake went to
    verify: bool  # certificate verification on
    trust: str  # which trust store verified it ("" when verification is off)
    epoch: tuple[int, ...]  # the client's epoch when its connection started (see above)


class SessionCache[S]:
    def __init__(
        self, *, ttl: float = SESSION_TTL_S, max_keys: int = MAX_KEYS, per_key: int = PER_KEY
    ) -> None:
        if ttl <= 0 or max_keys < 1 or per_key < 1:
            raise ValueError("session cache bounds must be positive")
        self.ttl, self.max_keys, self.per_key = ttl, max_keys, per_key
        self._by: OrderedDict[SessionKey, deque[tuple[float, S]]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(q) for q in self._by.values())

    def put(self, key: SessionKey, session: S, now: float) -> None:
        queue = self._by.pop(key, None)
        if queue is None:
            queue = deque(maxlen=self.per_key)
        queue.append((now, session))
        self._by[key] = queue  # the most recently stored key is the last to go
        while len(self._by) > self.max_keys:
            self._by.popitem(last=False)

    def take(self, key: SessionKey, now: float) -> S | None:
        """The newest unexpired session of ``key``, removed; None when there is none."""
        queue = self._by.get(key)
        while queue:
            stored, session = queue.pop()
            if now - stored < self.ttl and now >= stored:
                if not queue:
                    del self._by[key]
                return session
        self._by.pop(key, None)
        return None

    def drop(self, key: SessionKey) -> None:
        """Forget ``key``'s sessions (its upstream failed a handshake)."""
        self._by.pop(key, None)

    def forget(self, clients: Iterable[str] | None) -> None:
        """Drop these clients' sessions (None: everyone's)."""
        if clients is None:
            self._by.clear()
            return
        gone = set(clients)
        for key in [k for k in self._by if k.client in gone]:
            del self._by[key]

    def expire(self, now: float) -> None:
        """Drop every expired session (also called on its own, so idle keys do not linger)."""
        for key in list(self._by):
            fresh = deque((t, s) for t, s in self._by[key] if 0 <= now - t < self.ttl)
            if fresh:
                self._by[key] = deque(fresh, maxlen=self.per_key)
            else:
                del self._by[key]
