"""The code cites the specification that lives in the tree (docs/behaviour.md, docs/protocol.md),
never the out-of-tree files it was first written against.

Fails on any file under egressd/, tests/ or scripts/ that names the old specification files
(by their upper-case titles, with or without ``.md``) or their out-of-tree directory. The
patterns are assembled from pieces so this file does not match itself.
"""

from __future__ import annotations

import re
from pathlib import Path

_OLD_BEHAVIOUR = "BEHAV" + "IOUR"
_OLD_INTERFACE = "INTER" + "FACE"
_OLD_DIRECTORY = "shared" + "/spec"
_CITATION = re.compile(rf"\b(?:{_OLD_BEHAVIOUR}|{_OLD_INTERFACE})\b|{re.escape(_OLD_DIRECTORY)}")

_SCANNED = ("egressd", "tests", "scripts")
_SKIPPED_DIRS = frozenset({"__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"})
_MAX_BYTES = 8 * 1024 * 1024


def _repo_root() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "egressd").is_dir():
            return parent
    raise AssertionError(f"no repository root above {here}")


def _text_files(root: Path) -> list[Path]:
    me = Path(__file__).resolve()
    out: list[Path] = []
    for top in _SCANNED:
        for path in sorted((root / top).rglob("*")):
            if not path.is_file() or path.resolve() == me:
                continue
            if _SKIPPED_DIRS.intersection(path.relative_to(root).parts):
                continue
            if path.stat().st_size > _MAX_BYTES:
                continue
            out.append(path)
    return out


def _citations(root: Path) -> list[str]:
    found: list[str] = []
    for path in _text_files(root):
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue  # binary
        for lineno, line in enumerate(text.splitlines(), start=1):
            if _CITATION.search(line):
                found.append(f"{path.relative_to(root)}:{lineno}: {line.strip()[:120]}")
    return found


def test_no_citation_of_the_out_of_tree_specification() -> None:
    found = _citations(_repo_root())
    assert not found, (
        "cite docs/behaviour.md or docs/protocol.md (same section numbers) instead of the "
        "out-of-tree specification:\n" + "\n".join(found)
    )


def test_the_in_tree_specification_exists() -> None:
    root = _repo_root()
    for name in ("docs/behaviour.md", "docs/protocol.md"):
        assert (root / name).is_file(), name
