"""Citations of the documentation resolve.

* The code cites the specification that lives in the tree (docs/reference/behaviour.md,
  docs/reference/actions-protocol.md), never the out-of-tree files it was first written against
  (their upper-case titles, with or without ``.md``, or their out-of-tree directory). The
  patterns are assembled from pieces so this file does not match itself.
* Every ``docs/...`` path that code, tests, scripts, deploy files or CI name exists.
* Every ``§N.M`` that a citation attaches to a docs page (``docs/reference/behaviour.md §14.1``,
  ``docs/reference/actions-protocol.md §1 and §1.1``) is a numbered heading of that page; this holds
  in the README and the docs pages too.
* A bare ``§N.M`` in code, tests or scripts (not an RFC's) is a numbered heading of the behaviour
  or the actions-protocol page: those two share one numbering.
"""

from __future__ import annotations

import re
from pathlib import Path

_OLD_BEHAVIOUR = "BEHAV" + "IOUR"
_OLD_INTERFACE = "INTER" + "FACE"
_OLD_DIRECTORY = "shared" + "/spec"
_OLD_CITATION = re.compile(rf"\b(?:{_OLD_BEHAVIOUR}|{_OLD_INTERFACE})\b|{re.escape(_OLD_DIRECTORY)}")

#: A docs path as text: ``docs/`` then path characters, ending on a word character.
_DOCS_PATH = re.compile(r"(?<![\w./-])(docs/[\w./-]*\w)")
#: A docs page followed by one or more section numbers ("§10, §16", "§1 and §1.1", "§14.3)").
_SECTION_CITATION = re.compile(
    r"(?<![\w./-])(docs/[\w./-]+\.md)((?:[\s,;()]|and|or|\"[^\"\n]{0,40}\")*(?:§\d+(?:\.\d+)*(?:[\s,;]|and|or)*)+)"
)
_SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
#: A section number not preceded by "RFC <number> " (those are the RFCs' own).
_BARE_SECTION = re.compile(r"(?<![\w.])§(\d+(?:\.\d+)*)")
_RFC_BEFORE = re.compile(r"RFC \d+ $")
_HEADING_SECTION = re.compile(r"^#+ §(\d+(?:\.\d+)*)\b", re.MULTILINE)
_NUMBERED_PAGES = ("docs/reference/behaviour.md", "docs/reference/actions-protocol.md")

_SCANNED = ("egressd", "tests", "scripts", "deploy", ".ci", "pyproject.toml")
_SKIPPED_DIRS = frozenset({"__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".venv"})
_MAX_BYTES = 8 * 1024 * 1024


def _repo_root() -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "egressd").is_dir():
            return parent
    raise AssertionError(f"no repository root above {here}")


def _texts(root: Path, tops: tuple[str, ...]) -> list[tuple[Path, str]]:
    me = Path(__file__).resolve()
    out: list[tuple[Path, str]] = []
    for top in tops:
        start = root / top
        paths = [start] if start.is_file() else sorted(start.rglob("*"))
        for path in paths:
            if not path.is_file() or path.resolve() == me:
                continue
            if _SKIPPED_DIRS.intersection(path.relative_to(root).parts):
                continue
            if path.stat().st_size > _MAX_BYTES:
                continue
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue  # binary
            out.append((path, text))
    return out


def _code(root: Path) -> list[tuple[Path, str]]:
    return _texts(root, _SCANNED)


def _prose(root: Path) -> list[tuple[Path, str]]:
    return _texts(root, ("README.md",)) + [
        (p, p.read_text(encoding="utf-8")) for p in sorted((root / "docs").rglob("*.md"))
    ]


def _sections(root: Path, page: str) -> set[str]:
    return set(_HEADING_SECTION.findall((root / page).read_text(encoding="utf-8")))


def _where(root: Path, path: Path, text: str, offset: int) -> str:
    return f"{path.relative_to(root)}:{text.count(chr(10), 0, offset) + 1}"


def test_no_citation_of_the_out_of_tree_specification() -> None:
    root = _repo_root()
    found = [
        f"{_where(root, path, text, m.start())}: {m.group(0)}"
        for path, text in _code(root)
        for m in _OLD_CITATION.finditer(text)
    ]
    assert not found, (
        "cite docs/reference/behaviour.md or docs/reference/actions-protocol.md (same section "
        "numbers) instead of the out-of-tree specification:\n" + "\n".join(found)
    )


def test_the_in_tree_specification_exists() -> None:
    root = _repo_root()
    for name in _NUMBERED_PAGES:
        assert (root / name).is_file(), name
        assert _sections(root, name), f"{name} has no numbered (§) headings"


def test_every_cited_docs_path_exists() -> None:
    root = _repo_root()
    missing = [
        f"{_where(root, path, text, m.start())}: {m.group(1)}"
        for path, text in _code(root)
        for m in _DOCS_PATH.finditer(text)
        if not (root / m.group(1)).exists()
    ]
    assert not missing, "cited docs paths that do not exist:\n" + "\n".join(missing)


def test_every_cited_section_exists_in_the_cited_page() -> None:
    root = _repo_root()
    known: dict[str, set[str]] = {}
    bad: list[str] = []
    for path, text in _code(root) + _prose(root):
        for m in _SECTION_CITATION.finditer(text):
            page = m.group(1)
            if not (root / page).is_file():
                bad.append(f"{_where(root, path, text, m.start())}: {page} does not exist")
                continue
            have = known.setdefault(page, _sections(root, page))
            for number in _SECTION.findall(m.group(2)):
                if number not in have:
                    bad.append(f"{_where(root, path, text, m.start())}: {page} has no §{number}")
    assert not bad, "section citations that do not resolve:\n" + "\n".join(bad)


def test_every_bare_section_number_in_code_exists() -> None:
    root = _repo_root()
    have = set().union(*(_sections(root, page) for page in _NUMBERED_PAGES))
    bad = [
        f"{_where(root, path, text, m.start())}: §{m.group(1)}"
        for path, text in _code(root)
        for m in _BARE_SECTION.finditer(text)
        if m.group(1) not in have and not _RFC_BEFORE.search(text, max(0, m.start() - 12), m.start())
    ]
    assert not bad, "section numbers that neither numbered page has:\n" + "\n".join(bad)


def test_the_checks_catch_a_bad_citation() -> None:
    text = "see docs/reference/behaviour.md §14.1 and §99.9; docs/nowhere.md"
    m = _SECTION_CITATION.search(text)
    assert m is not None and _SECTION.findall(m.group(2)) == ["14.1", "99.9"]
    assert [p.group(1) for p in _DOCS_PATH.finditer(text)] == ["docs/reference/behaviour.md", "docs/nowhere.md"]
    rfc = "RFC 9112 §3.2 and §7"
    bare = [m.group(1) for m in _BARE_SECTION.finditer(rfc) if not _RFC_BEFORE.search(rfc, 0, m.start())]
    assert bare == ["7"]
