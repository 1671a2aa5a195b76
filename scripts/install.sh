#!/usr/bin/env bash
# Installs what is missing: Debian packages the daemon and its tests need, then .venv at the
# repository root with egressd (editable) and its dev tools. Safe to re-run; fast when done.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(nftables libnftables1 iproute2 conntrack bind9-dnsutils curl openssl procps util-linux)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install: missing Debian packages (${missing[*]}); run as root" >&2
    exit 1
  fi
  echo "install: apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

find_python() {
  local c v
  for c in "${EGRESSD_PYTHON:-}" python3.13 python3.12 \
           "$(command -v pyenv >/dev/null 2>&1 && pyenv prefix 3.12.1 2>/dev/null)/bin/python3" \
           /root/.pyenv/versions/3.12*/bin/python3 /root/.pyenv/versions/3.13*/bin/python3 python3; do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
    v=$("$c" -c 'import sys; print(int(sys.version_info >= (3, 12)))' 2>/dev/null || echo 0)
    if [ "$v" = 1 ]; then echo "$c"; return 0; fi
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
  py=$(find_python) || { echo "install: no Python >= 3.12 found (pyenv versions, or set EGRESSD_PYTHON)" >&2; exit 1; }
  echo "install: creating .venv with $py"
  rm -rf .venv
  "$py" -m venv .venv
fi

# requirements.lock pins every package (runtime, dev extras and the setuptools that builds
# egressd) by version and sha256, for Python 3.12 on Linux x86_64. After changing a dependency
# in pyproject.toml, refresh it with `scripts/refresh-lock.sh` (`--upgrade` for newer releases)
# and commit both. The stamp holds the digest of the lock and pyproject.toml: a change to
# either re-runs the install, whatever the files' times.
stamp=.venv/.egressd-installed
want=$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)
# The sidecar compatibility tests need the OpenSandbox SDK and schemathesis (dev extras).
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -x .venv/bin/egressd ] \
   || ! .venv/bin/python -c 'import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ("opensandbox", "schemathesis"))))' 2>/dev/null; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q --require-hashes -r requirements.lock
  # egressd itself, without resolving anything more; the lock's setuptools builds it (no
  # isolated build env fetching an unpinned backend).
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  echo "$want" >"$stamp"
fi
echo "install: ok ($(.venv/bin/python --version), $(nft --version))"
