"""The per-subject credential vault (docs/reference/behaviour.md §6): an immutable :class:`Vault` and the
:class:`VaultStore` that holds at most one of them and implements the operation table.

Conventions
-----------

* The HTTP-shaped operations (:meth:`VaultStore.put`, ``post``, ``patch``, ``delete``,
  ``get``, ``credentials``, ``credential``, ``bindings``, ``binding``) **never raise** for a
  request problem: they return ``(status, body)`` where ``body`` is the JSON object to send,
  ``None`` for 204, or ``{"error": "<one-line message>"}`` for 400/404/409. The message never
  contains a credential value. (The store never produces 412: the sidecar's readiness gate is
  the HTTP layer's job.)
* The helpers for other callers (:meth:`VaultStore.check_content`,
  :meth:`VaultStore.check_policy`) raise :class:`~egressd.vault.types.VaultError`.
* ``coverage_policy`` arguments are the policy bindings are checked against (the fleet: the
  subject's effective policy if active, else pending + always-rules); ``None`` means "no
  policy" and any binding is refused with 400.
* Every mutation produces a new :class:`Vault`; nothing is changed when an operation fails.
  The store is not thread-safe: the caller serialises operations (the daemon runs them on its
  event loop, where each call is atomic).

The sanitized state (``get()``) is ``{"revision", "credentials": [{"name", "sourceType",
"revision"}], "bindings": [{"name", "revision": <vault revision>, "match": {"schemes", "hosts",
"methods", "paths"}, "auth": {"type", "name"?}}]}``, lists sorted by name; substitutions and
values are never part of it. :meth:`VaultStore.snapshot` is the only way to values: it is what
the MITM's private ``/_active`` endpoint serves.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Final

from egressd.policy.model import NetworkPolicy
from egressd.vault.coverage import check_coverage
from egressd.vault.parse import parse_create, parse_mutation, peek_expected_revision
from egressd.vault.snapshot import VaultSnapshot, build_snapshot
from egressd.vault.types import (
    DEFAULT_LIMITS,
    Binding,
    BindingMutations,
    Credential,
    CredentialMutations,
    Mutation,
    VaultContent,
    VaultError,
    VaultLimits,
    echo,
)
from egressd.vault.validate import validate_candidate

__all__ = [
    "Response",
    "Vault",
    "VaultStore",
    "new_incarnation_id",
]

#: ``(HTTP status, JSON body or None)``.
Response = tuple[int, dict[str, Any] | None]

NOT_FOUND: Final = "credential vault not found"
EXISTS: Final = "credential vault already exists"


def new_incarnation_id() -> str:
    """16 random hex digits identifying one vault from its creation to its deletion."""
    return secrets.token_hex(8)


def _error(err: VaultError) -> Response:
    return err.status, {"error": str(err)}


def _not_found(message: str = NOT_FOUND) -> Response:
    return 404, {"error": message}


# --------------------------------------------------------------------------------------------
# The vault


@dataclass(frozen=True, slots=True, eq=False)
class Vault:
    """One vault revision. The mappings are read-only and ordered by name."""

    incarnation: str
    revision: int
    credentials: Mapping[str, Credential]
    bindings: Mapping[str, Binding]

    @classmethod
    def build(
        cls, incarnation: str, revision: int, credentials: Iterable[Credential], bindings: Iterable[Binding]
    ) -> Vault:
        creds = {c.name: c for c in sorted(credentials, key=lambda c: c.name)}
        binds = {b.name: b for b in sorted(bindings, key=lambda b: b.name)}
        return cls(incarnation, revision, MappingProxyType(creds), MappingProxyType(binds))

    def __repr__(self) -> str:
        return (
            f"Vault(incarnation={self.incarnation!r}, revision={self.revision}, "
            f"credentials={list(self.credentials)!r}, bindings={list(self.bindings)!r})"
        )

    __str__ = __repr__

    @property
    def tag(self) -> str:
        return f"{self.incarnation}-{self.revision}"

    def same_content(self, content: VaultContent) -> bool:
        """Whether ``content`` is this vault's normalised content (revisions aside)."""
        if len(content.credentials) != len(self.credentials) or len(content.bindings) != len(self.bindings):
            return False
        for c in content.credentials:
            mine = self.credentials.get(c.name)
            if mine is None or not mine.same_content(c):
                return False
        for b in content.bindings:
            other = self.bindings.get(b.name)
            if other is None or not other.same_content(b):
                return False
        return True

    def credential_list(self) -> list[dict[str, Any]]:
        return [c.metadata() for c in self.credentials.values()]

    def binding_list(self) -> list[dict[str, Any]]:
        return [b.metadata(self.revision) for b in self.bindings.values()]

    def state(self) -> dict[str, Any]:
        """The sanitized ``CredentialVaultState``."""
        return {
            "revision": self.revision,
            "credentials": self.credential_list(),
            "bindings": self.binding_list(),
        }


# --------------------------------------------------------------------------------------------
# The store


def _mutated_credentials(
    current: Mapping[str, Credential], ops: CredentialMutations, revision: int
) -> dict[str, Credential]:
    """Deletions, then replacements, then additions, each stamped with ``revision``; naming a
    credential that is not there (or, to add, one that is) is a :class:`VaultError`."""
    credentials = dict(current)
    for i, name in enumerate(ops.delete):
        if credentials.pop(name, None) is None:
            raise VaultError(f"credential {echo(name)} does not exist", f"credentials.delete[{i}]")
    for i, c in enumerate(ops.replace):
        if c.name not in credentials:
            raise VaultError(f"credential {echo(c.name)} does not exist", f"credentials.replace[{i}].name")
        credentials[c.name] = replace(c, revision=revision)
    for i, c in enumerate(ops.add):
        if c.name in credentials:
            raise VaultError(f"credential {echo(c.name)} already exists", f"credentials.add[{i}].name")
        credentials[c.name] = replace(c, revision=revision)
    return credentials


def _mutated_bindings(
    current: Mapping[str, Binding], ops: BindingMutations, revision: int
) -> dict[str, Binding]:
    """Like :func:`_mutated_credentials`, for the bindings."""
    bindings = dict(current)
    for i, name in enumerate(ops.delete):
        if bindings.pop(name, None) is None:
            raise VaultError(f"binding {echo(name)} does not exist", f"bindings.delete[{i}]")
    for i, b in enumerate(ops.replace):
        if b.name not in bindings:
            raise VaultError(f"binding {echo(b.name)} does not exist", f"bindings.replace[{i}].name")
        bindings[b.name] = replace(b, revision=revision)
    for i, b in enumerate(ops.add):
        if b.name in bindings:
            raise VaultError(f"binding {echo(b.name)} already exists", f"bindings.add[{i}].name")
        bindings[b.name] = replace(b, revision=revision)
    return bindings


class VaultStore:
    """At most one vault (the fleet keeps one store per subject, the sidecar one).

    ``ignore_hosts`` are the MITM's ``ignore_hosts`` patterns (a binding host matching one is
    refused); ``new_incarnation`` makes incarnation ids (tests may inject a deterministic one);
    ``limits`` are the size caps every write is held to (docs/reference/behaviour.md §14.7).
    """

    def __init__(
        self,
        *,
        ignore_hosts: Sequence[re.Pattern[str]] = (),
        new_incarnation: Callable[[], str] = new_incarnation_id,
        limits: VaultLimits = DEFAULT_LIMITS,
    ) -> None:
        self._ignore_hosts = tuple(ignore_hosts)
        self._new_incarnation = new_incarnation
        self.limits = limits
        self._vault: Vault | None = None
        self._snapshot: VaultSnapshot | None = None
        self._last_incarnation: str | None = None

    def __repr__(self) -> str:
        return f"VaultStore(vault={self._vault!r})"

    # -- state -------------------------------------------------------------------------------

    @property
    def vault(self) -> Vault | None:
        return self._vault

    @property
    def exists(self) -> bool:
        return self._vault is not None

    @property
    def revision(self) -> int | None:
        return None if self._vault is None else self._vault.revision

    @property
    def tag(self) -> str | None:
        """``"<incarnation>-<revision>"``, None without a vault."""
        return None if self._vault is None else self._vault.tag

    def snapshot(self) -> VaultSnapshot | None:
        """The injection view of the current vault (cached until the next mutation)."""
        vault = self._vault
        if vault is None:
            return None
        if self._snapshot is None or self._snapshot.tag != vault.tag:
            self._snapshot = build_snapshot(
                vault.tag, vault.incarnation, vault.revision, vault.credentials, vault.bindings.values()
            )
        return self._snapshot

    def fork(self) -> VaultStore:
        """A private copy to run one operation on in a worker thread (14.7): it shares the
        immutable :class:`Vault`, so the copy is O(1) and the original is never touched off
        the event loop. :meth:`adopt` brings the result back."""
        other = VaultStore(ignore_hosts=self._ignore_hosts, new_incarnation=self._new_incarnation)
        other.limits = self.limits
        other._vault = self._vault
        other._snapshot = self._snapshot
        other._last_incarnation = self._last_incarnation
        return other

    def adopt(self, fork: VaultStore) -> None:
        """Take over the state an operation left in ``fork`` (on the event loop, under the
        subject lock)."""
        self._vault = fork._vault
        self._snapshot = fork._snapshot
        self._last_incarnation = fork._last_incarnation

    def clear(self) -> None:
        """Drop the vault, if any (unload, removal, ``"vault": null``); no status."""
        self._vault = None
        self._snapshot = None

    def _commit(self, vault: Vault) -> None:
        self._vault = vault
        self._snapshot = None

    def _fresh_incarnation(self) -> str:
        for _ in range(16):
            candidate = self._new_incarnation()
            if candidate != self._last_incarnation:
                break
        else:  # a broken generator; still never reuse the previous tag
            candidate = f"{self._last_incarnation}x"
        self._last_incarnation = candidate
        return candidate

    def _create(self, content: VaultContent) -> Vault:
        return Vault.build(
            self._fresh_incarnation(),
            1,
            (replace(c, revision=1) for c in content.credentials),
            (replace(b, revision=1) for b in content.bindings),
        )

    # -- validation helpers (raise VaultError) ------------------------------------------------

    def check_content(self, content: VaultContent, coverage_policy: NetworkPolicy | None) -> None:
        """Validate a parsed create/replace body as a whole vault (references, ambiguity,
        coverage, ignore_hosts) without touching the store."""
        validate_candidate(
            {c.name: c for c in content.credentials},
            content.bindings,
            coverage_policy,
            self._ignore_hosts,
            self.limits,
        )

    def check_policy(self, coverage_policy: NetworkPolicy | None) -> None:
        """Raise VaultError (400) if the current bindings would not be covered by a new policy
        (a ``/policy`` change that uncovers an active binding host is refused, §5)."""
        if self._vault is not None:
            check_coverage(self._vault.bindings.values(), coverage_policy)

    # -- operations (return (status, body)) ---------------------------------------------------

    def post(self, obj: object, coverage_policy: NetworkPolicy | None) -> Response:
        """Create: 201 state at revision 1; 409 if a vault exists; 400 invalid."""
        if self._vault is not None:
            return 409, {"error": EXISTS}
        try:
            content = parse_create(obj, self.limits)
            self.check_content(content, coverage_policy)
        except VaultError as e:
            return _error(e)
        self._commit(self._create(content))
        return 201, self._state()

    def put(self, obj: object, coverage_policy: NetworkPolicy | None) -> Response:
        """Replace with a complete revision (create shape); see :meth:`put_content`."""
        try:
            content = parse_create(obj, self.limits)
        except VaultError as e:
            return _error(e)
        return self.put_content(content, coverage_policy)

    def put_content(
        self, content: VaultContent, coverage_policy: NetworkPolicy | None, *, prevalidated: bool = False
    ) -> Response:
        """Absent -> 201 revision 1; identical normalised content -> 200, revision unchanged;
        else 200 at revision + 1 with every credential and binding at the new revision.

        ``prevalidated``: the caller has run :meth:`check_content` on ``content`` against an
        equal policy with this store's limits (a sealed vault checked when its binding input
        arrived); the commit is then O(n) and may run on the event loop."""
        if not prevalidated:
            try:
                self.check_content(content, coverage_policy)
            except VaultError as e:
                return _error(e)
        current = self._vault
        if current is None:
            self._commit(self._create(content))
            return 201, self._state()
        if current.same_content(content):
            return 200, current.state()
        revision = current.revision + 1
        self._commit(
            Vault.build(
                current.incarnation,
                revision,
                (replace(c, revision=revision) for c in content.credentials),
                (replace(b, revision=revision) for b in content.bindings),
            )
        )
        return 200, self._state()

    def patch(self, obj: object, coverage_policy: NetworkPolicy | None) -> Response:
        """Atomic mutation: 404 absent; 409 on an ``expectedRevision`` mismatch (checked
        before anything else in the body); 400 on any error (nothing changes); else 200 at
        revision + 1, added/replaced items at the new revision, the others keeping theirs."""
        current = self._vault
        if current is None:
            return _not_found()
        expected = peek_expected_revision(obj)
        if expected is not None and expected != current.revision:
            return 409, {
                "error": f"expectedRevision {expected} does not match the current revision {current.revision}"
            }
        try:
            mutation = parse_mutation(obj, self.limits)
            candidate = self._apply(current, mutation)
            # The caps hold for the sum: what is added counts with what is already there.
            validate_candidate(
                candidate.credentials,
                candidate.bindings.values(),
                coverage_policy,
                self._ignore_hosts,
                self.limits,
            )
        except VaultError as e:
            return _error(e)
        self._commit(candidate)
        return 200, self._state()

    @staticmethod
    def _apply(current: Vault, mutation: Mutation) -> Vault:
        revision = current.revision + 1
        credentials = _mutated_credentials(current.credentials, mutation.credentials, revision)
        bindings = _mutated_bindings(current.bindings, mutation.bindings, revision)
        return Vault.build(current.incarnation, revision, credentials.values(), bindings.values())

    def delete(self) -> Response:
        """404 absent; else 204 and the next create restarts at revision 1, new incarnation."""
        if self._vault is None:
            return _not_found()
        self.clear()
        return 204, None

    # -- reads --------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        assert self._vault is not None
        return self._vault.state()

    def get(self) -> Response:
        if self._vault is None:
            return _not_found()
        return 200, self._vault.state()

    def credentials(self) -> Response:
        if self._vault is None:
            return _not_found()
        return 200, {"revision": self._vault.revision, "credentials": self._vault.credential_list()}

    def credential(self, name: str) -> Response:
        if self._vault is None:
            return _not_found()
        credential = self._vault.credentials.get(name)
        if credential is None:
            return _not_found(f"credential {echo(name)} not found")
        return 200, credential.metadata()

    def bindings(self) -> Response:
        if self._vault is None:
            return _not_found()
        return 200, {"revision": self._vault.revision, "bindings": self._vault.binding_list()}

    def binding(self, name: str) -> Response:
        if self._vault is None:
            return _not_found()
        binding = self._vault.bindings.get(name)
        if binding is None:
            return _not_found(f"binding {echo(name)} not found")
        return 200, binding.metadata(self._vault.revision)
