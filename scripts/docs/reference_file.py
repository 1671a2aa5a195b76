"""The command line both reference generators share: write the page, or (--check) say it is stale."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_or_check(
    render: Callable[[], str], reference: Path, generator: str, description: str | None, argv: list[str] | None
) -> int:
    """Regenerate ``reference`` from ``render()``; with ``--check``, exit 1 when it differs."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    args = parser.parse_args(argv)
    text = render()
    current = reference.read_text() if reference.exists() else None
    if current == text:
        return 0
    if args.check:
        print(f"stale (run {Path(generator).resolve().relative_to(ROOT)}): {reference.relative_to(ROOT)}", file=sys.stderr)
        return 1
    reference.parent.mkdir(parents=True, exist_ok=True)
    reference.write_text(text)
    print(f"wrote {reference.relative_to(ROOT)}")
    return 0
