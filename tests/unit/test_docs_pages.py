"""The start and how-to pages run in CI (issue 27 item 4): scripts/docs/run_pages.py extracts every
block marked ``<!-- runs: fleet -->`` / ``<!-- runs: sidecar -->`` and scripts/smoke-fleet.sh and
scripts/smoke-sidecar.sh execute them against their running daemon. These check, without a
daemon, that every page has something to run (except the pages named in NOT_RUNNABLE, where
running makes no sense: docs/howto/run-at-scale.md holds sizing figures only) and that the
extractor parses every page and refuses a malformed marker instead of silently skipping it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_pages", ROOT / "scripts" / "docs" / "run_pages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


PAGES = sorted(
    str(p.relative_to(ROOT)) for d in ("docs/start", "docs/howto") for p in (ROOT / d).glob("*.md")
)


def test_the_start_and_howto_pages_exist() -> None:
    assert "docs/start/fleet-kubernetes.md" in PAGES
    assert "docs/start/sidecar.md" in PAGES
    assert len([p for p in PAGES if p.startswith("docs/howto/")]) >= 6


@pytest.mark.parametrize("page", PAGES)
def test_every_page_has_a_runnable_block(page: str) -> None:
    rp = runner()
    blocks = rp.extract((ROOT / page).read_text(), page)
    if page in rp.NOT_RUNNABLE:
        assert not blocks, f"{page} is listed as not runnable but has runnable blocks"
        return
    assert blocks, f"{page} has no <!-- runs: fleet|sidecar --> block (or add it to NOT_RUNNABLE, saying why)"
    for block in blocks:
        assert block.profile in rp.PROFILES
        assert block.code.strip()


def test_both_profiles_are_exercised() -> None:
    rp = runner()
    profiles = {b.profile for blocks in rp.all_blocks().values() for b in blocks}
    assert profiles == set(rp.PROFILES)


def test_the_sidecar_page_runs_against_the_sidecar() -> None:
    rp = runner()
    blocks = rp.extract((ROOT / "docs/start/sidecar.md").read_text())
    assert blocks and all(b.profile == "sidecar" for b in blocks)


def test_the_extractor_takes_only_marked_sh_blocks() -> None:
    rp = runner()
    text = "\n".join(
        [
            "# Page",
            "```sh",
            "echo not marked",
            "```",
            "<!-- runs: fleet -->",
            "```sh",
            "ctl status",
            "ctl subjects",
            "```",
            "",
            "<!-- runs: sidecar -->",
            "```sh",
            "sbx true",
            "```",
        ]
    )
    blocks = rp.extract(text, "p.md")
    assert [(b.profile, b.line, b.code) for b in blocks] == [
        ("fleet", 6, "ctl status\nctl subjects\n"),
        ("sidecar", 12, "sbx true\n"),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "<!-- runs: fleet -->\n\n```sh\nctl status\n```\n",  # not immediately followed by the fence
        "<!-- runs: fleet -->\n```bash\nctl status\n```\n",  # not an sh block
        "<!-- runs: fleet -->\n```sh\nctl status\n",  # never closed
        "<!-- runs: flet -->\n```sh\nctl status\n```\n",  # unknown profile
        "<!-- runs fleet -->\n```sh\nctl status\n```\n",  # malformed marker
        "<!-- runs: fleet -->\n```sh\n\n```\n",  # empty
    ],
)
def test_the_extractor_refuses_a_malformed_block(text: str) -> None:
    rp = runner()
    with pytest.raises(rp.PageError):
        rp.extract(text, "p.md")


def test_the_script_defines_the_shell_names_before_the_blocks() -> None:
    rp = runner()
    blocks = rp.extract("<!-- runs: fleet -->\n```sh\nctl status\n```\n", "p.md")
    script = rp.script(blocks, "fleet")
    assert script.startswith("set -euo pipefail")
    for name in ("ctl()", "pod()", "sb2()", "sb3()", "logs()"):
        assert name in script
    assert script.index("ctl()") < script.index("ctl status")
    assert "sbx()" in rp.script(blocks, "sidecar")


def test_the_smoke_scripts_run_the_pages() -> None:
    assert "run_pages.py --profile fleet" in (ROOT / "scripts" / "smoke-fleet.sh").read_text()
    assert "run_pages.py --profile sidecar" in (ROOT / "scripts" / "smoke-sidecar.sh").read_text()
