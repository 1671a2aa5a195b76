#!/usr/bin/env bash
# egressd end to end for host-uid sandboxes (docs/reference/behaviour.md §17) on a throwaway namespace pair:
#
#   host (egressd, and the sandboxes: processes of uids 100001, 100002, ...) --veth-- upstream (10.204.0.2-9)
#
# The sandboxes share egressd's network namespace and differ only by uid: each check runs a
# real process there with `setpriv --reuid=<uid> --regid=<uid> --clear-groups` (dig, curl).
# egressd is driven like a Fastlet would drive it (SET_BINDING with attachment.process.uid,
# data-plane-ready, REMOVE_BINDING, kill -9 + replay); a vault is pushed over the proxy route
# and the MITM injects for the bound uid only. One line per check, then "N passed, M failed".
# Exit 0 only when every check passed. Everything is removed on any exit.
#
# The output hook egressd installs polices the uid range of the namespace it runs in: it runs
# in the throwaway "host" namespace here, never in the root namespace. Nothing is created in
# the root namespace: the veth pair is made with both ends inside our namespaces.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ "$(id -u)" -ne 0 ]; then echo "smoke-uid: needs root (network namespaces, nftables, setpriv)" >&2; exit 1; fi
command -v setpriv >/dev/null || { echo "smoke-uid: setpriv (util-linux) is missing" >&2; exit 1; }
scripts/install.sh >/dev/null || { echo "smoke-uid: install failed" >&2; exit 1; }

P="egsmu$$"
HOST="$P-host"; UP="$P-up"
WORK=$(mktemp -d /tmp/egressd-smoke-uid.XXXXXX)
PORT=18080
TABLE="smoke-uid"
UA=100001; UB=100002; UC=100003   # two sandboxes and an in-range uid that is none
PIDS=()
PASS=0; FAIL=0

cleanup() {
  trap '' INT TERM  # a second Ctrl-C must not cut the cleanup short
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null; done
  sleep 0.2
  for ns in "$HOST" "$UP"; do
    if ip netns list | grep -qw "$ns"; then
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
      ip netns del "$ns" 2>/dev/null
    fi
  done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

check() {  # check "description" command...
  local what=$1; shift
  if "$@" >/dev/null 2>&1; then PASS=$((PASS + 1)); echo "PASS  $what"
  else FAIL=$((FAIL + 1)); echo "FAIL  $what"; fi
}
not() { ! "$@"; }

inns() { ip netns exec "$@"; }
as() {  # as UID command...: a process of that uid (and group) in the host namespace
  local uid=$1; shift
  ip netns exec "$HOST" setpriv --reuid="$uid" --regid="$uid" --clear-groups "$@"
}

# ---- topology ---------------------------------------------------------------------------------
for ns in "$HOST" "$UP"; do ip netns add "$ns"; inns "$ns" ip link set lo up; done
ip link add uplink netns "$HOST" type veth peer name eth0 netns "$UP"
inns "$HOST" ip addr add 10.204.0.1/24 dev uplink; inns "$HOST" ip link set uplink up
for i in 2 3 4 5 6 7 8 9; do inns "$UP" ip addr add "10.204.0.$i/24" dev eth0; done
inns "$UP" ip link set eth0 up

chmod 755 "$WORK"  # the sandbox uids read the MITM CA certificate from here
cat > "$WORK/zone.json" <<'EOF'
{"records": [
  {"name": "api.allowed.test", "type": "A", "value": "10.204.0.2", "ttl": 30},
  {"name": "other.test", "type": "A", "value": "10.204.0.3", "ttl": 30},
  {"name": "exfil.test", "type": "A", "value": "10.204.0.4", "ttl": 30}
]}
EOF
ip netns exec "$UP" "$ROOT/.venv/bin/python" scripts/fleet_upstream.py --http-ports 80 --zone "$WORK/zone.json" \
  --https-ports 443 --tls-dir "$WORK/tls" --tls-ips 10.204.0.2,10.204.0.3,10.204.0.4 \
  --log "$WORK/upstream.jsonl" > "$WORK/upstream.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do grep -q ready "$WORK/upstream.out" 2>/dev/null && break; sleep 0.1; done
mkdir -p "$WORK/rules"

start_egressd() {
  # ip netns exec directly (not the inns function): $! must be egressd's own pid.
  ip netns exec "$HOST" env OPENSANDBOX_EGRESS_PROFILE=fleet OPENSANDBOX_EGRESS_HTTP_ADDR="127.0.0.1:$PORT" \
    EGRESSD_NFT_TABLE="$TABLE" EGRESSD_ALWAYS_RULES_DIR="$WORK/rules" EGRESSD_LOG_FORMAT=json \
    OPENSANDBOX_EGRESS_DNS_UPSTREAM=10.204.0.2:53 OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT=2 \
    OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT=1 OPENSANDBOX_EGRESS_MITMPROXY_PORT=18081 \
    OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR="$WORK/tls/trust" EGRESSD_MITM_CONFDIR="$WORK/mitm" \
    OPENSANDBOX_CREDENTIAL_PROXY_SOCKET="$WORK/run/active.sock" EGRESSD_UID_MAX_SUBJECTS=16 \
    "$ROOT/.venv/bin/egressd" >> "$WORK/egressd.log" 2>&1 &
  EGRESSD_PID=$!
  disown "$EGRESSD_PID"  # no "Killed" job notice when the kill -9 step or the cleanup ends it
  PIDS+=("$EGRESSD_PID")
  for _ in $(seq 1 300); do
    inns "$HOST" curl -s -m 1 "127.0.0.1:$PORT/healthz" 2>/dev/null | grep -q ok && return 0
    sleep 0.1
  done
  return 1
}
ctl() { inns "$HOST" "$ROOT/.venv/bin/egressctl" --addr "127.0.0.1:$PORT" "$@"; }
bind() {  # bind NAME UID POLICY_JSON [extra egressctl args]
  local name=$1 uid=$2 pol=$3; shift 3
  ctl send set-binding --uid "$name" --host-uid "$uid" --policy "$pol" "$@"
}
ready() { ctl send hook data-plane-ready --uid "$1" "${@:2}"; }
# DNS to port 53 of ANY address is redirected to the uid's own port: 10.204.0.9 runs no DNS
# server at all, so an answer proves the redirect (the proxy forwards to 10.204.0.2).
resolves() { as "$1" dig +short +time=2 +tries=1 @10.204.0.9 "$2" | grep -q "${3:-.}"; }
nxdomain() { as "$1" dig +time=2 +tries=1 @10.204.0.9 "$2" | grep -q "status: NXDOMAIN"; }
# reaches UID ADDR [HOST]: with the name check (EGRESSD_NAME_CHECK, on with the MITM) a learned
# address answers only a Host that taught it.
reaches() { [ "$(as "$1" curl -s -o /dev/null -w '%{http_code}' --connect-timeout 1 -m 2 ${3:+-H "Host: $3"} "http://$2/smoke")" = 200 ]; }
upstream_saw() { grep -q "\"dns\": \"$1\"" "$WORK/upstream.jsonl"; }
https_get() {  # https_get UID HOST IP PATH: the upstream's JSON echo (what arrived) on stdout
  as "$1" curl -s -m 5 --cacert "$WORK/ca.pem" --resolve "$2:443:$3" "https://$2$4"
}
seen() {  # the upstream's own base64 copy of what it received (the MITM redacts the echo's plain fields)
  "$ROOT/.venv/bin/python" -c 'import base64, json, sys; print(base64.b64decode(json.load(sys.stdin)["seen"]).decode())'
}
https_upstream_ca() {  # the same, trusting only the upstream's own CA (no vault: passed through)
  as "$1" curl -s -m 5 --cacert "$WORK/upstream-ca.pem" --resolve "$2:443:$3" "https://$2$4"
}
no_uid_objects() {  # no element of uid $1 and no object of subject $2 left in the table
  local out; out=$(inns "$HOST" nft list table inet "$TABLE") || return 1
  ! grep -q "$1" <<<"$out" && ! grep -q "s_$2" <<<"$out"
}

check "egressd starts in the host namespace and reports healthy" start_egressd
cp "$WORK/mitm/mitmproxy-ca-cert.pem" "$WORK/ca.pem" && chmod 644 "$WORK/ca.pem"
cp "$WORK/tls/ca.pem" "$WORK/upstream-ca.pem" && chmod 644 "$WORK/upstream-ca.pem"
ID1=$(inns "$HOST" curl -s "127.0.0.1:$PORT/_fastlet/v1/actions/status")

ALLOW_A='{"defaultAction":"deny","egress":[{"action":"allow","target":"*.allowed.test"}]}'
ALLOW_B='{"defaultAction":"deny","egress":[{"action":"allow","target":"other.test"}]}'

# ---- validation -------------------------------------------------------------------------------
check "a uid outside EGRESSD_UID_RANGE -> 400" bash -c "$(declare -f ctl inns); HOST=$HOST ROOT=$ROOT PORT=$PORT; ctl send set-binding --uid bad --host-uid 1000 --policy '{}' | grep -q '^400'"
check "egressd's own uid (root, outside the range) -> 400" bash -c "$(declare -f ctl inns); HOST=$HOST ROOT=$ROOT PORT=$PORT; ctl send set-binding --uid bad --host-uid 0 --policy '{}' | grep -q '^400'"

# ---- deny-first window ------------------------------------------------------------------------
check "SET_BINDING ua (uid $UA, names policy) -> 200" bind ua "$UA" "$ALLOW_A"
check "SET_BINDING ub (uid $UB, another policy) -> 200" bind ub "$UB" "$ALLOW_B"
check "a second subject for uid $UA -> 409" bash -c "$(declare -f ctl inns); HOST=$HOST ROOT=$ROOT PORT=$PORT; ctl send set-binding --uid dup --host-uid $UA --policy '{}' | grep -q '^409'"
check "deny-first: uid $UA cannot resolve before data-plane-ready" nxdomain "$UA" api.allowed.test
check "deny-first: uid $UA cannot connect yet" not reaches "$UA" 10.204.0.2
check "deny-first: the upstream never saw the early query" not upstream_saw api.allowed.test

# ---- activation -------------------------------------------------------------------------------
check "data-plane-ready ua -> 200" ready ua
check "data-plane-ready ub -> 200" ready ub
check "uid $UA resolves its allowed name (DNS to any address goes to its own port)" resolves "$UA" api.allowed.test 10.204.0.2
check "uid $UA connects to the address it learned" reaches "$UA" 10.204.0.2 api.allowed.test
check "uid $UA gets NXDOMAIN for uid $UB's name" nxdomain "$UA" other.test
check "uid $UA cannot reach uid $UB's address" not reaches "$UA" 10.204.0.3
check "uid $UB resolves its own name" resolves "$UB" other.test 10.204.0.3
check "uid $UB connects to its address" reaches "$UB" 10.204.0.3 other.test
check "uid $UB gets NXDOMAIN for uid $UA's name" nxdomain "$UB" api.allowed.test
check "uid $UB cannot use the address uid $UA learned" not reaches "$UB" 10.204.0.2
check "a denied name never reached the upstream" bash -c "$(declare -f as nxdomain); HOST=$HOST; nxdomain $UA exfil.test && ! grep -q '\"dns\": \"exfil.test\"' $WORK/upstream.jsonl"
check "uid $UC (in the range, no subject) gets NXDOMAIN" nxdomain "$UC" api.allowed.test
check "uid $UC reaches nothing" not reaches "$UC" 10.204.0.2
check "root (outside the range) is untouched: reaches both addresses" bash -c "$(declare -f inns); inns $HOST curl -s -o /dev/null -m 2 http://10.204.0.2/ && inns $HOST curl -s -o /dev/null -m 2 http://10.204.0.3/"
check "uid 1000 (outside the range) is untouched" reaches 1000 10.204.0.4
check "uid 1000's DNS is not redirected (10.204.0.9 has no DNS server)" not resolves 1000 api.allowed.test
check "uid $UA cannot reach egressd's actions API on loopback" not as "$UA" curl -s -o /dev/null --connect-timeout 1 -m 2 "http://127.0.0.1:$PORT/healthz"
check "uid $UA cannot ask another subject's DNS port directly" not as "$UA" dig +time=1 +tries=1 -p 16001 @127.0.0.1 other.test
SYSPY=$(PATH=/usr/bin:/bin command -v python3 || echo python3)  # one any uid may run (not a pyenv under /root)
check "uid $UA still reaches its own loopback services" bash -c "ip netns exec $HOST setpriv --reuid=$UA --regid=$UA --clear-groups $SYSPY -c 'import socket; s=socket.socket(); s.bind((\"127.0.0.1\", 0)); s.listen(); c=socket.create_connection(s.getsockname(), timeout=1)'"
check "egressctl subjects lists both uid subjects" bash -c "ip netns exec $HOST $ROOT/.venv/bin/egressctl --addr 127.0.0.1:$PORT subjects | grep -q uid:$UA && ip netns exec $HOST $ROOT/.venv/bin/egressctl --addr 127.0.0.1:$PORT subjects | grep -q uid:$UB"
check "egressctl explain uid:$UA api.allowed.test -> allow" bash -c "ip netns exec $HOST $ROOT/.venv/bin/egressctl --addr 127.0.0.1:$PORT explain uid:$UA api.allowed.test | grep -qi '^verdict *allow'"

# ---- vault and MITM ---------------------------------------------------------------------------
printf '%s' '{"credentials":[{"name":"k","source":{"type":"inline","value":"smoke-uid-secret"}}],"bindings":[{"name":"b","match":{"hosts":["api.allowed.test"]},"auth":{"type":"bearer","credential":"k"}}]}' > "$WORK/vault.json"
check "vault pushed over the proxy route for ua -> 201" ctl vault put --uid ua --file "$WORK/vault.json"
check "uid $UA's HTTPS call carries the injected credential upstream" bash -c "$(declare -f as https_get seen); HOST=$HOST WORK=$WORK ROOT=$ROOT; https_get $UA api.allowed.test 10.204.0.2 /v1/x | seen | grep -q 'Bearer smoke-uid-secret'"
uid_b_gets_nothing() { local out; out=$(https_upstream_ca "$UB" other.test 10.204.0.3 /v1/x); grep -q '"tls": true' <<<"$out" && ! grep -q smoke-uid-secret <<<"$out"; }
check "uid $UB's HTTPS call (no vault) is passed through: the upstream's certificate, no credential" uid_b_gets_nothing
check "uid $UB forging uid $UA's host gets no credential" not bash -c "$(declare -f as https_get https_upstream_ca); HOST=$HOST WORK=$WORK; https_get $UB api.allowed.test 10.204.0.2 /v1/x | grep -q smoke-uid-secret || https_upstream_ca $UB api.allowed.test 10.204.0.2 /v1/x | grep -q smoke-uid-secret"
check "the secret never reached the daemon's log" not grep -q smoke-uid-secret "$WORK/egressd.log"

# ---- removal, restart and replay --------------------------------------------------------------
check "REMOVE_BINDING ua -> 200" ctl send remove --uid ua
check "after removal uid $UA reaches nothing" not reaches "$UA" 10.204.0.2 api.allowed.test
check "after removal uid $UA's DNS is NXDOMAIN" nxdomain "$UA" api.allowed.test
check "after removal nothing of uid $UA is left in the table" no_uid_objects "$UA" ua
check "uid $UB keeps working after the removal" reaches "$UB" 10.204.0.3 other.test
kill -9 "$EGRESSD_PID" 2>/dev/null
for _ in $(seq 1 100); do kill -0 "$EGRESSD_PID" 2>/dev/null || break; sleep 0.05; done
check "with the daemon dead the kernel keeps enforcing" not reaches "$UC" 10.204.0.3
check "egressd restarts" start_egressd
ID2=$(inns "$HOST" curl -s "127.0.0.1:$PORT/_fastlet/v1/actions/status")
check "a restart gets a new instanceId" test "$ID1" != "$ID2"
check "after the restart uid $UB is an unknown uid: reaches nothing" not reaches "$UB" 10.204.0.3 other.test
check "replay SET_BINDING ub -> 200" bind ub "$UB" "$ALLOW_B"
check "replay data-plane-ready ub -> 200" ready ub
check "replay restores enforcement" bash -c "$(declare -f as resolves reaches); HOST=$HOST; resolves $UB other.test 10.204.0.3 && reaches $UB 10.204.0.3 other.test"
check "the replayed subject still cannot reach the other's address" not reaches "$UB" 10.204.0.2

echo "$PASS passed, $FAIL failed"
[ "$FAIL" -eq 0 ]
