#!/usr/bin/env bash
# Re-resolves requirements.lock (runtime + dev extras + the build backend, every file pinned by
# sha256) from pyproject.toml, and requirements-docs.lock (the docs site's mkdocs) from
# requirements-docs.in, for Python 3.12 on Linux x86_64, the platform scripts/install.sh
# installs on. Run it after changing a dependency in pyproject.toml (pins that still fit are
# kept), or as `scripts/refresh-lock.sh --upgrade` to take the newest releases (or
# `--upgrade-package NAME`); commit the lock with the change. Arguments go to pip-compile.
# pip-tools runs from a throwaway venv, never from .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

# The interpreter of .venv (made by install.sh) unless told otherwise: the lock is for 3.12.
py=${EGRESSD_PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3.12 )}
"$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' \
  || { echo "refresh-lock: $py is not Python 3.12 (set EGRESSD_PYTHON)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --upgrade pip pip-tools
# --all-build-deps + --allow-unsafe: setuptools joins the lock, so that install.sh can build
# egressd without fetching an unpinned backend. The index options stay out of the file: each
# machine's pip configuration says where packages come from, the hashes say what they are.
"$tmp/venv/bin/pip-compile" --quiet --generate-hashes --allow-unsafe --all-build-deps --strip-extras \
  --no-emit-index-url --no-emit-find-links --extra dev -o requirements.lock "$@" pyproject.toml
echo "refresh-lock: requirements.lock written ($(grep -c '^[a-z]' requirements.lock) packages)"
# The docs site's builder (mkdocs) has a lock of its own, installed into .venv-docs by
# scripts/docs/build-site.sh, never into .venv: its pins need not agree with egressd's.
"$tmp/venv/bin/pip-compile" --quiet --generate-hashes --allow-unsafe --strip-extras \
  --no-emit-index-url --no-emit-find-links -o requirements-docs.lock "$@" requirements-docs.in
echo "refresh-lock: requirements-docs.lock written ($(grep -c '^[a-z]' requirements-docs.lock) packages)"
