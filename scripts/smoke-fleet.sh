#!/usr/bin/env bash
# egressd end to end on a throwaway network-namespace topology:
#
#   sandboxes sb1..sb4 (10.203.0.11-14) --veth-- pod (br0 10.203.0.1, egressd) --veth-- upstream (10.204.0.2-9)
#
# egressd runs in the pod namespace and is driven exactly like a Fastlet would drive it
# (SET_BINDING, runtime-ready, data-plane-ready, policy update, SET_BINDING null,
# REMOVE_BINDING, rebind, kill -9 + replay); a vault is pushed over the proxy route; real
# traffic (dig, curl) from the sandboxes is checked after each step, with the reference-parity
# variables on (an extra MITM port, an exempt nameserver, metric labels). One line per check, then
# "N passed, M failed". Exit 0 only when every check passed. Everything is removed on any exit.
#
# Nothing is created in the root namespace: veth pairs are made with both ends inside our
# namespaces, and no namespace has a route out.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ "$(id -u)" -ne 0 ]; then echo "smoke-fleet: needs root (network namespaces, nftables)" >&2; exit 1; fi
scripts/install.sh >/dev/null || { echo "smoke-fleet: install failed" >&2; exit 1; }

P="egsmoke$$"
POD="$P-pod"; UP="$P-up"
WORK=$(mktemp -d /tmp/egressd-smoke.XXXXXX)
PORT=18080
TABLE="opensandbox-fleet"  # the default: the docs pages (run below) name it
PIDS=()
PASS=0; FAIL=0

cleanup() {
  trap '' INT TERM  # a second Ctrl-C must not cut the cleanup short
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null; done
  sleep 0.2
  for ns in "$POD" "$UP" "$P-sb1" "$P-sb2" "$P-sb3" "$P-sb4"; do
    if ip netns list | grep -qw "$ns"; then
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
      ip netns del "$ns" 2>/dev/null
    fi
    rm -rf "/etc/netns/$ns"  # the sandboxes' resolv.conf (below)
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
SB() { echo "$P-sb$1"; }
SBIP() { echo "10.203.0.$((10 + $1))"; }

# ---- topology ---------------------------------------------------------------------------------
for ns in "$POD" "$UP"; do ip netns add "$ns"; inns "$ns" ip link set lo up; done
inns "$POD" sysctl -qw net.ipv4.ip_forward=1
inns "$POD" ip link add br0 type bridge
inns "$POD" ip addr add 10.203.0.1/24 dev br0
inns "$POD" ip link set br0 up
inns "$POD" sysctl -qw net.bridge.bridge-nf-call-iptables=1
ip link add uplink netns "$POD" type veth peer name eth0 netns "$UP"
inns "$POD" ip addr add 10.204.0.1/24 dev uplink; inns "$POD" ip link set uplink up
for i in 2 3 4 5 6 7 8 9; do inns "$UP" ip addr add "10.204.0.$i/24" dev eth0; done
inns "$UP" ip link set eth0 up
inns "$UP" ip route add 10.203.0.0/24 via 10.204.0.1
for i in 1 2 3 4; do
  ip netns add "$(SB $i)"; inns "$(SB $i)" ip link set lo up
  ip link add "vh$i" netns "$POD" type veth peer name eth0 netns "$(SB $i)"
  inns "$POD" ip link set "vh$i" master br0; inns "$POD" ip link set "vh$i" up
  inns "$(SB $i)" ip addr add "$(SBIP $i)/24" dev eth0; inns "$(SB $i)" ip link set eth0 up
  inns "$(SB $i)" ip route add default via 10.203.0.1
  # Like a real sandbox, each resolves through its gateway (ip netns exec bind-mounts this file
  # over /etc/resolv.conf); the docs pages' `sb2 curl http://api.allowed.test/` rely on it.
  mkdir -p "/etc/netns/$(SB $i)"; echo "nameserver 10.203.0.1" > "/etc/netns/$(SB $i)/resolv.conf"
done

cat > "$WORK/zone.json" <<'EOF'
{"records": [
  {"name": "api.allowed.test", "type": "A", "value": "10.204.0.2", "ttl": 30},
  {"name": "www.allowed.test", "type": "CNAME", "value": "api.allowed.test", "ttl": 30},
  {"name": "other.test", "type": "A", "value": "10.204.0.3", "ttl": 30},
  {"name": "exfil.test", "type": "A", "value": "10.204.0.4", "ttl": 30}
]}
EOF
ip netns exec "$UP" "$ROOT/.venv/bin/python" scripts/fleet_upstream.py --http-ports 80,8080 --zone "$WORK/zone.json" \
  --https-ports 443 --tls-dir "$WORK/tls" --tls-ips 10.204.0.2,10.204.0.3,10.204.0.4,10.204.0.5 \
  --log "$WORK/upstream.jsonl" > "$WORK/upstream.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do grep -q ready "$WORK/upstream.out" 2>/dev/null && break; sleep 0.1; done
mkdir -p "$WORK/rules"
# The deny webhook's receiver (docs/reference/behaviour.md §15), in the pod namespace: one JSON body per line.
cat > "$WORK/webhook.py" <<'EOF'
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
http.server.ThreadingHTTPServer(("127.0.0.1", 18099), H).serve_forever()
EOF
touch "$WORK/webhook.jsonl"
ip netns exec "$POD" python3 "$WORK/webhook.py" "$WORK/webhook.jsonl" > /dev/null 2>&1 &
PIDS+=($!)
# A service inside sb2, to prove sandboxes cannot reach each other.
ip netns exec "$(SB 2)" python3 -m http.server 8000 --bind "$(SBIP 2)" > /dev/null 2>&1 &
PIDS+=($!)

start_egressd() {
  # ip netns exec directly (not the inns function): $! must be egressd's own pid.
  ip netns exec "$POD" env OPENSANDBOX_EGRESS_PROFILE=fleet OPENSANDBOX_EGRESS_HTTP_ADDR="127.0.0.1:$PORT" \
    EGRESSD_NFT_TABLE="$TABLE" EGRESSD_ALWAYS_RULES_DIR="$WORK/rules" EGRESSD_LOG_FORMAT=json \
    OPENSANDBOX_EGRESS_DNS_UPSTREAM=10.204.0.2:53 OPENSANDBOX_EGRESS_DNS_UPSTREAM_TIMEOUT=2 \
    OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT=1 OPENSANDBOX_EGRESS_MITMPROXY_PORT=18081 EGRESSD_MITM_WORKERS=2 \
    OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR="$WORK/tls/trust" EGRESSD_MITM_CONFDIR="$WORK/mitm" \
    OPENSANDBOX_CREDENTIAL_PROXY_SOCKET="$WORK/run/active.sock" EGRESSD_MITM_CA_EXPORT_DIR="$WORK/ca-export" \
    OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS='^pinned\.allowed\.test$' \
    OPENSANDBOX_EGRESS_MITMPROXY_EXTRA_PORTS=8080 OPENSANDBOX_EGRESS_NAMESERVER_EXEMPT=10.204.0.2 \
    OPENSANDBOX_EGRESS_METRICS_EXTRA_ATTRS=smoke=fleet OPENSANDBOX_EGRESS_CREDENTIAL_VAULT_REQUIRE_TLS=1 \
    OPENSANDBOX_EGRESS_DENY_WEBHOOK="http://127.0.0.1:18099/deny" ${EXTRA_ENV:-} \
    "$ROOT/.venv/bin/egressd" >> "$WORK/egressd.log" 2>&1 &
  EGRESSD_PID=$!
  disown "$EGRESSD_PID"  # no "Killed" job notice when the kill -9 step or the cleanup ends it
  PIDS+=("$EGRESSD_PID")
  for _ in $(seq 1 300); do
    inns "$POD" curl -s -m 1 "127.0.0.1:$PORT/healthz" 2>/dev/null | grep -q ok && return 0
    sleep 0.1
  done
  return 1
}
ctl() { inns "$POD" "$ROOT/.venv/bin/egressctl" --addr "127.0.0.1:$PORT" "$@"; }
bind() {  # bind N POLICY_JSON [extra egressctl args]
  local i=$1 pol=$2; shift 2
  ctl send set-binding --uid "sb$i" --ip "$(SBIP "$i")" --gateway 10.203.0.1 --policy "$pol" "$@"
}
ready() { ctl send hook data-plane-ready --uid "sb$1" "${@:2}"; }
# reaches N ADDR [HOST]: with the name check (EGRESSD_NAME_CHECK, on with the MITM) a learned
# address answers only a Host that taught it; an address rule's answers any.
reaches() { [ "$(inns "$(SB "$1")" curl -s -o /dev/null -w '%{http_code}' --connect-timeout 1 -m 2 ${3:+-H "Host: $3"} "http://$2/smoke")" = 200 ]; }
http_code() { inns "$(SB "$1")" curl -s -o /dev/null -w '%{http_code}' --connect-timeout 1 -m 2 -H "Host: $3" "http://$2/smoke"; }
resolves() { inns "$(SB "$1")" dig +short +time=2 +tries=1 @10.203.0.1 "$2" | grep -q "${3:-.}"; }
nxdomain() { inns "$(SB "$1")" dig +time=2 +tries=1 @10.203.0.1 "$2" | grep -q "status: NXDOMAIN"; }
upstream_saw() { grep -q "\"dns\": \"$1\"" "$WORK/upstream.jsonl"; }
dropped() {  # dropped SUBJECT: its egressd_subject_dropped_packets_total (empty when absent)
  inns "$POD" curl -s "127.0.0.1:$PORT/metrics" | sed -n "s/^egressd_subject_dropped_packets_total{.*subject=\"$1\"} //p"
}
dropped_grows() {  # dropped_grows SUBJECT COMMAND...: COMMAND makes the subject's counter grow
  local subject=$1 before; shift; before=$(dropped "$subject"); "$@"; [ "$(dropped "$subject")" -gt "${before:-0}" ]
}
webhook_got() { grep -q "\"hostname\":\"$1\".*\"sandboxId\":\"$2\"" "$WORK/webhook.jsonl"; }
wait_webhook() { for _ in $(seq 1 50); do webhook_got "$@" && return 0; sleep 0.1; done; return 1; }
fails_fast() {  # fails_fast N URL: curl gives up in under a second despite --connect-timeout 2
  local start end; start=$(date +%s%N)
  inns "$(SB "$1")" curl -s -o /dev/null --connect-timeout 2 -m 3 "$2"; [ $? -eq 7 ] || return 1
  end=$(date +%s%N); [ $(((end - start) / 1000000)) -lt 1000 ]
}
direct_dns() { inns "$(SB "$1")" dig +short +time=2 +tries=1 @10.204.0.2 "$2" | grep -q "$3"; }
via_mitm() {  # via_mitm N URL PORT [curl args]: the request arrived from the pod (the MITM), not the sandbox
  [ "$(inns "$(SB "$1")" curl -s -o /dev/null -w '%{http_code}' -m 3 "${@:4}" "$2")" = 200 ] || return 1
  grep "\"port\": $3," "$WORK/upstream.jsonl" | tail -n 1 | grep -q '"client": "10.204.0.1"'
}
labelled_metrics() {  # every sample carries the constant label
  local out samples; out=$(inns "$POD" curl -s "127.0.0.1:$PORT/metrics") || return 1
  # No grep -q at the end of a pipe: it exits at its first match, the writer before it then
  # dies of SIGPIPE, and pipefail turns that into a failure (once /metrics outgrows a buffer).
  samples=$(grep -v '^#' <<<"$out" | grep -v '^$')
  [ -n "$samples" ] && ! grep -qv 'smoke="fleet"' <<<"$samples"
}
https_get() {  # https_get N HOST IP PATH: the upstream's JSON echo (what arrived) on stdout
  inns "$(SB "$1")" curl -s -m 5 --cacert "$WORK/mitm/mitmproxy-ca-cert.pem" --resolve "$2:443:$3" "https://$2$4"
}
seen() {  # the upstream's own base64 copy of what it received (the MITM redacts the echo's plain fields)
  "$ROOT/.venv/bin/python" -c 'import base64, json, sys; print(base64.b64decode(json.load(sys.stdin)["seen"]).decode())'
}
first_event_early() {  # N HOST IP: an SSE answer's first event arrives while the upstream still sends (5 x 500 ms)
  local got
  got=$(inns "$(SB "$1")" timeout 1.5 curl -s -N --cacert "$WORK/mitm/mitmproxy-ca-cert.pem" --resolve "$2:443:$3" \
    "https://$2/_stream/sse?n=5&gap=500" | head -c 2000 || true)
  grep -q '^data: {"i": 0' <<<"$got"
}
https_upstream_ca() {  # the same, trusting only the upstream's own CA (docs/reference/behaviour.md §16: passed through)
  inns "$(SB "$1")" curl -s -m 5 --cacert "$WORK/tls/ca.pem" --resolve "$2:443:$3" "https://$2$4"
}

check "egressd starts in the pod namespace and reports healthy" start_egressd
ID1=$(inns "$POD" curl -s "127.0.0.1:$PORT/_fastlet/v1/actions/status")
check "status payload names the actions API and an instanceId" grep -q '"instanceId"' <<<"$ID1"

ALLOW_NAME='{"defaultAction":"deny","egress":[{"action":"allow","target":"*.allowed.test"}]}'
ALLOW_IP='{"defaultAction":"deny","egress":[{"action":"allow","target":"10.204.0.3"}]}'
OPEN='{"defaultAction":"allow","egress":[{"action":"deny","target":"10.204.0.2"}]}'

# ---- deny-first window ------------------------------------------------------------------------
check "SET_BINDING sb1 (names policy) -> 200" bind 1 "$ALLOW_NAME"
check "SET_BINDING sb2 (IP policy) -> 200" bind 2 "$ALLOW_IP"
check "SET_BINDING sb3 (default allow, one IP denied) -> 200" bind 3 "$OPEN"
check "runtime-ready sb1 -> 200" ctl send hook runtime-ready --uid sb1
check "deny-first: sb1 cannot resolve before data-plane-ready" nxdomain 1 api.allowed.test
check "deny-first: sb2 cannot connect to its allowed IP yet" not reaches 2 10.204.0.3
check "deny-first: the upstream never saw sb1's early query" not upstream_saw api.allowed.test
check "unknown source sb4 reaches nothing" not reaches 4 10.204.0.3

# ---- activation -------------------------------------------------------------------------------
check "data-plane-ready sb1 -> 200" ready 1
check "data-plane-ready sb2 -> 200" ready 2
check "data-plane-ready sb3 -> 200" ready 3
check "sb1 resolves an allowed name (wildcard)" resolves 1 api.allowed.test 10.204.0.2
check "sb1 connects to the address it learned" reaches 1 10.204.0.2 api.allowed.test
check "the name check: another Host on sb1's learned address is refused 403" test "$(http_code 1 10.204.0.2 exfil.test)" = 403
check "sb1 follows a CNAME chain" resolves 1 www.allowed.test 10.204.0.2
check "sb1 gets NXDOMAIN for a denied name" nxdomain 1 exfil.test
check "the upstream never saw the denied name" not upstream_saw exfil.test
check "sb1 cannot connect to an address it did not learn" not reaches 1 10.204.0.3
check "the deny webhook got sb1's denied name with sandboxId sb1" wait_webhook exfil.test sb1
check "the allowed answer is an egress.outbound event" grep -q '"target.host": "api.allowed.test"' "$WORK/egressd.log"
check "a refused connect of sb1 grows sb1's drop counter" dropped_grows s-sb1 not reaches 1 10.204.0.3
check "egressctl subjects shows sb1's drops and its denied name" bash -c "ip netns exec $POD $ROOT/.venv/bin/egressctl --addr 127.0.0.1:$PORT subjects | grep s-sb1 | grep -q exfil.test"
check "sb2 connects to its allowed IP" reaches 2 10.204.0.3
check "sb2 cannot use the address sb1 learned" not reaches 2 10.204.0.2
check "sb3 (default allow) reaches an unlisted IP" reaches 3 10.204.0.3
check "sb3 cannot reach its denied IP" not reaches 3 10.204.0.2
check "sb2's own service answers inside sb2" ip netns exec "$(SB 2)" curl -s -o /dev/null -m 2 "http://$(SBIP 2):8000/"
check "sandbox-to-sandbox traffic is dropped" not ip netns exec "$(SB 3)" curl -s -o /dev/null --connect-timeout 1 -m 2 "http://$(SBIP 2):8000/"
check "DoT (853) is dropped even for allowed addresses" not ip netns exec "$(SB 3)" curl -s --connect-timeout 1 -m 2 http://10.204.0.5:853/
check "sb2 asks the exempt nameserver directly (NAMESERVER_EXEMPT), port 53 only" bash -c "$(declare -f inns SB direct_dns reaches); P=$P; direct_dns 2 other.test 10.204.0.3 && ! reaches 2 10.204.0.2"
check "unknown source sb4 cannot use the exempt nameserver" not direct_dns 4 other.test 10.204.0.3
check "an extra MITM port (MITMPROXY_EXTRA_PORTS=8080) goes through the MITM" via_mitm 1 http://api.allowed.test:8080/smoke 8080 --resolve api.allowed.test:8080:10.204.0.2
check "the extra port is name-checked: an IP-literal Host on sb1's learned address is refused 403" test "$(inns "$(SB 1)" curl -s -o /dev/null -w '%{http_code}' -m 3 http://10.204.0.2:8080/smoke)" = 403
check "the extra port is policed like 80: sb1 cannot reach an address it did not learn" not reaches 1 10.204.0.3:8080
check "every /metrics sample carries METRICS_EXTRA_ATTRS" labelled_metrics
check "the self-test logged how this kernel renews leases" grep -q '"lease_renewal"' "$WORK/egressd.log"

# ---- policy update, vault, null, remove, rebind ------------------------------------------------
check "in-place policy update sb2 -> 200" bind 2 '{"defaultAction":"deny","egress":[{"action":"allow","target":"10.204.0.5"}]}'
check "after the update sb2 reaches the new IP" reaches 2 10.204.0.5
check "after the update sb2 no longer reaches the old IP" not reaches 2 10.204.0.3
printf '%s' '{"credentials":[{"name":"k","source":{"type":"inline","value":"smoke-secret-value"}}],"bindings":[{"name":"b","match":{"hosts":["api.allowed.test"]},"auth":{"type":"bearer","credential":"k"}}]}' > "$WORK/vault.json"
check "vault pushed over the proxy route for sb1 -> 201" ctl vault put --uid sb1 --file "$WORK/vault.json"
check "sb1's HTTPS call to the bound host carries the injected credential upstream" bash -c "$(declare -f inns SB https_get seen); P=$P WORK=$WORK ROOT=$ROOT; https_get 1 api.allowed.test 10.204.0.2 /v1/x | seen | grep -q 'Bearer smoke-secret-value'"
check "the upstream's echo of the credential comes back redacted in the body" bash -c "$(declare -f inns SB https_get); P=$P WORK=$WORK; out=\$(https_get 1 api.allowed.test 10.204.0.2 /v1/x); grep -q '\"Authorization\": \"\[REDACTED\]\"' <<<\"\$out\" && ! grep -q smoke-secret-value <<<\"\$out\""
check "a server-sent-events answer reaches sb1 as it is produced, through the decrypting MITM" bash -c "$(declare -f inns SB first_event_early); P=$P WORK=$WORK; first_event_early 1 api.allowed.test 10.204.0.2"
check "the sandbox never saw the credential in the response headers" not bash -c "ip netns exec $(SB 1) curl -s -D - -o /dev/null -m 5 --cacert $WORK/mitm/mitmproxy-ca-cert.pem --resolve api.allowed.test:443:10.204.0.2 https://api.allowed.test/ | grep -q smoke-secret-value"
sibling_gets_nothing() { local out; out=$(https_upstream_ca 3 other.test 10.204.0.3 /v1/x); grep -q '"tls": true' <<<"$out" && ! grep -q smoke-secret-value <<<"$out"; }
check "sibling sb3 (no vault) is passed through: the upstream's own certificate, no credential" sibling_gets_nothing
check "a forged Host towards an address not learned for it gets no credential" not bash -c "$(declare -f inns SB https_upstream_ca); P=$P WORK=$WORK https_upstream_ca 3 api.allowed.test 10.204.0.3 / | grep -q smoke-secret-value"
check "sb1's bound host is decrypted: a client trusting only the upstream's CA is refused" not bash -c "$(declare -f inns SB https_upstream_ca); P=$P WORK=$WORK https_upstream_ca 1 api.allowed.test 10.204.0.2 /v1/x | grep -q '\"tls\": true'"
unbound_passes() { local out; out=$(https_upstream_ca 1 www.allowed.test 10.204.0.2 /v1/x); grep -q '"tls": true' <<<"$out" && ! grep -q smoke-secret-value <<<"$out"; }
check "sb1's allowed host without a binding is passed through (upstream certificate, no credential)" unbound_passes
ca_exported() {
  local d="$WORK/ca-export"
  [ "$(ls "$d")" = "$(printf 'egressd-ca.crt\negressd-ca.pem')" ] || return 1
  diff <(ctl ca) "$d/egressd-ca.pem" && diff "$d/egressd-ca.pem" "$d/egressd-ca.crt" || return 1
  [ "$(stat -c %a "$d/egressd-ca.pem")" = 644 ] && [ "$(stat -c %a "$d/egressd-ca.crt")" = 644 ] || return 1
  ! grep -q "PRIVATE KEY" "$d"/*
}
check "EGRESSD_MITM_CA_EXPORT_DIR holds the public CA only (egressd-ca.pem = .crt = egressctl ca, 0644)" ca_exported
check "a sandbox trusting the exported egressd-ca.pem gets its credential" bash -c "$(declare -f seen); ROOT=$ROOT; ip netns exec $(SB 1) curl -s -m 5 --cacert $WORK/ca-export/egressd-ca.pem --resolve api.allowed.test:443:10.204.0.2 https://api.allowed.test/v1/x | seen | grep -q 'Bearer smoke-secret-value'"
printf '%s' '{"credentials":[{"name":"k","source":{"type":"inline","value":"smoke-secret-value"}}],"bindings":[{"name":"p","match":{"hosts":["pinned.allowed.test"]},"auth":{"type":"bearer","credential":"k"}}]}' > "$WORK/vault-ignored.json"
ignored_refused() { local out; out=$(ctl vault put --uid sb1 --file "$WORK/vault-ignored.json" 2>&1) && return 1; grep -q ignore_hosts <<<"$out"; }
check "a vault binding a host of OPENSANDBOX_EGRESS_MITMPROXY_IGNORE_HOSTS is refused" ignored_refused
check "a direct connection to the MITM port is dropped" not ip netns exec "$(SB 1)" curl -s -o /dev/null --connect-timeout 1 -m 2 http://10.203.0.1:18081/
check "egressctl ca prints the MITM CA baked into sandboxes" bash -c "diff <(ip netns exec $POD $ROOT/.venv/bin/egressctl --addr 127.0.0.1:$PORT ca) $WORK/mitm/mitmproxy-ca-cert.pem"
check "vault read back is sanitized (no value)" bash -c "ip netns exec $POD $ROOT/.venv/bin/egressctl --addr 127.0.0.1:$PORT vault get --uid sb1 | grep -q bearer && ! ip netns exec $POD $ROOT/.venv/bin/egressctl --addr 127.0.0.1:$PORT vault get --uid sb1 | grep -q smoke-secret-value"
check "the secret never reached the daemon's log" not grep -q smoke-secret-value "$WORK/egressd.log"
listening() { inns "$POD" ss -Hltn "sport = :$1" | grep -q LISTEN; }
check "EGRESSD_MITM_WORKERS=2: both worker ports listen (18081, 18082)" bash -c "$(declare -f inns listening); P=$P POD=$POD; listening 18081 && listening 18082"
check "egressctl status shows both workers ready" bash -c "[ \"\$(ip netns exec $POD $ROOT/.venv/bin/egressctl --addr 127.0.0.1:$PORT status | grep -c 'mitm-worker .* ready')\" = 2 ]"
worker_served() { inns "$POD" curl -s "127.0.0.1:$PORT/metrics" | grep '^egressd_mitm_connections_total{' | grep "worker=\"$1\"" | grep -qv ' 0$'; }
check "each worker served intercepted connections (subjects spread over both)" bash -c "$(declare -f inns worker_served); P=$P POD=$POD PORT=$PORT; worker_served 0 && worker_served 1"
check "SET_BINDING null sb3 -> 200" ctl send set-binding --uid sb3 --ip "$(SBIP 3)" --gateway 10.203.0.1 --null
check "after null sb3 reaches nothing" not reaches 3 10.204.0.3
check "REMOVE_BINDING sb2 -> 200" ctl send remove --uid sb2
check "after removal sb2 reaches nothing" not reaches 2 10.204.0.5
check "after removal no nft object of sb2 is left" not bash -c "ip netns exec $POD nft list table inet $TABLE | grep -q s_sb2"
check "siblings keep working after a removal" reaches 1 10.204.0.2 api.allowed.test
check "rebind sb1 (new runtime instance) -> 200" bind 1 "$ALLOW_NAME" --runtime-instance-id r2
check "a rebind never carries the old policy over" not reaches 1 10.204.0.2 api.allowed.test
check "a rebind drops the vault" not ctl vault get --uid sb1
check "a delayed hook of the old instance -> 409" not ready 1
check "data-plane-ready for the new instance -> 200" ready 1 --runtime-instance-id r2
check "the new instance resolves and connects again" bash -c "ip netns exec $(SB 1) dig +short @10.203.0.1 api.allowed.test >/dev/null && ip netns exec $(SB 1) curl -s -o /dev/null --connect-timeout 1 -m 2 http://10.204.0.2/"

# ---- restart and replay -----------------------------------------------------------------------
kill -9 "$EGRESSD_PID" 2>/dev/null
for _ in $(seq 1 100); do kill -0 "$EGRESSD_PID" 2>/dev/null || break; sleep 0.05; done
check "with the daemon dead the kernel keeps enforcing" not reaches 3 10.204.0.3
EXTRA_ENV="EGRESSD_DENY_REJECT=1"
check "egressd restarts (now with EGRESSD_DENY_REJECT=1)" start_egressd
ID2=$(inns "$POD" curl -s "127.0.0.1:$PORT/_fastlet/v1/actions/status")
check "a restart gets a new instanceId" test "$ID1" != "$ID2"
check "after the restart the table is reset to deny-all" not reaches 1 10.204.0.2 api.allowed.test
check "replay SET_BINDING sb1 -> 200" bind 1 "$ALLOW_NAME" --runtime-instance-id r2
check "replay data-plane-ready sb1 -> 200" ready 1 --runtime-instance-id r2
check "replay restores enforcement" bash -c "ip netns exec $(SB 1) dig +short @10.203.0.1 api.allowed.test >/dev/null && ip netns exec $(SB 1) curl -s -o /dev/null --connect-timeout 1 -m 2 http://10.204.0.2/"
check "egressctl subjects lists the replayed subject" bash -c "ip netns exec $POD $ROOT/.venv/bin/egressctl --addr 127.0.0.1:$PORT subjects | grep -q active"
check "EGRESSD_DENY_REJECT: a denied connect fails at once, not at its timeout" fails_fast 1 http://10.204.0.3/
check "EGRESSD_DENY_REJECT: the refusal is still counted" dropped_grows s-sb1 fails_fast 1 http://10.204.0.3/
check "egressctl watch --count 1 draws the subjects with their drops" bash -c "ip netns exec $POD $ROOT/.venv/bin/egressctl --addr 127.0.0.1:$PORT watch --count 1 | grep -q 'DROPPED'"

# ---- docs pages -------------------------------------------------------------------------------
# Every runnable block of docs/start/ and docs/howto/ (`<!-- runs: fleet -->`), against this
# daemon; each page runs on its own, then sandboxes 2 and 3 are unbound again.
# EGRESSD_SMOKE_NO_DOCS=1 skips them.
if [ -z "${EGRESSD_SMOKE_NO_DOCS:-}" ]; then
  ctl_cmd="ip netns exec $POD $ROOT/.venv/bin/egressctl --addr 127.0.0.1:$PORT"
  if EGDOC_ROOT=$ROOT EGDOC_POD=$POD EGDOC_PORT=$PORT EGDOC_PREFIX=$P EGDOC_LOG=$WORK/egressd.log \
      "$ROOT/.venv/bin/python" scripts/docs/run_pages.py --profile fleet \
      --after-page "$ctl_cmd send remove --uid sb2; $ctl_cmd send remove --uid sb3"; then
    PASS=$((PASS + 1)); echo "PASS  every runnable block of the docs pages (fleet)"
  else
    FAIL=$((FAIL + 1)); echo "FAIL  every runnable block of the docs pages (fleet)"
  fi
fi

# The machine's own network namespace must never gain egressd's table (this smoke uses the default name).
if nft list table inet "$TABLE" >/dev/null 2>&1; then
  FAIL=$((FAIL + 1)); echo "FAIL  the root network namespace holds no table inet $TABLE"
else
  PASS=$((PASS + 1)); echo "PASS  the root network namespace holds no table inet $TABLE"
fi

echo "$PASS passed, $FAIL failed"

# EGRESSD_SMOKE_PAUSE=1: keep the topology and the daemon up for a hand-driven session (README,
# "A five-minute tour"); everything is torn down after Enter (or Ctrl-C).
if [ -n "${EGRESSD_SMOKE_PAUSE:-}" ]; then
  cat <<EOF
paused: egressd (pid $EGRESSD_PID) runs in netns $POD on 127.0.0.1:$PORT, table $TABLE
  pod:        ip netns exec $POD $ROOT/.venv/bin/egressctl --addr 127.0.0.1:$PORT status
  sandboxes:  $P-sb1 .. $P-sb4 = 10.203.0.11 .. 10.203.0.14 (gateway 10.203.0.1; sb1 is bound)
  upstream:   $UP: DNS for *.allowed.test, other.test, exfil.test; HTTP :80, HTTPS :443
  files:      $WORK (egressd.log, mitm/mitmproxy-ca-cert.pem, upstream.jsonl)
the docs pages' shell names (docs/index.md, "How the examples run"), to paste into another shell:
  ctl() { ip netns exec $POD $ROOT/.venv/bin/egressctl --addr 127.0.0.1:$PORT "\$@"; }
  pod() { ip netns exec $POD "\$@"; }
  sb2() { ip netns exec $P-sb2 "\$@"; }; sb3() { ip netns exec $P-sb3 "\$@"; }
  logs() { cat $WORK/egressd.log; }
press Enter to tear everything down
EOF
  read -r _ || true
fi
[ "$FAIL" -eq 0 ]
