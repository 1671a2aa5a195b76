"""Group commit of DNS learning against the real kernel (egressd.engine.groupcommit): concurrent
queries of one sandbox under a port-scoped rule (its leases go into the pipapo set) are all
answered, and every answered address is reachable the moment its answer arrives (no answer
before the transaction that carries it committed); a kernel that refuses the transaction leaves
every query of the batch with SERVFAIL, as one query alone gets today (docs/reference/behaviour.md §14.4)."""

from __future__ import annotations

import re

from tests.kernel.test_hardening_leases import activate, own_daemon
from tests.kernel.topology import GATEWAY, UP_NET, Daemon, Topology

# Distinct addresses, so no answer can ride on an address an earlier answer opened.
NAMES = {
    "a.test": f"{UP_NET}.2",
    "b.test": f"{UP_NET}.3",
    "deep.test": f"{UP_NET}.4",
    "example.test": f"{UP_NET}.5",
    "api.example.test": f"{UP_NET}.6",
    "x.y.example.test": f"{UP_NET}.7",
}
REPEAT = 3  # each name asked this many times at once
PORT_RANGE: dict[str, object] = {
    "defaultAction": "deny",
    "egress": [
        {"action": "allow", "target": "*.test", "protocol": "tcp", "ports": ["1-1000"]},
        {"action": "allow", "target": "*.example.test", "protocol": "tcp", "ports": ["1-1000"]},
        {"action": "allow", "target": "example.test", "protocol": "tcp", "ports": ["1-1000"]},
    ],
}

# Every query in the background at once; each job connects the moment its answer arrives.
SCRIPT = r"""
for name in {names}; do
  for k in $(seq {repeat}); do
    (
      out=$(dig @{gw} "$name" A +time=3 +tries=1 +noall +comments +answer)
      status=$(printf '%s\n' "$out" | sed -n 's/.*status: \([A-Z]*\),.*/\1/p')
      ips=$(printf '%s\n' "$out" | awk '!/^;/ && NF {{print $NF}}')
      [ -n "$status" ] || status=TIMEOUT
      if [ -z "$ips" ]; then echo "$name $k $status - -"; fi
      for ip in $ips; do
        code=$(curl -s -o /dev/null -w '%{{http_code}}' --connect-timeout 1 -m 2 "http://$ip:80/probe")
        echo "$name $k $status $ip $code"
      done
    ) &
  done
done
wait
"""

LINE = re.compile(r"^(\S+) (\d+) (\S+) (\S+) (\S+)$")


def burst(topo: Topology) -> list[tuple[str, str, str, str]]:
    """(name, status, answered address or '-', HTTP code or '-') of every concurrent query."""
    script = SCRIPT.format(names=" ".join(NAMES), repeat=REPEAT, gw=GATEWAY)
    out = topo.ns(topo.sb(1), "bash", "-c", script, check=False, timeout=60).stdout
    rows = []
    for line in out.splitlines():
        m = LINE.match(line.strip())
        if m:
            rows.append((m[1], m[3], m[4], m[5]))
    return rows


def _sabotage_dynp_v4(d: Daemon) -> None:
    """A real kernel refusal: take away the subject's port-scoped dyn sets for ranges (pipapo,
    and the hash path these leases take, docs/concepts/ruleset.md) and the rules naming them, so
    the lease add that names them is refused."""
    for name in ("subj_s_sb1_dynp_v4", "subj_s_sb1_dynr_v4"):
        chain = None
        for line in d.nft("-a", "list", "table", "inet", d.table).splitlines():
            m = re.match(r"\s*chain (\S+) \{", line)
            if m:
                chain = m[1]
            if f"@{name} " in line and "# handle" in line and chain is not None:
                handle = line.rsplit("# handle", 1)[1].strip()
                d.nft("delete", "rule", "inet", d.table, chain, "handle", handle)
        d.nft("delete", "set", "inet", d.table, name)


def test_concurrent_queries_are_all_answered_and_reachable_on_answer(topo: Topology) -> None:
    with own_daemon(topo, "gc-ok", {}) as d:
        activate(d, PORT_RANGE)
        for name, addr in NAMES.items():
            assert not topo.reaches(1, addr, timeout=0.5), f"{name} open before it was resolved"
        rows = burst(topo)
        assert len(rows) == len(NAMES) * REPEAT, rows
        for name, status, addr, code in rows:
            assert status == "NOERROR" and addr == NAMES[name], (name, status, addr, rows)
            assert code == "200", f"{name} answered {addr} before the kernel held it: {rows}"
        # The ports outside the rule stay closed for the learned addresses.
        assert not topo.reaches(1, NAMES["a.test"], port=8080, timeout=0.5)


def test_a_refusing_kernel_leaves_every_concurrent_query_servfail(topo: Topology) -> None:
    with own_daemon(topo, "gc-refuse", {}) as d:
        activate(d, PORT_RANGE)
        _sabotage_dynp_v4(d)
        rows = burst(topo)
        assert len(rows) == len(NAMES) * REPEAT, rows
        for name, status, addr, _code in rows:
            assert status == "SERVFAIL" and addr == "-", (name, status, addr, rows)
        for name, addr in NAMES.items():
            assert not topo.reaches(1, addr, timeout=0.5), f"{name} opened by a refused transaction"
        assert "dns.learn_failed" in d.log_text()
