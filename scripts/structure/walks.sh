#!/usr/bin/env bash
# Issue 24's walk table: packages, modules and functions one SET_BINDING, one data-plane-ready
# hook and one DNS answer pass through in a real fleet daemon, for two trees side by side.
#   scripts/structure/walks.sh BEFORE_TREE [AFTER_TREE] [walk.py options]
# BEFORE_TREE: e.g. `git worktree add --detach /tmp/before 20558a8 && (cd /tmp/before && scripts/install.sh)`.
# Needs root; builds and removes its own egwalk<pid>-* namespaces. Output in a temporary directory.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BEFORE=${1:?usage: walks.sh BEFORE_TREE [AFTER_TREE]}; shift
AFTER=$(cd "$HERE/../.." && pwd)
if [ $# -gt 0 ] && [ -d "$1" ]; then AFTER=$1; shift; fi
OUT=$(mktemp -d /tmp/egwalk.XXXXXX)
python3 "$HERE/walk.py" "$BEFORE" "$OUT/before" "$@"
python3 "$HERE/walk.py" "$AFTER" "$OUT/after" "$@"
python3 "$HERE/count.py" "$OUT/before/raw.json" "$OUT/after/raw.json" --lists | tee "$OUT/table.txt"
echo "walks: $OUT/table.txt"
