"""The docs site (mkdocs.yml, issue 27 item 5) is built by scripts/docs/build-site.sh with
`mkdocs build --strict` in CI: these check, without mkdocs, that the configuration keeps the
strictness that makes a broken link or anchor fail the build, and that every page of the start,
how-to and reference sections is reachable from the navigation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

ROOT = Path(__file__).resolve().parents[2]


def config() -> dict[str, Any]:
    loaded = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def nav_files(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [f for item in nav for f in nav_files(item)]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in nav_files(value)]
    return []


def test_the_build_is_strict_about_links_and_anchors() -> None:
    cfg = config()
    assert cfg["strict"] is True
    assert cfg["docs_dir"] == "docs"
    links = cfg["validation"]["links"]
    assert links["not_found"] == "warn" and links["anchors"] == "warn"  # --strict makes them fatal
    assert cfg["validation"]["nav"]["not_found"] == "warn"
    assert "--strict" in (ROOT / "scripts" / "docs" / "build-site.sh").read_text()
    assert "scripts/docs/build-site.sh" in (ROOT / ".ci" / "run").read_text()


def test_every_start_howto_and_reference_page_is_in_the_nav() -> None:
    listed = set(nav_files(config()["nav"]))
    for section in ("start", "howto", "reference"):
        for page in (ROOT / "docs" / section).glob("*.md"):
            assert f"{section}/{page.name}" in listed, (
                f"docs/{section}/{page.name} is not in mkdocs.yml's nav"
            )
    assert "index.md" in listed


def test_the_docs_lock_pins_by_hash() -> None:
    lock = (ROOT / "requirements-docs.lock").read_text()
    assert "mkdocs==" in lock
    pinned = [line for line in lock.splitlines() if line and line[0].isalpha()]
    assert pinned and all("==" in line for line in pinned)
    assert lock.count("--hash=sha256:") >= len(pinned)
