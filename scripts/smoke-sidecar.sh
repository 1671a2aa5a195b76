#!/usr/bin/env bash
# egressd as an egress sidecar, end to end, on a throwaway network-namespace topology:
#
#   sandbox (10.203.0.11; egressd AND the app run here) --veth-- upstream (10.203.0.1, 10.204.0.2-9)
#
# egressd runs inside the sandbox's own namespace (it holds NET_ADMIN there) and enforces one
# policy for everything in it: DNS answers and TCP connections of the app (dig, curl) are
# checked after each step, the API is driven like the OpenSandbox SDK would drive it (token,
# PATCH/DELETE/POST /policy, a vault write that must answer 412 without the MITM), then kill -9
# + restart and SIGTERM. A further run turns the transparent MITM on: a vault PUT succeeds, the
# app's HTTPS to the bound host carries the credential upstream, other hosts get none, the MITM
# port cannot be reached directly, and the MITM's group id skips injection but not the policy.
# A last run sets the reference-parity variables (extra MITM port, exempt nameserver, vault
# writes limited to loopback/TLS, constant metric labels).
# One line per check, then "N passed, M failed". Exit 0 only when every check passed.
# Everything is removed on any exit (also on failure or Ctrl-C).
#
# Nothing is created in the root namespace: the veth pair is made with both ends inside our
# namespaces, and no namespace has a route out.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ "$(id -u)" -ne 0 ]; then echo "smoke-sidecar: needs root (network namespaces, nftables)" >&2; exit 1; fi
scripts/install.sh >/dev/null || { echo "smoke-sidecar: install failed" >&2; exit 1; }

P="egsc$$"
SBX="$P-sb"; UP="$P-up"
WORK=$(mktemp -d /tmp/egressd-smoke-sidecar.XXXXXX)
TOKEN="smoke-sidecar-token"
POLICY_FILE="$WORK/policy.json"
PIDS=()
PASS=0; FAIL=0

cleanup() {
  trap '' INT TERM  # a second Ctrl-C must not cut the cleanup short
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null; done
  sleep 0.2
  for ns in "$SBX" "$UP"; do
    if ip netns list | grep -qw "$ns"; then
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
      ip netns del "$ns" 2>/dev/null
    fi
    rm -rf "/etc/netns/$ns"  # the sandbox's resolv.conf (docs pages, below)
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

# ---- topology ---------------------------------------------------------------------------------
for ns in "$SBX" "$UP"; do ip netns add "$ns"; inns "$ns" ip link set lo up; done
ip link add eth0 netns "$SBX" type veth peer name eth0 netns "$UP"
inns "$UP" ip addr add 10.203.0.1/24 dev eth0
for i in 2 3 4 5 6 7 8 9; do inns "$UP" ip addr add "10.204.0.$i/32" dev eth0; done
inns "$UP" ip link set eth0 up
inns "$SBX" ip addr add 10.203.0.11/24 dev eth0; inns "$SBX" ip link set eth0 up
inns "$SBX" ip route add 10.204.0.0/24 via 10.203.0.1
# The DNS upstream is the upstream's primary address: its wildcard UDP socket answers from it.

cat > "$WORK/zone.json" <<'JSON'
{"records": [
  {"name": "api.allowed.test", "type": "A", "value": "10.204.0.3", "ttl": 30},
  {"name": "www.allowed.test", "type": "CNAME", "value": "api.allowed.test", "ttl": 30},
  {"name": "later.test", "type": "A", "value": "10.204.0.4", "ttl": 30},
  {"name": "exfil.test", "type": "A", "value": "10.204.0.5", "ttl": 30},
  {"name": "b.allowed.test", "type": "A", "value": "10.204.0.7", "ttl": 30}
]}
JSON
# HTTPS on 443 with a test CA ($WORK/tls/ca.pem, hashed copy in $WORK/tls/trust): the MITM
# section verifies the upstream against it.
ip netns exec "$UP" "$ROOT/.venv/bin/python" scripts/fleet_upstream.py --http-ports 80,853,8080 --zone "$WORK/zone.json" \
  --https-ports 443 --tls-dir "$WORK/tls" --tls-ips 10.204.0.3,10.204.0.5,10.204.0.6,10.204.0.7 \
  --log "$WORK/upstream.jsonl" > "$WORK/upstream.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do grep -q ready "$WORK/upstream.out" 2>/dev/null && break; sleep 0.1; done
mkdir -p "$WORK/rules"
# The deny webhook's receiver (docs/reference/behaviour.md §15), on an upstream address the sandbox's policy never
# allows: the sidecar's own (marked) connection must reach it anyway.
cat > "$WORK/webhook.py" <<'PY'
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with open(sys.argv[1], "ab") as f:
            f.write(body + b"\n")
        self.send_response(204)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("10.204.0.8", 18099), H).serve_forever()
PY
touch "$WORK/webhook.jsonl"
ip netns exec "$UP" python3 "$WORK/webhook.py" "$WORK/webhook.jsonl" > /dev/null 2>&1 &
PIDS+=($!)

INITIAL='{"defaultAction":"deny","egress":[{"action":"allow","target":"*.allowed.test"},{"action":"allow","target":"10.204.0.6"}]}'

EXTRA_ENV=()  # the MITM section adds its variables here
start_egressd() {
  # ip netns exec directly (not the inns function): $! must be egressd's own pid.
  ip netns exec "$SBX" env "${EXTRA_ENV[@]}" OPENSANDBOX_EGRESS_TOKEN="$TOKEN" OPENSANDBOX_EGRESS_POLICY_FILE="$POLICY_FILE" \
    OPENSANDBOX_EGRESS_RULES="$INITIAL" OPENSANDBOX_EGRESS_MAX_RULES=20 \
    OPENSANDBOX_EGRESS_DNS_UPSTREAM=10.203.0.1:53 OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT=2 \
    EGRESSD_ALWAYS_RULES_DIR="$WORK/rules" EGRESSD_LOG_FORMAT=json \
    OPENSANDBOX_EGRESS_DENY_WEBHOOK=http://10.204.0.8:18099/deny OPENSANDBOX_EGRESS_SANDBOX_ID=smoke-sb \
    "$ROOT/.venv/bin/egressd" >> "$WORK/egressd.log" 2>&1 &
  EGRESSD_PID=$!
  PIDS+=("$EGRESSD_PID")
  for _ in $(seq 1 150); do
    inns "$SBX" curl -s -m 1 127.0.0.1:18080/healthz 2>/dev/null | grep -q ok && return 0
    sleep 0.1
  done
  return 1
}
api() {  # api METHOD PATH [BODY] -> prints "<body>\n<code>"
  local args=(-s -m 10 -w '\n%{http_code}' -X "$1" -H "OPENSANDBOX-EGRESS-AUTH: $TOKEN")
  [ $# -ge 3 ] && args+=(-H 'Content-Type: application/json' --data-binary "$3")
  inns "$SBX" curl "${args[@]}" "http://127.0.0.1:18080$2"
}
code_is() { [ "$(api "$@" | tail -n 1)" = "$CODE" ]; }
expect() { CODE=$1; shift; code_is "$@"; }
reaches() { [ "$(inns "$SBX" curl -s -o /dev/null -w '%{http_code}' --connect-timeout 1 -m 2 "http://$1/smoke")" = 200 ]; }
resolves() { inns "$SBX" dig +short +time=2 +tries=2 "@${3:-10.204.0.2}" "$1" | grep -q "${2:-.}"; }
nxdomain() { inns "$SBX" dig +time=2 +tries=2 "@${2:-10.204.0.2}" "$1" | grep -q "status: NXDOMAIN"; }
upstream_saw() { grep -q "\"dns\": \"$1\"" "$WORK/upstream.jsonl"; }
table_exists() { inns "$SBX" nft list table inet opensandbox; }
dropped() { inns "$SBX" curl -s 127.0.0.1:18080/metrics | sed -n 's/^egressd_subject_dropped_packets_total{.*subject="s-sidecar"} //p'; }
dropped_grows() { local before; before=$(dropped); "$@"; [ "$(dropped)" -gt "${before:-0}" ]; }
wait_webhook() {  # wait_webhook HOSTNAME SANDBOX_ID
  for _ in $(seq 1 50); do grep -q "\"hostname\":\"$1\".*\"sandboxId\":\"$2\"" "$WORK/webhook.jsonl" && return 0; sleep 0.1; done
  return 1
}
fails_fast() {  # fails_fast URL: curl gives up in under a second despite --connect-timeout 2
  local start end; start=$(date +%s%N)
  inns "$SBX" curl -s -o /dev/null --connect-timeout 2 -m 3 "$1"; [ $? -eq 7 ] || return 1
  end=$(date +%s%N); [ $(((end - start) / 1000000)) -lt 1000 ]
}

check "egressd starts in the sandbox namespace and reports healthy" start_egressd
check "the API refuses a request without the token (401)" \
  bash -c "[ \"\$(ip netns exec $SBX curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:18080/policy)\" = 401 ]"
check "the API refuses a wrong token (401)" \
  bash -c "[ \"\$(ip netns exec $SBX curl -s -o /dev/null -w '%{http_code}' -H 'OPENSANDBOX-EGRESS-AUTH: nope' 127.0.0.1:18080/policy)\" = 401 ]"
check "GET /policy returns the initial policy from OPENSANDBOX_EGRESS_RULES" bash -c "$(declare -f api inns); TOKEN=$TOKEN SBX=$SBX; api GET /policy | grep -q '\*.allowed.test'"
check "the nft table is installed in the sandbox namespace" table_exists

# ---- enforcement ------------------------------------------------------------------------------
check "an allowed name resolves (query to the upstream redirected to the proxy)" resolves api.allowed.test 10.204.0.3
check "the app connects to the address it learned" reaches 10.204.0.3
check "a CNAME chain is followed" resolves www.allowed.test 10.204.0.3
check "a denied name gets NXDOMAIN" nxdomain exfil.test
check "the upstream never saw the denied name" not upstream_saw exfil.test
check "a query to another resolver address is filtered too" nxdomain exfil.test 10.204.0.9
check "the app cannot connect to an address it did not learn" not reaches 10.204.0.5
check "the deny webhook got the denied name with OPENSANDBOX_EGRESS_SANDBOX_ID" wait_webhook exfil.test smoke-sb
check "... while the app itself cannot reach the receiver's address" not reaches 10.204.0.8
check "the refused connect grows the sidecar's drop counter" dropped_grows not reaches 10.204.0.5
check "the allowed answer is an egress.outbound event" grep -q '"target.host": "api.allowed.test"' "$WORK/egressd.log"
check "an allowed literal IP is reachable" reaches 10.204.0.6
check "DoT (853) is dropped even to an allowed address" not inns "$SBX" curl -s --connect-timeout 1 -m 2 http://10.204.0.6:853/

# ---- API --------------------------------------------------------------------------------------
check "PATCH /policy adds a name -> 200" expect 200 PATCH /policy '[{"action":"allow","target":"later.test"}]'
check "the patched name resolves and connects immediately" bash -c "ip netns exec $SBX dig +short +time=2 +tries=1 @10.204.0.2 later.test | grep -q 10.204.0.4 && [ \"\$(ip netns exec $SBX curl -s -o /dev/null -w '%{http_code}' --connect-timeout 1 -m 2 http://10.204.0.4/)\" = 200 ]"
check "DELETE /policy removes it -> 200" expect 200 DELETE /policy '["LATER.test"]'
check "the removed name is denied again (NXDOMAIN)" nxdomain later.test
check "its learned address is closed again at once" not reaches 10.204.0.4
check "a malformed PATCH -> 400" expect 400 PATCH /policy '[{"action":"maybe","target":"x.test"}]'
check "an empty PATCH -> 400" expect 400 PATCH /policy '[]'
check "more rules than OPENSANDBOX_EGRESS_MAX_RULES -> 413" expect 413 POST /policy \
  "{\"egress\":[$(for i in $(seq 1 21); do printf '{"action":"allow","target":"n%s.test"},' "$i"; done | sed 's/,$//')]}"
check "a rejected change left the policy alone" resolves api.allowed.test 10.204.0.3
check "a vault write without the MITM prerequisites -> 412" expect 412 POST /credential-vault \
  '{"credentials":[{"name":"k","source":{"type":"inline","value":"smoke-secret-value"}}],"bindings":[]}'
check "vault reads without a vault -> 404" expect 404 GET /credential-vault/bindings
check "the secret never reached the daemon's log" not grep -q smoke-secret-value "$WORK/egressd.log"
check "healthz and metrics need no token" bash -c "ip netns exec $SBX curl -sf 127.0.0.1:18080/healthz && ip netns exec $SBX curl -sf 127.0.0.1:18080/metrics | grep -q egress_nftables_updates_total"
check "POST /policy replaces the policy -> 200" expect 200 POST /policy '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.allowed.test"},{"action":"allow","target":"10.204.0.6"}]}'
check "the change was persisted to OPENSANDBOX_EGRESS_POLICY_FILE" grep -q '"api.allowed.test"' "$POLICY_FILE"

# ---- restart and shutdown ---------------------------------------------------------------------
DROPPED_BEFORE=$(dropped)
kill -9 "$EGRESSD_PID" 2>/dev/null; wait "$EGRESSD_PID" 2>/dev/null
check "with the daemon dead the kernel keeps enforcing" not reaches 10.204.0.5
check "with the daemon dead DNS stays closed (no bypass to the upstream)" not resolves api.allowed.test
EXTRA_ENV=(EGRESSD_DENY_REJECT=1)
check "egressd restarts (now with EGRESSD_DENY_REJECT=1)" start_egressd
check "the drop counter was carried over the restart's rebuild" bash -c "[ \"\$(ip netns exec $SBX curl -s 127.0.0.1:18080/metrics | sed -n 's/^egressd_subject_dropped_packets_total{.*subject=\"s-sidecar\"} //p')\" -ge ${DROPPED_BEFORE:-1} ]"
check "EGRESSD_DENY_REJECT: a denied connect fails at once, not at its timeout" fails_fast http://10.204.0.5/
check "EGRESSD_DENY_REJECT: the refusal is still counted" dropped_grows fails_fast http://10.204.0.5/
EXTRA_ENV=()
check "the restart keeps the persisted policy (not OPENSANDBOX_EGRESS_RULES)" not resolves www.allowed.test
check "the restarted sidecar enforces it" bash -c "ip netns exec $SBX dig +short +time=2 +tries=1 @10.204.0.2 api.allowed.test | grep -q 10.204.0.3"
check "the restarted sidecar still denies" nxdomain exfil.test
kill -TERM "$EGRESSD_PID" 2>/dev/null
check "SIGTERM: egressd exits 0" wait "$EGRESSD_PID"
check "SIGTERM: the sidecar table is deleted" not table_exists
check "without NET_ADMIN egressd refuses to start with one line" bash -c \
  "out=\$(ip netns exec $SBX setpriv --bounding-set -net_admin --inh-caps -net_admin $ROOT/.venv/bin/egressd 2>&1 >/dev/null); rc=\$?; [ \$rc -eq 1 ] && [ \$(printf '%s\n' \"\$out\" | wc -l) -eq 1 ] && grep -q NET_ADMIN <<<\"\$out\""
check "and leaves no table behind" not table_exists

# ---- transparent MITM (credential injection) --------------------------------------------------
# The sidecar's MITM intercepts the namespace's own TCP 80/443 (nat output redirect); its child
# runs with group id 18081, which the redirect exempts (meta skgid), so its upstream leg is not
# intercepted again. Only the bound host is decrypted (docs/reference/behaviour.md §16): for it the app trusts the
# MITM CA ($MITM_CA); every other host is passed through with the upstream's own certificate.
EXTRA_ENV=(OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT=1 OPENSANDBOX_EGRESS_MITMPROXY_PORT=18081
  OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR="$WORK/tls/trust" EGRESSD_MITM_CONFDIR="$WORK/mitm"
  OPENSANDBOX_CREDENTIAL_PROXY_SOCKET="$WORK/run/active.sock" EGRESSD_MITM_CA_EXPORT_DIR="$WORK/ca-export")
MITM_CA="$WORK/mitm/mitmproxy-ca-cert.pem"
SECRET="smoke-mitm-secret-value"
VAULT='{"credentials":[{"name":"key","source":{"type":"inline","value":"'$SECRET'"}}],"bindings":[{"name":"api","match":{"hosts":["api.allowed.test"]},"auth":{"type":"bearer","credential":"key"}}]}'
https_get() {  # https_get HOST IP [CA]: the upstream's JSON echo of what arrived, on stdout
  inns "$SBX" curl -s -m 5 --cacert "${3:-$MITM_CA}" --resolve "$1:443:$2" "https://$1/v1/x"
}
seen() {  # the upstream's own base64 copy of what it received (the MITM redacts the echo's plain fields)
  "$ROOT/.venv/bin/python" -c 'import base64, json, sys; print(base64.b64decode(json.load(sys.stdin)["seen"]).decode())'
}
first_event_early() {  # HOST IP: an SSE answer's first event arrives while the upstream still sends (5 x 500 ms)
  local got
  got=$(inns "$SBX" timeout 1.5 curl -s -N --cacert "$MITM_CA" --resolve "$1:443:$2" \
    "https://$1/_stream/sse?n=5&gap=500" | head -c 2000 || true)
  grep -q '^data: {"i": 0' <<<"$got"
}
as_mitm_gid() { inns "$SBX" setpriv --regid 18081 --clear-groups "$@"; }
healthz_fingerprint() {  # 200, and the header equals the SHA-256 of the CA certificate's DER
  local hdrs fp
  hdrs=$(inns "$SBX" curl -s -D - -o /dev/null 127.0.0.1:18080/healthz) || return 1
  grep -q '^HTTP/1.1 200' <<<"$hdrs" || return 1
  fp=$(openssl x509 -in "$MITM_CA" -outform DER | sha256sum | cut -d' ' -f1)
  grep -qi "^x-egressd-mitm-ca-fingerprint: $fp" <<<"$hdrs"
}
check "egressd starts with the MITM on; healthz only turns 200 once the MITM is ready" start_egressd
check "healthz is 200 with X-Egressd-Mitm-Ca-Fingerprint = SHA-256 of the CA certificate" healthz_fingerprint
check "the MITM redirect is in the sidecar table (skgid 18081 exempt, direct connections dropped)" bash -c \
  "ip netns exec $SBX nft list table inet opensandbox | tr -s ' ' > $WORK/table.txt; grep -q 'skgid 18081 return' $WORK/table.txt && grep -q 'tcp dport { 80, 443 } redirect to :18081' $WORK/table.txt && grep -q 'tcp dport 18081 goto denied' $WORK/table.txt"
check "POST /policy allows the bound host and one more -> 200" expect 200 POST /policy \
  '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.allowed.test"},{"action":"allow","target":"b.allowed.test"}]}'
check "PUT /credential-vault with the token -> 201 (every prerequisite holds)" expect 201 PUT /credential-vault "$VAULT"
check "the app resolves both names (the leases the MITM's destination check uses)" bash -c \
  "$(declare -f inns resolves); SBX=$SBX; resolves api.allowed.test 10.204.0.3 && resolves b.allowed.test 10.204.0.7"
check "HTTPS to the bound host carries the injected credential upstream" bash -c \
  "$(declare -f inns https_get seen); SBX=$SBX MITM_CA=$MITM_CA ROOT=$ROOT; https_get api.allowed.test 10.204.0.3 | seen | grep -q 'Bearer $SECRET'"
check "the upstream's echo of the credential comes back redacted in the body" bash -c \
  "$(declare -f inns https_get); SBX=$SBX MITM_CA=$MITM_CA; out=\$(https_get api.allowed.test 10.204.0.3); grep -q '\"Authorization\": \"\[REDACTED\]\"' <<<\"\$out\" && ! grep -q $SECRET <<<\"\$out\""
check "a server-sent-events answer reaches the app as it is produced, through the decrypting MITM" bash -c \
  "$(declare -f inns first_event_early); SBX=$SBX MITM_CA=$MITM_CA; first_event_early api.allowed.test 10.204.0.3"
check "the app never sees the credential in the response headers" not bash -c \
  "ip netns exec $SBX curl -s -D - -o /dev/null -m 5 --cacert $MITM_CA --resolve api.allowed.test:443:10.204.0.3 https://api.allowed.test/ | grep -q $SECRET"
check "HTTPS to another allowed host is passed through (upstream's own certificate), no credential" bash -c \
  "$(declare -f inns https_get); SBX=$SBX MITM_CA=$MITM_CA; out=\$(https_get b.allowed.test 10.204.0.7 $WORK/tls/ca.pem); grep -q '\"tls\": true' <<<\"\$out\" && ! grep -q $SECRET <<<\"\$out\""
check "the bound host is decrypted: trusting only the upstream's CA fails there" not bash -c \
  "$(declare -f inns https_get); SBX=$SBX MITM_CA=$MITM_CA; https_get api.allowed.test 10.204.0.3 $WORK/tls/ca.pem | grep -q '\"tls\": true'"
check "a passed-through connection is policed too: an address never learned is not reached" not bash -c \
  "$(declare -f inns https_get); SBX=$SBX MITM_CA=$MITM_CA; https_get b.allowed.test 10.204.0.5 $WORK/tls/ca.pem | grep -q '\"tls\": true'"
check "EGRESSD_MITM_CA_EXPORT_DIR holds the CA certificate only (egressd-ca.pem = .crt, 0644)" bash -c \
  "cmp $WORK/ca-export/egressd-ca.pem $MITM_CA && cmp $WORK/ca-export/egressd-ca.crt $MITM_CA && [ \$(stat -c %a $WORK/ca-export/egressd-ca.pem) = 644 ] && ! grep -q 'PRIVATE KEY' $WORK/ca-export/*"
check "a forged SNI towards the other name's address is refused by the name check, no credential" bash -c \
  "$(declare -f inns https_get); SBX=$SBX MITM_CA=$MITM_CA; out=\$(https_get api.allowed.test 10.204.0.7); ! grep -q '\"tls\": true' <<<\"\$out\" && ! grep -q $SECRET <<<\"\$out\""
check "the MITM's upstream leg is policed: HTTPS to an address never learned fails" not bash -c \
  "$(declare -f inns https_get); SBX=$SBX MITM_CA=$MITM_CA; https_get api.allowed.test 10.204.0.5 | grep -q '\"tls\": true'"
check "a direct connection to the MITM port (127.0.0.1:18081) fails" not \
  inns "$SBX" curl -s -o /dev/null --connect-timeout 1 -m 2 http://127.0.0.1:18081/
check "the MITM is still healthy afterwards (healthz 200)" healthz_fingerprint
check "a process with gid 18081 skips the MITM: upstream's own certificate, no credential" bash -c \
  "$(declare -f inns https_get as_mitm_gid); SBX=$SBX MITM_CA=$MITM_CA; out=\$(as_mitm_gid curl -s -m 5 --cacert $WORK/tls/ca.pem --resolve api.allowed.test:443:10.204.0.3 https://api.allowed.test/v1/x); grep -q '\"tls\": true' <<<\"\$out\" && ! grep -q $SECRET <<<\"\$out\""
check "... but not the policy: it cannot reach an address never learned" not \
  as_mitm_gid curl -s -o /dev/null --connect-timeout 1 -m 2 -k https://10.204.0.5/
check "the credential never reached the daemon's log" not grep -q "$SECRET" "$WORK/egressd.log"
kill -TERM "$EGRESSD_PID" 2>/dev/null
check "SIGTERM: egressd (and its MITM child) exit 0" wait "$EGRESSD_PID"
check "SIGTERM: the sidecar table is deleted" not table_exists

# ---- reference sidecar parity (the variables the OpenSandbox server forwards) ------------------
# The MITM again, with one more intercepted port, vault writes limited to loopback/TLS, the
# upstream resolver exempt from the DNS redirect, and constant metric labels.
EXTRA_ENV=(OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT=1 OPENSANDBOX_EGRESS_MITMPROXY_PORT=18081
  OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR="$WORK/tls/trust" OPENSANDBOX_EGRESS_MITMPROXY_CONFDIR="$WORK/mitm"
  OPENSANDBOX_CREDENTIAL_PROXY_SOCKET="$WORK/run/active.sock" OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS=8080
  OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS=1 OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT=10.203.0.1
  OPENSANDBOX_EGRESS_SANDBOX_ID=smoke-sb OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS=smoke=parity
  OPENSANDBOX_EGRESS_LOG_LEVEL=info)
redirected_to_mitm() {  # the app's flow to PORT was redirected to the MITM (conntrack reply tuple)
  inns "$SBX" conntrack -L -p tcp --orig-port-dst "$1" 2>/dev/null | grep -q 'sport=18081 '
}
labelled_metrics() {
  local out samples; out=$(inns "$SBX" curl -s 127.0.0.1:18080/metrics) || return 1
  # No grep -q at the end of a pipe: it exits at its first match, the writer before it then
  # dies of SIGPIPE, and pipefail turns that into a failure (once /metrics outgrows a buffer).
  samples=$(grep -v '^#' <<<"$out" | grep -v '^$')
  [ -n "$samples" ] && ! grep -qv 'sandbox_id="smoke-sb",smoke="parity"' <<<"$samples"
}
outside_vault_write() {  # from the upstream namespace, like a client that is not on loopback
  [ "$(inns "$UP" curl -s -o /dev/null -w '%{http_code}' -m 5 -X PUT -H "OPENSANDBOX-EGRESS-AUTH: $TOKEN" \
    -H 'X-Forwarded-Proto: https' --data-binary "$VAULT" http://10.203.0.11:18080/credential-vault)" = 426 ]
}
check "egressd starts with the reference parity variables" start_egressd
check "the self-test logged how this kernel renews leases" grep -q '"lease_renewal"' "$WORK/egressd.log"
check "POST /policy allows the bound host and one more -> 200" expect 200 POST /policy \
  '{"defaultAction":"deny","egress":[{"action":"allow","target":"api.allowed.test"},{"action":"allow","target":"b.allowed.test"}]}'
check "the extra port is in the redirect (MITMPROXY_EXTRA_PORTS=8080)" bash -c \
  "ip netns exec $SBX nft list table inet opensandbox | tr -s ' ' | grep -q 'tcp dport { 80, 443, 8080 } redirect to :18081'"
check "the app's HTTP to port 8080 goes through the MITM" bash -c \
  "$(declare -f inns resolves redirected_to_mitm); SBX=$SBX; resolves b.allowed.test 10.204.0.7 && ip netns exec $SBX conntrack -F && [ \"\$(ip netns exec $SBX curl -s -o /dev/null -w '%{http_code}' -m 3 --resolve b.allowed.test:8080:10.204.0.7 http://b.allowed.test:8080/smoke)\" = 200 ] && redirected_to_mitm 8080"
check "the extra port is name-checked: an IP-literal Host is refused 403" bash -c \
  "[ \"\$(ip netns exec $SBX curl -s -o /dev/null -w '%{http_code}' -m 3 http://10.204.0.7:8080/smoke)\" = 403 ]"
check "... and its upstream leg is policed: port 8080 of an address never learned fails" not reaches 10.204.0.5:8080
check "the exempt resolver answers the app directly, also a name the policy denies (NAMESERVER_EXEMPT)" \
  resolves exfil.test 10.204.0.5 10.203.0.1
check "... which opens nothing: the app still cannot connect to that address" not reaches 10.204.0.5
check "a resolver address that is not exempt still goes through the proxy" nxdomain exfil.test 10.204.0.9
check "a vault write from outside the namespace is 426 (CREDENTIAL_VAULT_REQUIRE_TLS)" outside_vault_write
check "the same write over loopback -> 201" expect 201 PUT /credential-vault "$VAULT"
check "every /metrics sample carries sandbox_id and METRICS_EXTRA_ATTRS" labelled_metrics
kill -TERM "$EGRESSD_PID" 2>/dev/null
check "SIGTERM: egressd exits 0" wait "$EGRESSD_PID"

# ---- docs pages -------------------------------------------------------------------------------
# Every runnable block of docs/start/ and docs/howto/ (`<!-- runs: sidecar -->`), against a
# sidecar with the MITM on and its CA exported; the app resolves through /etc/resolv.conf like a
# real one (ip netns exec bind-mounts /etc/netns/<ns>/resolv.conf). EGRESSD_SMOKE_NO_DOCS=1 skips.
if [ -z "${EGRESSD_SMOKE_NO_DOCS:-}" ]; then
  mkdir -p "/etc/netns/$SBX"; echo "nameserver 10.203.0.1" > "/etc/netns/$SBX/resolv.conf"
  EXTRA_ENV=(OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT=1 OPENSANDBOX_EGRESS_MITMPROXY_PORT=18081
    OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR="$WORK/tls/trust" EGRESSD_MITM_CONFDIR="$WORK/mitm"
    OPENSANDBOX_CREDENTIAL_PROXY_SOCKET="$WORK/run/active.sock" EGRESSD_MITM_CA_EXPORT_DIR="$WORK/ca-export")
  if start_egressd && EGDOC_SANDBOX=$SBX EGDOC_TOKEN=$TOKEN EGDOC_LOG=$WORK/egressd.log \
      EGDOC_CA=$WORK/ca-export/egressd-ca.pem "$ROOT/.venv/bin/python" scripts/docs/run_pages.py --profile sidecar; then
    PASS=$((PASS + 1)); echo "PASS  every runnable block of the docs pages (sidecar)"
  else
    FAIL=$((FAIL + 1)); echo "FAIL  every runnable block of the docs pages (sidecar)"
  fi
  kill -TERM "$EGRESSD_PID" 2>/dev/null; wait "$EGRESSD_PID" 2>/dev/null
fi

echo "$PASS passed, $FAIL failed"
[ "$FAIL" -eq 0 ]
