"""Golden digests of a pure generator's output, for restructurings that must not change it.

A test module defines ``corpus()`` (case name -> generated text, for a fixed set of inputs) and
keeps, next to itself, one SHA-256 per case (``<digest>  <case>`` lines). :func:`changed_cases`
names the cases whose text differs; :func:`main` is the module's command line: without
arguments it rewrites the digests (a deliberate change of the output), with ``--full OUT`` it
writes the full texts, to diff between two commits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


def digests(cases: dict[str, str]) -> str:
    return "".join(f"{hashlib.sha256(text.encode()).hexdigest()}  {key}\n" for key, text in cases.items())


def full_text(cases: dict[str, str]) -> str:
    return "".join(f"=== {key}\n{text.rstrip(chr(10))}\n" for key, text in cases.items())


def changed_cases(golden: Path, cases: dict[str, str]) -> list[str]:
    """The cases missing, added or changed against the digests in ``golden``, sorted."""
    expected = dict(_parse(golden.read_text()))
    got = dict(_parse(digests(cases)))
    return sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))


def main(golden: Path, corpus: Callable[[], dict[str, str]], argv: Sequence[str]) -> None:
    if list(argv[:1]) == ["--full"]:
        Path(argv[1]).write_text(full_text(corpus()))
    else:
        golden.write_text(digests(corpus()))


def _parse(text: str) -> Iterator[tuple[str, str]]:
    for line in text.splitlines():
        digest, key = line.split("  ", 1)
        yield key, digest
