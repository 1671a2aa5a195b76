#!/usr/bin/env python3
"""Run the commands of the start and how-to pages (docs/start/, docs/howto/) against a running
egressd, so that a page cannot drift from the product (issue 27 item 4).

A runnable block is a fenced block whose info string is ``sh`` and whose opening fence is
IMMEDIATELY preceded by the line ``<!-- runs: fleet -->`` or ``<!-- runs: sidecar -->``. The
smoke scripts call this once their own checks are done, with the topology and the daemon still
up (scripts/smoke-fleet.sh: ``--profile fleet``; scripts/smoke-sidecar.sh: ``--profile sidecar``),
and export what the prelude below needs. Each page's blocks run in order, in one bash process
per page (``set -euo pipefail``: the first failing command fails the page), in a scratch
working directory of its own, so a page may write ``policy.json`` and use it in a later block.

The shell names the pages use, and what they stand for in a real deployment:

    fleet    ctl   egressctl in the pod's network namespace (kubectl exec POD -c egressd -- egressctl)
             pod   any command in the pod's network namespace (nft, conntrack, curl to 127.0.0.1)
             sb2, sb3   a command inside sandbox 2 (10.203.0.12) or 3 (10.203.0.13); gateway 10.203.0.1
             logs  egressd's log (kubectl logs POD -c egressd)
    sidecar  sbx   a command inside the sandbox's namespace, where the app and egressd run
             TOKEN the API token (OPENSANDBOX_EGRESS_TOKEN)
             CA    the MITM CA certificate the app trusts (EGRESSD_MITM_CA_EXPORT_DIR/egressd-ca.pem)
             logs  egressd's log

    scripts/docs/run_pages.py --list                  # the runnable blocks, per page
    scripts/docs/run_pages.py --profile fleet [PAGE]  # run them (needs the smoke's variables)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE_DIRS = ("docs/start", "docs/howto")
PROFILES = ("fleet", "sidecar")
MARKER = re.compile(r"^<!-- runs: (?P<profile>[a-z]+) -->\s*$")
FENCE = re.compile(r"^(?P<fence>```+|~~~+)\s*(?P<info>[^\s`]*)")

#: Pages where running makes no sense (figures and sizing advice only): the unit test exempts them.
NOT_RUNNABLE = {"docs/howto/run-at-scale.md": "sizing figures and limits; nothing to type"}

PRELUDE = {
    # The variables come from scripts/smoke-fleet.sh (see its "docs pages" section).
    "fleet": r"""
ctl() { ip netns exec "$EGDOC_POD" "$EGDOC_ROOT/.venv/bin/egressctl" --addr "127.0.0.1:$EGDOC_PORT" "$@"; }
pod() { ip netns exec "$EGDOC_POD" "$@"; }
sb2() { ip netns exec "$EGDOC_PREFIX-sb2" "$@"; }
sb3() { ip netns exec "$EGDOC_PREFIX-sb3" "$@"; }
logs() { cat "$EGDOC_LOG"; }
""",
    "sidecar": r"""
sbx() { ip netns exec "$EGDOC_SANDBOX" "$@"; }
TOKEN="$EGDOC_TOKEN"
CA="$EGDOC_CA"
logs() { cat "$EGDOC_LOG"; }
""",
}


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    profile: str
    code: str


class PageError(ValueError):
    pass


def extract(text: str, page: str = "<page>") -> list[Block]:
    """The runnable blocks of one page, in order. A marker that is not followed at once by an
    ``sh`` fence, or names an unknown profile, is an error (a typo must not silently skip)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i])
        if marker is None:
            if lines[i].lstrip().startswith("<!-- runs"):
                raise PageError(f"{page}:{i + 1}: malformed marker {lines[i]!r}")
            i += 1
            continue
        profile = marker["profile"]
        if profile not in PROFILES:
            raise PageError(f"{page}:{i + 1}: unknown profile {profile!r} (expected {', '.join(PROFILES)})")
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None or fence["info"] != "sh":
            raise PageError(f"{page}:{i + 1}: the marker must be followed at once by a ```sh block")
        body: list[str] = []
        j = i + 2
        while j < len(lines) and not lines[j].startswith(fence["fence"]):
            body.append(lines[j])
            j += 1
        if j == len(lines):
            raise PageError(f"{page}:{i + 2}: the block is not closed")
        if not any(line.strip() for line in body):
            raise PageError(f"{page}:{i + 2}: empty runnable block")
        blocks.append(Block(page, i + 2, profile, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def pages() -> list[Path]:
    return [p for d in PAGE_DIRS for p in sorted((ROOT / d).glob("*.md"))]


def all_blocks() -> dict[str, list[Block]]:
    out = {}
    for path in pages():
        rel = str(path.relative_to(ROOT))
        out[rel] = extract(path.read_text(), rel)
    return out


def script(blocks: list[Block], profile: str) -> str:
    """One bash script for a page: the prelude, then each block, announced on stderr."""
    parts = ["set -euo pipefail", PRELUDE[profile]]
    for b in blocks:
        parts.append(f"echo '--- {b.page}:{b.line}' >&2")
        parts.append(b.code)
    return "\n".join(parts)


def run_page(page: str, blocks: list[Block], profile: str, verbose: bool) -> bool:
    with tempfile.TemporaryDirectory(prefix="egressd-docs.") as cwd:
        proc = subprocess.run(
            ["bash", "-c", script(blocks, profile)],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=300,
            env=os.environ.copy(),
            check=False,
        )
    ok = proc.returncode == 0
    print(f"{'PASS' if ok else 'FAIL'}  docs: {page} ({len(blocks)} runnable blocks, {profile})")
    if not ok or verbose:
        # The last "--- page:line" marker on stderr names the block that failed.
        for stream in (proc.stdout, proc.stderr):
            for line in stream.rstrip("\n").splitlines()[-40:]:
                print(f"      {line}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--profile", choices=PROFILES, help="run the blocks of this profile")
    parser.add_argument("--list", action="store_true", help="list the runnable blocks and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every block's output")
    parser.add_argument("--after-page", metavar="CMD", help="shell command run after each page (clean-up)")
    parser.add_argument("page", nargs="*", help="only these pages (paths relative to the repository root)")
    args = parser.parse_args(argv)
    try:
        found = all_blocks()
    except PageError as exc:
        print(f"run_pages: {exc}", file=sys.stderr)
        return 2
    if args.page:
        found = {p: b for p, b in found.items() if p in args.page}
    if args.list:
        for page, blocks in found.items():
            print(f"{page}: " + ", ".join(f"{b.profile}@{b.line}" for b in blocks))
        return 0
    if args.profile is None:
        parser.error("--profile or --list is required")
    failed = 0
    for page, blocks in found.items():
        mine = [b for b in blocks if b.profile == args.profile]
        if not mine:
            continue
        if not run_page(page, mine, args.profile, args.verbose):
            failed += 1
        if args.after_page:
            subprocess.run(["bash", "-c", args.after_page], capture_output=True, check=False)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
