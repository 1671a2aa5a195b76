"""The two ways a ruleset backend's transaction can fail, as the subject engine sees them.

The engine decides what a failure means for a subject (a refused narrowing is retried, an
unanswered widening is re-synced down, a learning step that may have applied is recorded) and
never needs to know which kernel interface the backend used. The kernel layer's own errors
(:class:`egressd.kernel.applier.NftError` and ``NftUncertain``) are these.
"""

from __future__ import annotations


class RulesetRefused(RuntimeError):
    """A transaction the kernel refused; nothing of it was applied."""


class RulesetUncertain(RulesetRefused):
    """A transaction whose outcome is unknown (sent, never answered): the kernel may hold all of
    it or none of it, never part, so the engine plans for both."""
