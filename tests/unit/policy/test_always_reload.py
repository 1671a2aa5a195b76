"""§5 always-rules hot reload (PROPOSED): re-read, apply a changed profile, keep the last good one."""

from __future__ import annotations

from pathlib import Path

import pytest

from egressd.policy import EMPTY_ALWAYS, AlwaysRules, load_always_rules
from egressd.policy.reload import AlwaysRulesReloader


class Apply:
    def __init__(self, error: Exception | None = None) -> None:
        self.calls: list[AlwaysRules] = []
        self.error = error

    async def __call__(self, rules: AlwaysRules) -> None:
        self.calls.append(rules)
        if self.error is not None:
            raise self.error


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    d = tmp_path / "always"
    d.mkdir()
    (d / "deny.always").write_text("# operator deny list\nevil.com\n\n10.66.0.0/16\n")
    (d / "allow.always").write_text("pypi.org\n")
    return d


def targets(rules: AlwaysRules) -> tuple[list[str], list[str]]:
    return [r.target for r in rules.deny], [r.target for r in rules.allow]


async def test_unchanged_files_apply_nothing(rules_dir: Path) -> None:
    apply = Apply()
    reloader = AlwaysRulesReloader(rules_dir, load_always_rules(rules_dir), apply)
    assert await reloader.check() is False
    assert await reloader.check() is False
    assert apply.calls == []


async def test_rewritten_with_the_same_content_applies_nothing(rules_dir: Path) -> None:
    apply = Apply()
    current = load_always_rules(rules_dir)
    reloader = AlwaysRulesReloader(rules_dir, current, apply)
    # Comments and blank lines are not rules: same effective profile.
    (rules_dir / "deny.always").write_text("evil.com\n# moved comment\n  10.66.0.0/16  \n")
    assert await reloader.check() is False
    assert apply.calls == []
    assert reloader.current is current


async def test_changed_file_is_applied_once_with_the_new_rules(rules_dir: Path) -> None:
    apply = Apply()
    reloader = AlwaysRulesReloader(rules_dir, load_always_rules(rules_dir), apply)
    (rules_dir / "allow.always").write_text("pypi.org\nfiles.pythonhosted.org\n")
    assert await reloader.check() is True
    assert len(apply.calls) == 1
    assert targets(apply.calls[0]) == (["evil.com", "10.66.0.0/16"], ["pypi.org", "files.pythonhosted.org"])
    assert reloader.current == apply.calls[0]
    assert await reloader.check() is False  # nothing new since
    assert len(apply.calls) == 1


async def test_removed_file_means_no_rules_of_that_kind(rules_dir: Path) -> None:
    apply = Apply()
    reloader = AlwaysRulesReloader(rules_dir, load_always_rules(rules_dir), apply)
    (rules_dir / "deny.always").unlink()
    assert await reloader.check() is True
    assert targets(apply.calls[0]) == ([], ["pypi.org"])


async def test_files_appearing_in_an_empty_directory(tmp_path: Path) -> None:
    apply = Apply()
    reloader = AlwaysRulesReloader(tmp_path, EMPTY_ALWAYS, apply)
    assert await reloader.check() is False
    (tmp_path / "deny.always").write_text("evil.com\n")
    assert await reloader.check() is True
    assert targets(apply.calls[0]) == (["evil.com"], [])


@pytest.mark.parametrize(
    ("filename", "content"),
    [
        ("deny.always", "evil.com\n*bad*.com\n"),
        ("allow.always", "pypi.org\nfoo.*.com\n"),
        ("deny.always", b"evil.com\n\xff\xfe\n"),
    ],
    ids=["deny-invalid-target", "allow-invalid-target", "not-utf8"],
)
async def test_broken_file_keeps_the_current_rules(
    rules_dir: Path, filename: str, content: str | bytes
) -> None:
    apply = Apply()
    current = load_always_rules(rules_dir)
    reloader = AlwaysRulesReloader(rules_dir, current, apply)
    path = rules_dir / filename
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    assert await reloader.check() is False
    assert apply.calls == []
    assert reloader.current is current


async def test_unreadable_file_keeps_the_current_rules(rules_dir: Path) -> None:
    apply = Apply()
    current = load_always_rules(rules_dir)
    reloader = AlwaysRulesReloader(rules_dir, current, apply)
    (rules_dir / "deny.always").unlink()
    (rules_dir / "deny.always").mkdir()  # reading a directory fails even for root
    assert await reloader.check() is False
    assert apply.calls == []
    assert reloader.current is current


async def test_broken_then_fixed_file_is_applied(rules_dir: Path) -> None:
    apply = Apply()
    reloader = AlwaysRulesReloader(rules_dir, load_always_rules(rules_dir), apply)
    (rules_dir / "deny.always").write_text("*bad*\n")
    assert await reloader.check() is False
    (rules_dir / "deny.always").write_text("worse.com\n")
    assert await reloader.check() is True
    assert targets(apply.calls[0]) == (["worse.com"], ["pypi.org"])


async def test_apply_failure_keeps_the_current_rules_and_retries(rules_dir: Path) -> None:
    apply = Apply(error=RuntimeError("nft refused"))
    current = load_always_rules(rules_dir)
    reloader = AlwaysRulesReloader(rules_dir, current, apply)
    (rules_dir / "deny.always").write_text("other.com\n")
    assert await reloader.check() is False
    assert len(apply.calls) == 1
    assert reloader.current is current
    # Next round the file still differs from what is applied: tried again, and kept on success.
    apply.error = None
    assert await reloader.check() is True
    assert len(apply.calls) == 2
    assert targets(reloader.current) == (["other.com"], ["pypi.org"])
