"""The fleet ruleset with several MITM workers: every worker port policed, the redirect by the
per-subject port map with a fail-closed drop on a miss, and the assignment function."""

from __future__ import annotations

from ipaddress import ip_address

import pytest

from egressd.fleetnft.header import header_script
from egressd.fleetnft.subject import dispatch_deletes, dispatch_entries, subject_create, subject_keys
from egressd.fleetnft.table import SubjectNft, TableConfig
from egressd.fleetnft.workers import WorkerAssignment, least_loaded, uid_worker
from egressd.kernel.ops import AddElements, AddPort, DeleteElement

T = "T"
CFG = TableConfig(table=T, mitm=True, mitm_port=18081, mitm_workers=3)
SUBJ = SubjectNft("s_u_1", ip_address("10.0.0.5"), ip_address("10.0.0.1"), worker=2)


def rules(script: str, chain: str) -> list[str]:
    prefix = f"add rule inet {T} {chain} "
    return [ln[len(prefix) :] for ln in script.splitlines() if ln.startswith(prefix)]


def test_every_worker_port_is_policed_on_input() -> None:
    script = header_script(CFG, delete_existing=False)
    assert "tcp dport 18081-18083 goto denied" in rules(script, "input")
    sandbox_in = rules(script, "sandbox_in")
    assert "tcp dport 18081-18083 ct status dnat ip saddr vmap @mitm_in_v4" in sandbox_in
    assert "tcp dport 18081-18083 ct status dnat ip6 saddr vmap @mitm_in_v6" in sandbox_in
    # No rule names the first worker's port alone: each port is judged the same way.
    assert not any("dport 18081 " in r for c in ("input", "sandbox_in") for r in rules(script, c))
    # A uid subject may not reach any worker port directly either.
    # (merged with the HTTP port 18080 into one span)
    assert "tcp dport { 15353, 16000-16512, 18080-18083 } goto uid_denied" in rules(script, "uid_local")


@pytest.mark.parametrize("fam,l3", [("v4", "ip"), ("v6", "ip6")])
def test_the_redirect_looks_the_port_up_and_a_miss_is_dropped(fam: str, l3: str) -> None:
    nat = rules(header_script(CFG, delete_existing=False), "nat")
    src = f"{l3} saddr @mitm_src_{fam} tcp dport {{ 80, 443 }}"
    i = nat.index(f"{src} redirect to :{l3} saddr map @mitm_port_{fam}")
    assert nat[i + 1] == f"{src} drop"
    assert not any("redirect to :18081" in r for r in nat)


def test_the_port_element_comes_and_goes_with_the_interception() -> None:
    ops = subject_keys(CFG, SUBJ).ops
    assert AddPort("mitm_port_v4", SUBJ.ip, 18083) in ops
    assert ops.index(AddPort("mitm_port_v4", SUBJ.ip, 18083)) < ops.index(AddElements("mitm_src_v4", (SUBJ.ip,)))
    create = subject_create(CFG, SUBJ).ops
    assert AddPort("mitm_port_v4", SUBJ.ip, 18083) in create  # the same one transaction
    deletes = dispatch_deletes(CFG, SUBJ.ip, release_gateway=None)
    assert deletes.index(DeleteElement("mitm_src_v4", SUBJ.ip)) < deletes.index(
        DeleteElement("mitm_port_v4", SUBJ.ip)
    )
    text = dispatch_entries(CFG, SUBJ)
    assert f"add map inet {T} mitm_port_v4 {{ type ipv4_addr : inet_service; elements = {{ 10.0.0.5 : 18083 }} }}" in text


def test_a_worker_without_a_port_is_refused() -> None:
    bad = SubjectNft("s_u_1", ip_address("10.0.0.5"), ip_address("10.0.0.1"), worker=3)
    with pytest.raises(ValueError, match="worker 3"):
        subject_keys(CFG, bad)
    with pytest.raises(ValueError):
        subject_create(CFG, bad)


def test_least_loaded_ties_go_to_the_lowest_index() -> None:
    assert least_loaded([0, 0, 0]) == 0
    assert least_loaded([1, 0, 0]) == 1
    assert least_loaded([2, 1, 1, 3]) == 1
    with pytest.raises(ValueError):
        least_loaded([])


def test_assignment_is_sticky_and_balanced() -> None:
    a = WorkerAssignment(2)
    assert [a.of(u) for u in ("a", "b", "c")] == [0, 1, 0]
    assert a.of("b") == 1 and a.of("a") == 0, "a subject keeps its worker"
    a.release("a")
    assert a.peek("a") is None and a.loads() == [1, 1]
    a.release("b")
    assert a.of("d") == 1, "the least loaded at the moment of assignment"
    a.release("never-assigned")
    with pytest.raises(ValueError):
        WorkerAssignment(0)


def test_uid_worker_partitions_by_slot() -> None:
    assert [uid_worker(s, 3) for s in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert all(uid_worker(s, 1) == 0 for s in range(5))
