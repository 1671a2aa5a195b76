#!/usr/bin/env bash
# The whole test suite: lint, types, unit tests and the kernel tests in throwaway network
# namespaces. Installs what is missing first. Kernel tests need root; with CI=true (or
# EGRESS_REQUIRE_NETNS=1) a missing privilege or tool fails the run instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
if [ "${CI:-}" = "true" ]; then export EGRESS_REQUIRE_NETNS=1; fi

.venv/bin/ruff check egressd tests scripts
.venv/bin/mypy
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "test: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit $rc
