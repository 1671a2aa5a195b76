"""Operator always-rules (§5): ``deny.always`` and ``allow.always`` prepended to every policy."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from egressd.policy.model import NetworkPolicy, PolicyError, Rule, Verdict, parse_target

DENY_FILE: Final = "deny.always"
ALLOW_FILE: Final = "allow.always"


@dataclass(frozen=True, slots=True)
class AlwaysRules:
    deny: tuple[Rule, ...]
    allow: tuple[Rule, ...]


EMPTY_ALWAYS: Final = AlwaysRules((), ())


class AlwaysRulesError(ValueError):
    """An always-rules file is invalid or unreadable (a startup error); names file and line."""


def parse_always_text(text: str, filename: str, verdict: Verdict) -> tuple[Rule, ...]:
    """One trimmed target per line; blank lines and lines starting with ``#`` are skipped.

    Lines are counted by ``\\n`` so ``filename:line`` in errors matches what editors show.
    """
    rules: list[Rule] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        try:
            target, kind, network = parse_target(entry)
        except PolicyError as e:
            raise AlwaysRulesError(f"{filename}:{lineno}: {e.reason}") from None
        rules.append(Rule(verdict, target, kind, network))
    return tuple(rules)


def _read(path: Path, verdict: Verdict) -> tuple[Rule, ...]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ()
    except OSError as e:
        raise AlwaysRulesError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise AlwaysRulesError(f"{path}: not valid UTF-8 (bad byte at offset {e.start})") from None
    return parse_always_text(text, str(path), verdict)


def load_always_rules(directory: Path) -> AlwaysRules:
    """Read ``deny.always`` and ``allow.always`` from ``directory``.

    A missing file (or a missing directory) means no rules; anything unreadable or invalid
    raises AlwaysRulesError. This is the only function in the package that does I/O.
    """
    return AlwaysRules(
        deny=_read(directory / DENY_FILE, Verdict.DENY),
        allow=_read(directory / ALLOW_FILE, Verdict.ALLOW),
    )


def effective_policy(user: NetworkPolicy, always: AlwaysRules) -> NetworkPolicy:
    """``always.deny ++ always.allow ++ user.egress`` under the user's defaultAction and mode.

    The counts of the prepended rules are kept so audit mode can keep always-deny hard and
    rule labels can tell operator rules from the user's.
    """
    if not always.deny and not always.allow:
        return user
    return NetworkPolicy(
        user.default_action,
        always.deny + always.allow + user.egress,
        user.audit,
        always_deny=len(always.deny),
        always_allow=len(always.allow),
    )
