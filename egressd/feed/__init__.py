"""The change feed: every owner of state that may narrow what egressd answers a client
publishes a typed :class:`Narrowing` here, synchronously, in the step that changed the state and
before its caller is answered (docs/reference/behaviour.md §10, "answered from memory").

One :class:`Feed` is made at start-up by the profile's composition root (``fleet/run.py``,
``sidecar/run.py``) and passed to the owners: the subject registry, the lease books, the
policies and always-rules, the vault stores, the sidecar engine and the HTTP API's writes
(:mod:`egressd.web.writes`). The MITM's memory (:mod:`egressd.mitm.seqmap`) subscribes; no owner
knows who listens, and nothing but a subscriber touches the MITM memory.

Publishing is a plain synchronous call of every subscriber, in subscription order: cheap, and
a no-op while nobody subscribes (no MITM). Events say *that* something may have narrowed and
for which clients (``None``: any client); a subscriber decides what it voids.

This package is a model: it imports nothing of egressd.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "AlwaysRulesChanged",
    "ApiWrite",
    "Feed",
    "LeasesNarrowed",
    "Narrowing",
    "PolicyApplied",
    "SubjectChanged",
    "Subscriber",
    "VaultChanged",
    "port_key",
]


@dataclass(frozen=True, slots=True)
class Narrowing:
    """Something may have narrowed what ``_active`` answers these clients (None: any client).

    A client is an address (:class:`ipaddress.IPv4Address`/``IPv6Address`) or a host-uid
    subject's MITM port key (:func:`port_key`); subscribers compare them as strings."""

    clients: tuple[object, ...] | None = None


@dataclass(frozen=True, slots=True)
class SubjectChanged(Narrowing):
    """A registry entry was committed or dropped: a policy, state or binding change."""


@dataclass(frozen=True, slots=True)
class LeasesNarrowed(Narrowing):
    """A subject's lease book was narrowed or forgotten: names that verified destinations may be gone."""


@dataclass(frozen=True, slots=True)
class PolicyApplied(Narrowing):
    """A policy (a subject's, or the sidecar's) and its lease book changed together."""


@dataclass(frozen=True, slots=True)
class AlwaysRulesChanged(Narrowing):
    """The always-rules were reloaded: every subject's effective policy changed."""


@dataclass(frozen=True, slots=True)
class VaultChanged(Narrowing):
    """What the vault lookup answers these clients changed (vault deleted, changed or
    activated; subject removed, rebound or closing): the MITM child drops their snapshots too
    (docs/reference/behaviour.md §14.9)."""


@dataclass(frozen=True, slots=True)
class ApiWrite(Narrowing):
    """A write through the HTTP API ended (or was abandoned by its client and ended later):
    coarse, for every client."""


Subscriber = Callable[[Narrowing], None]


def port_key(port: int) -> str:
    """The cache key of the clients of a per-subject MITM port (host-uid subjects, docs/reference/behaviour.md
    §17): the port names the subject there, the peer address (the host's own) names nobody."""
    return f"port:{port}"


class Feed:
    """The one change feed of a daemon. Subscribers are called synchronously, in order."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Add a subscriber; returns the call that removes it again."""
        self._subscribers.append(subscriber)
        return lambda: self.unsubscribe(subscriber)

    def unsubscribe(self, subscriber: Subscriber) -> None:
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)

    def publish(self, event: Narrowing) -> None:
        """Call right after a change that may narrow (before its caller is answered)."""
        for subscriber in list(self._subscribers):
            subscriber(event)
