"""Identity of a sandbox inside egressd: Subject names, dispatch keys and fences."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NewType

from egressd.addr import IPAddress
from egressd.policy import NetworkPolicy

Subject = NewType("Subject", str)

_NFT_ID_UNSAFE = re.compile(r"[^a-z0-9_]")

MAX_UID_LEN = 128


def subject_for_uid(uid: str) -> Subject:
    """A sandbox uid maps verbatim onto its subject name."""
    return Subject("s-" + uid)


def nft_id(subject: Subject) -> str:
    """The identifier used inside nft object names (``s-u-1`` -> ``s_u_1``)."""
    return _NFT_ID_UNSAFE.sub("_", subject.lower())


def uid_problem(uid: str) -> str | None:
    """Why ``uid`` cannot name a sandbox, or None when it can."""
    if not uid:
        return "empty"
    if len(uid) > MAX_UID_LEN:
        return f"longer than {MAX_UID_LEN} characters"
    if any(c in uid for c in ("/", "\\", "\x00")):
        return "contains '/', '\\' or NUL"
    return None


@dataclass(frozen=True, slots=True)
class Fence:
    """Identity of one attachment of a sandbox; any change means a rebind.

    ``specGeneration`` is deliberately not part of it: it bumps on pure policy edits,
    which must apply in place.
    """

    runtime_instance_id: str
    attachment_id: str


@dataclass(frozen=True, slots=True)
class Asker:
    """Who asked: the subject behind a source IP, and its effective policy (None while denying).
    What the DNS proxy asks of a subject engine (:mod:`egressd.dnsproxy.server`)."""

    uid: str
    fence: Fence
    policy: NetworkPolicy | None


@dataclass(frozen=True, slots=True)
class SubjectKey:
    """Dispatch material for a subject. Only ``source_ip`` is indexed in the fleet profile."""

    source_ip: IPAddress | None = None
    netns_path: str | None = None
    uid: int | None = None
    cgroup: str | None = None
