#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml at the repository root, pages under docs/) into
# site/ with `mkdocs build --strict`: a broken link or anchor, or a nav entry naming no page,
# fails the build (mkdocs.yml's `validation:` makes those warnings, --strict makes warnings
# fatal). mkdocs comes from requirements-docs.lock (pinned by sha256) in a venv of its own,
# .venv-docs, so that its dependencies never move egressd's. Safe to re-run; fast when done.
#
#   scripts/docs/build-site.sh            # build into site/
#   scripts/docs/build-site.sh serve      # preview on 127.0.0.1:8000 (mkdocs serve)
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts/install.sh >/dev/null  # .venv, whose interpreter the docs venv is made from

stamp=.venv-docs/.egressd-docs-installed
want=$(sha256sum requirements-docs.lock | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -x .venv-docs/bin/mkdocs ]; then
  base=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
  rm -rf .venv-docs
  "$base" -m venv .venv-docs
  .venv-docs/bin/python -m pip install -q --require-hashes -r requirements-docs.lock
  echo "$want" >"$stamp"
fi
if [ "${1:-build}" = serve ]; then
  exec .venv-docs/bin/mkdocs serve --strict
fi
.venv-docs/bin/mkdocs build --strict --clean --site-dir site
echo "build-site: ok (site/, $(find site -name '*.html' | wc -l) pages)"
