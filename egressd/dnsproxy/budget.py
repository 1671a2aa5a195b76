"""Per-subject DNS query budget (docs/reference/behaviour.md §14.3): token buckets, pure apart from an injectable clock.

Every parsed query costs one token, whatever its fate (forwarded, denied, refused as
malformed): a subject that floods the proxy with names it may not resolve still costs the
daemon CPU and log work, and one that floods allowed names costs upstream traffic from the
pod's address. Over budget the proxy answers REFUSED without forwarding.

Keys: a known subject is keyed by its uid (so a subject rebound to a new address keeps its
bucket), an unknown source by its address. Both maps are bounded LRUs. When a map is full
the least recently used entry is evicted only if it has refilled to the burst anyway
(forgetting it then changes nothing); otherwise the newcomer shares one overflow bucket.
So an attacker who cycles source addresses neither grows memory nor earns a fresh burst per
address: past the cap, all its addresses drain the same bucket.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from egressd.addr import IPAddress

DEFAULT_QPS: Final = 200
BURST_FACTOR: Final = 2  # burst = twice the rate: a page load's first round of lookups passes
MAX_SUBJECT_BUCKETS: Final = 65536
MAX_SOURCE_BUCKETS: Final = 4096
OVERFLOW: Final = "\x00overflow"  # not a uid or an address, so never a real key


@dataclass(slots=True)
class TokenBucket:
    tokens: float
    stamp: float

    def refill(self, now: float, rate: float, burst: float) -> None:
        # A clock that steps back (it is monotonic in production; tests inject one) never mints tokens.
        elapsed = max(0.0, now - self.stamp)
        self.tokens = min(burst, self.tokens + elapsed * rate)
        self.stamp = max(self.stamp, now)

    def take(self, now: float, rate: float, burst: float) -> bool:
        self.refill(now, rate, burst)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class _Buckets:
    """One bounded LRU of buckets plus the overflow bucket its newcomers share when full."""

    def __init__(self, cap: int, rate: float, burst: float) -> None:
        self.cap = cap
        self.rate = rate
        self.burst = burst
        self.buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self.overflow: TokenBucket | None = None

    def take(self, key: str, now: float) -> bool:
        bucket = self.buckets.get(key)
        if bucket is not None:
            self.buckets.move_to_end(key)
            return bucket.take(now, self.rate, self.burst)
        if len(self.buckets) >= self.cap:
            _, oldest = next(iter(self.buckets.items()))
            oldest.refill(now, self.rate, self.burst)
            if oldest.tokens < self.burst:
                # Every tracked key is still draining: forgetting one would hand it a fresh
                # burst. The newcomer shares the overflow bucket instead (O(1), no scan).
                if self.overflow is None:
                    self.overflow = TokenBucket(self.burst, now)
                return self.overflow.take(now, self.rate, self.burst)
            self.buckets.popitem(last=False)
        bucket = self.buckets[key] = TokenBucket(self.burst, now)
        return bucket.take(now, self.rate, self.burst)


class QueryBudget:
    """``admit(uid, source)`` is True while the asker is within ``qps`` queries per second
    (burst ``2 * qps``). Construct only for ``qps > 0``: 0 means no budget (the caller passes
    None instead), which keeps the hot path free of a branch per query."""

    def __init__(
        self,
        qps: float,
        *,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_subjects: int = MAX_SUBJECT_BUCKETS,
        max_sources: int = MAX_SOURCE_BUCKETS,
    ) -> None:
        if qps <= 0:
            raise ValueError(f"qps must be > 0, got {qps}")
        self.qps = float(qps)
        self.burst = float(burst if burst is not None else BURST_FACTOR * qps)
        if self.burst < 1:
            raise ValueError(f"burst must be >= 1, got {self.burst}")
        self.clock = clock
        self.subjects = _Buckets(max_subjects, self.qps, self.burst)
        self.sources = _Buckets(max_sources, self.qps, self.burst)

    def admit(self, uid: str | None, source: IPAddress) -> bool:
        now = self.clock()
        if uid is not None:
            return self.subjects.take(uid, now)
        return self.sources.take(str(source), now)

    def tracked(self) -> int:
        """Buckets held (for tests of the bound)."""
        return len(self.subjects.buckets) + len(self.sources.buckets)


def query_budget(qps: int) -> QueryBudget | None:
    """The budget for ``EGRESSD_DNS_QPS_PER_SUBJECT``: None (no budget) for 0."""
    return QueryBudget(qps) if qps > 0 else None
