"""The sidecar's initial policy and its persisted copy (docs/reference/behaviour.md §13).

:func:`choose_initial` is pure (texts in, policy and warnings out); :func:`write_atomic` and
:func:`read_text` are the only I/O. The persisted file holds the user policy only (no
secrets): it is what a restarted sidecar enforces.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from egressd.policy import DENY_ALL, NetworkPolicy, PolicyError, parse_policy


class InitialPolicyError(ValueError):
    """OPENSANDBOX_EGRESS_RULES is invalid: a start-up error (one line)."""


@dataclass(frozen=True, slots=True)
class Initial:
    policy: NetworkPolicy
    source: str  # "file", "rules" or "default"
    warning: str | None = None


def choose_initial(file_text: str | None, file_problem: str | None, rules: str | None) -> Initial:
    """``OPENSANDBOX_EGRESS_POLICY_FILE`` if present and valid, else ``OPENSANDBOX_EGRESS_RULES``,
    else deny-all.

    ``file_text`` is None when the file is unset or absent; ``file_problem`` says why it could
    not be read. An empty or invalid file falls back with a warning (a half-written file
    must not keep the sidecar down); an invalid RULES value is a start-up error, because it
    is explicit configuration and guessing would either open or close more than asked.
    """
    warning: str | None = None
    if file_problem is not None:
        warning = f"policy file unreadable ({file_problem}); falling back"
    elif file_text is not None:
        if not file_text.strip():
            warning = "policy file is empty; falling back"
        else:
            try:
                return Initial(_sidecar_policy(file_text), "file")
            except PolicyError as exc:
                warning = f"policy file is invalid ({exc}); falling back"
    if rules is not None and rules.strip():
        try:
            return Initial(_sidecar_policy(rules), "rules", warning)
        except PolicyError as exc:
            raise InitialPolicyError(f"OPENSANDBOX_EGRESS_RULES: {exc}") from None
    return Initial(DENY_ALL, "default", warning)


def _sidecar_policy(text: str) -> NetworkPolicy:
    policy = parse_policy(text)
    if policy.audit:
        # Audit mode is fleet-only (see egressd.sidecar.http.AUDIT_UNSUPPORTED).
        raise PolicyError("mode: 'audit' is not supported by the sidecar profile (fleet only)")
    return policy


def read_text(path: Path | None) -> tuple[str | None, str | None]:
    """(text, problem): (None, None) when unset or absent."""
    if path is None:
        return None, None
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, exc.strerror or type(exc).__name__
    try:
        return data.decode("utf-8-sig"), None
    except UnicodeDecodeError:
        return None, "not valid UTF-8"


def serialise(policy: NetworkPolicy) -> str:
    return json.dumps(policy.to_json(), indent=2, sort_keys=True) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write temp file in the same directory, fsync, rename over ``path``, fsync the directory.

    A crash at any point leaves either the old or the new complete file, never a mix.
    """
    directory = path.parent
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
