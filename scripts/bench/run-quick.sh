#!/usr/bin/env bash
# Every benchmark in scripts/bench/ with --quick (CI-sized, < 60 s each on a 2-core VM). The run
# FAILS when a benchmark cannot complete (a crash, a failed sanity check, any non-zero exit),
# when a CI guard trips (exit 3: bench_fleet's update rate or SET_BINDING scaling, README "CI
# guards") or when one leaves a namespace behind; a MISSED target does not fail it. Each benchmark builds its own
# throwaway namespaces and removes them, also on failure; nothing touches the root namespace.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "$(id -u)" -ne 0 ]; then echo "bench: needs root (network namespaces, nftables)" >&2; exit 1; fi
scripts/install.sh >/dev/null || { echo "bench: install failed" >&2; exit 1; }

PASS=0; FAIL=0
LOGS=$(mktemp -d /tmp/egbench-quick.XXXXXX)
trap 'rm -rf "$LOGS"' EXIT
for b in fleet dns mitm mitm_placement vault fleet_levers fleet_ab relay_ceiling request_rules; do
  script="scripts/bench/bench_$b.py"; [ -f "$script" ] || script="scripts/bench/$b.py"
  # fleet_ab against HEAD: the committed tree and the working tree side by side (identical in
  # CI, so its two columns check that the harness measures alike).
  extra=(); [ "$b" = fleet_ab ] && extra=(--baseline HEAD)
  t0=$(date +%s)
  # SIGTERM on overrun: the benchmark cleans up on it (SIGKILL 30 s later only if it hangs).
  timeout --kill-after=30 240 .venv/bin/python "$script" --quick "${extra[@]}" >"$LOGS/$b.out" 2>"$LOGS/$b.err"
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  base=$(grep -oE 'namespaces egb[a-z]+[0-9]+-' "$LOGS/$b.err" | head -1 | sed 's/^namespaces //')
  left=""
  if [ -n "$base" ]; then left=$(ip netns list | awk '{print $1}' | grep -F -- "$base" || true); fi
  cat "$LOGS/$b.out"
  if [ $rc -eq 0 ] && [ -z "$left" ]; then
    PASS=$((PASS + 1)); echo "PASS  $script --quick (${dt}s)"
  else
    FAIL=$((FAIL + 1))
    echo "--- $script stderr (tail) ---"; grep -v '^{' "$LOGS/$b.err" | tail -25
    [ -n "$left" ] && echo "left behind: $left"
    echo "FAIL  $script --quick (rc=$rc, ${dt}s)"
  fi
done
echo "bench: $PASS passed, $FAIL failed"
[ $FAIL -eq 0 ]
