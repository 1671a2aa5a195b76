"""Host-uid subjects (docs/behaviour.md §17) in the control plane, against the shared fake kernel.

A SET_BINDING with ``attachment.process.uid`` keys its subject by host uid: the same objects,
rules and set contents as a network subject, reached through the uid maps, with a slot that
names its own DNS (and MITM) port. The registry, fences, deny-first, activation and vault work
as for network subjects; both kinds coexist.
"""

from __future__ import annotations

import json
from ipaddress import ip_address
from typing import Any

import pytest

from egressd.actionhandler.api import Result
from egressd.actionhandler.control import ControlPlane
from egressd.actionhandler.envelope import API_VERSION, SetBinding, parse_action
from egressd.feed import VaultChanged
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.subject.hostuid import UidPorts, UidRange
from egressd.subject.registry import HostBinding, State
from tests.unit.actionhandler.test_control import POLICY_A, hook, remove, set_binding
from tests.unit.fakekernel import TextKernel, text_kernel

TABLE = "T"
PORTS = UidPorts(UidRange(100000, 165535), 16000, 4)
A, B = 100001, 100002
WIDEST = UidRange(1, 2**32 - 2)
AUDIT = '{"defaultAction":"deny","mode":"audit","egress":[{"action":"allow","target":"8.8.8.8"}]}'


def uid_binding(
    uid: str = "u-1",
    host_uid: int | None = A,
    policy: object = POLICY_A,
    *,
    rid: str = "r1",
    aid: str = "a1",
    envelope_range: UidRange = WIDEST,
) -> SetBinding:
    """The envelope parser's range is the widest: the control plane must check its own."""
    doc: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "operation": "SET_BINDING",
        "sandbox": {"uid": uid},
        "revision": {"specGeneration": 1, "runtimeInstanceId": rid, "attachmentId": aid},
        "binding": {"input": policy},
    }
    if host_uid is not None:
        doc["attachment"] = {"process": {"uid": host_uid}}
    action = parse_action(json.dumps(doc).encode(), uid_range=envelope_range)
    assert isinstance(action, SetBinding)
    return action


class Ports:
    """The DNS listeners the control plane asks for (DnsListeners), recorded."""

    def __init__(self) -> None:
        self.listening: set[int] = set()
        self.events: list[str] = []
        self.refuse: set[int] = set()

    async def open(self, slot: int) -> None:
        if slot in self.refuse:
            raise OSError(98, "Address already in use")
        self.events.append(f"open {slot}")
        self.listening.add(slot)

    async def close(self, slot: int) -> None:
        self.events.append(f"close {slot}")
        self.listening.discard(slot)


async def make(
    *, mitm: bool = False, own_uid: int | None = None, ports: UidPorts = PORTS
) -> tuple[ControlPlane, TextKernel, Ports]:
    kernel = text_kernel(TABLE)
    table = TableConfig(table=TABLE, mitm=mitm, uids=ports, own_uid=own_uid)
    control = ControlPlane(FleetPlanKernel(table, kernel))
    await control.reset_table()
    listeners = Ports()
    control.uid_ports.ports = listeners
    return control, kernel, listeners


def ok(result: Result) -> None:
    assert result == Result(200), result


def uid_elements(kernel: TextKernel) -> dict[str, dict[str, str]]:
    names = ("uid_dispatch", "uid_marking", "uid_dns", "uid_dns_own", "uid_audit", "uid_mitm", "uid_mitm_in")
    return {n: kernel.elements(n) for n in names if kernel.elements(n)}


# ---------------------------------------------------------------------------------------------


async def test_deny_first_keys_the_uid_and_opens_its_dns_port_first() -> None:
    control, kernel, ports = await make()
    ok(await control.handle(uid_binding()))
    e = control.registry.get("u-1")
    assert e is not None and e.state is State.DENYING
    assert e.binding == HostBinding(A, 0)
    assert uid_elements(kernel) == {
        "uid_dispatch": {"100001": "jump subj_s_u_1"},
        "uid_marking": {"100001": "jump mark_s_u_1"},
        "uid_dns": {"100001": "16000"},
        "uid_dns_own": {"100001 . 16000": ""},
    }
    assert kernel.elements("dispatch_v4") == {} and kernel.elements("sandboxes_v4") == {}
    assert kernel.has_chain("subj_s_u_1") and kernel.has_chain("mark_s_u_1")
    assert ports.events == ["open 0"]
    assert control.registry.kernel("u-1").uid_keys == frozenset({(A, 0)})
    # Deny-first: the DNS port answers as denying, the sets are empty.
    asker = control.learning.asker_for_slot(0)
    assert asker is not None and asker.uid == "u-1" and asker.policy is None
    assert kernel.elements("subj_s_u_1_allow_v4") == {}


async def test_activation_fills_the_same_sets_and_the_port_knows_the_policy() -> None:
    control, kernel, _ = await make()
    names = '{"defaultAction":"deny","egress":[{"action":"allow","target":"8.8.8.8"},{"action":"allow","target":"dns.google"}]}'
    ok(await control.handle(uid_binding(policy=names)))
    ok(await control.handle(hook()))
    assert kernel.elements("subj_s_u_1_allow_v4") == {"8.8.8.8": ""}
    asker = control.learning.asker_for_slot(0)
    assert asker is not None and asker.policy is not None
    assert control.learning.asker_for_slot(1) is None, "a port nobody holds: an unknown source"
    # DNS learning goes to the subject's dyn sets as for a network subject.
    learned = await control.learn("u-1", asker.fence, [(ip_address("8.8.4.4"), 60)], "dns.google")
    assert learned == [ip_address("8.8.4.4")]
    assert "8.8.4.4" in kernel.elements("subj_s_u_1_dyn_v4")


async def test_two_subjects_get_their_own_slots_and_a_freed_slot_is_reused() -> None:
    control, kernel, ports = await make()
    ok(await control.handle(uid_binding("u-1", A)))
    ok(await control.handle(uid_binding("u-2", B)))
    assert kernel.elements("uid_dns") == {"100001": "16000", "100002": "16001"}
    ok(await control.handle(remove("u-1")))
    assert ports.listening == {1}
    ok(await control.handle(uid_binding("u-3", 100003)))
    e = control.registry.get("u-3")
    assert e is not None and e.binding == HostBinding(100003, 0)


async def test_a_host_uid_is_one_subject_at_a_time() -> None:
    control, _, _ = await make()
    ok(await control.handle(uid_binding("u-1", A)))
    result = await control.handle(uid_binding("u-2", A))
    assert result.status == 409 and "host uid 100001" in result.reason
    assert control.registry.get("u-2") is None


async def test_concurrent_claims_of_one_host_uid() -> None:
    import asyncio

    control, kernel, _ = await make()
    kernel.hold()
    first = asyncio.create_task(control.handle(uid_binding("u-1", A)))
    await kernel.entered.wait()
    second = await control.handle(uid_binding("u-2", A))
    assert second.status == 409
    kernel.release()
    ok(await first)


async def test_range_and_own_uid_are_this_daemons() -> None:
    narrow = UidPorts(UidRange(200000, 200010), 16000, 4)
    control, _, _ = await make(ports=narrow, own_uid=200005)
    result = await control.handle(uid_binding(host_uid=A))  # inside the envelope's default range
    assert result.status == 400 and "outside EGRESSD_UID_RANGE 200000-200010" in result.reason
    result = await control.handle(uid_binding(host_uid=200005))
    assert result.status == 400 and "egressd's own uid" in result.reason
    ok(await control.handle(uid_binding(host_uid=200001)))


async def test_no_free_slot_is_409() -> None:
    control, _, _ = await make(ports=UidPorts(UidRange(100000, 165535), 16000, 1))
    ok(await control.handle(uid_binding("u-1", A)))
    result = await control.handle(uid_binding("u-2", B))
    assert result.status == 409 and "EGRESSD_UID_MAX_SUBJECTS=1" in result.reason


async def test_a_dns_port_that_cannot_be_bound_fails_closed() -> None:
    control, kernel, ports = await make()
    ports.refuse.add(0)
    result = await control.handle(uid_binding())
    assert result.status == 500 and "host-uid DNS port 16000" in result.reason
    assert uid_elements(kernel) == {}, "no redirect towards a port nobody listens on"
    e = control.registry.get("u-1")
    assert e is not None and e.state is State.DENYING and e.pending is None
    ports.refuse.clear()
    ok(await control.handle(uid_binding()))  # the retry, same slot
    assert kernel.elements("uid_dns") == {"100001": "16000"}


async def test_audit_mode_lists_the_uid_and_leaving_it_unlists() -> None:
    control, kernel, _ = await make()
    ok(await control.handle(uid_binding(policy=AUDIT)))
    assert kernel.elements("uid_audit") == {}, "deny-first never audits"
    ok(await control.handle(hook()))
    assert kernel.elements("uid_audit") == {"100001": ""}
    ok(await control.handle(uid_binding(policy=POLICY_A)))  # in place, enforcing again
    assert kernel.elements("uid_audit") == {}
    ok(await control.handle(uid_binding(policy=AUDIT)))
    assert kernel.elements("uid_audit") == {"100001": ""}
    ok(await control.handle(uid_binding(policy=None)))  # revert to deny-first
    assert kernel.elements("uid_audit") == {}


@pytest.mark.parametrize("mitm", [False, True])
async def test_remove_binding_leaves_nothing(mitm: bool) -> None:
    control, kernel, ports = await make(mitm=mitm)
    before = {n: kernel.elements(n) for n in kernel.table.set_names()}
    ok(await control.handle(uid_binding(policy=AUDIT)))
    ok(await control.handle(hook()))
    if mitm:
        assert kernel.elements("uid_mitm") == {"100001": "16005"}
        assert kernel.elements("uid_mitm_in") == {"100001 . 16005": "jump subj_s_u_1_in"}
    ok(await control.handle(remove()))
    assert uid_elements(kernel) == {}
    assert kernel.subject_objects("s_u_1") == []
    assert {n: kernel.elements(n) for n in kernel.table.set_names()} == before
    assert ports.listening == set() and ports.events == ["open 0", "close 0"]
    assert control.registry.get("u-1") is None and control.registry.kernel("u-1").uid_keys == frozenset()


async def test_rebind_keeps_the_slot_and_rekey_moves_the_uid() -> None:
    control, kernel, ports = await make()
    ok(await control.handle(uid_binding()))
    ok(await control.handle(hook()))
    ok(await control.handle(uid_binding(rid="r2")))  # a new fence: deny-first again, same port
    e = control.registry.get("u-1")
    assert e is not None and e.state is State.DENYING and e.binding == HostBinding(A, 0)
    ok(await control.handle(hook(rid="r2")))
    ok(await control.handle(uid_binding(host_uid=B, rid="r2")))  # same fence, another uid
    assert kernel.elements("uid_dispatch") == {"100002": "jump subj_s_u_1"}
    assert kernel.elements("uid_dns_own") == {"100002 . 16000": ""}
    assert ports.listening == {0} and "close 0" not in ports.events
    e = control.registry.get("u-1")
    assert e is not None and e.state is State.ACTIVE and e.binding == HostBinding(B, 0)
    assert control.registry.resolve_host_uid(A) is None


async def test_network_and_uid_subjects_coexist_and_rekey_across_kinds() -> None:
    control, kernel, ports = await make()
    ok(await control.handle(set_binding("net", ip="10.0.0.5")))
    ok(await control.handle(uid_binding("host", A)))
    assert kernel.elements("dispatch_v4") == {"10.0.0.5": "jump subj_s_net"}
    assert kernel.elements("uid_dispatch") == {"100001": "jump subj_s_host"}
    # The network sandbox becomes a host-uid one (same fence): its address leaves the maps.
    ok(await control.handle(uid_binding("net", B)))
    assert kernel.elements("dispatch_v4") == {} and kernel.elements("sandboxes_v4") == {}
    assert kernel.elements("uid_dispatch") == {"100001": "jump subj_s_host", "100002": "jump subj_s_net"}
    # And back: the uid and its port go.
    ok(await control.handle(set_binding("net", ip="10.0.0.6")))
    assert kernel.elements("uid_dispatch") == {"100001": "jump subj_s_host"}
    assert ports.listening == {0}


async def test_vault_by_mitm_port_and_forget_by_port_key() -> None:
    control, _, _ = await make(mitm=True)
    forgotten: list[list[Any]] = []
    control.feed.subscribe(lambda e: forgotten.append(list(e.clients or ())) if isinstance(e, VaultChanged) else None)
    ok(
        await control.handle(
            uid_binding(
                policy='{"defaultAction":"deny","egress":[{"action":"allow","target":"api.example.com"}]}'
            )
        )
    )
    ok(await control.handle(hook()))
    store_doc = {
        "credentials": [{"name": "k", "source": {"type": "inline", "value": "v-1"}}],
        "bindings": [
            {
                "name": "b",
                "match": {"hosts": ["api.example.com"]},
                "auth": {"type": "bearer", "credential": "k"},
            }
        ],
    }
    from egressd.vault.store import VaultStore

    coverage = control.credentials.coverage_policy("u-1")
    store = VaultStore()
    assert store.put(store_doc, coverage)[0] == 201
    control.vaults["u-1"] = store
    assert control.credentials.vault_for_mitm_port(PORTS.mitm_port(0)) is not None
    assert control.credentials.vault_for_mitm_port(PORTS.mitm_port(1)) is None
    assert control.vault_for_ip(ip_address("10.0.0.5")) is None
    ok(await control.handle(remove()))
    assert ["port:16005"] in forgotten
    assert control.credentials.vault_for_mitm_port(PORTS.mitm_port(0)) is None


async def test_describe_and_explain_name_the_host_uid() -> None:
    control, _, _ = await make(mitm=True)
    ok(await control.handle(uid_binding()))
    ok(await control.handle(hook()))
    [row] = control.report.describe()
    assert row["hostUid"] == A and row["dnsPort"] == 16000 and row["mitmPort"] == 16005
    assert row["sourceIp"] is None
    doc = control.report.explain(A, "8.8.8.8")
    assert doc["subject"] == "s-u-1" and doc["hostUid"] == A and doc["decision"] == "allow"
    assert control.report.explain(B, "8.8.8.8").get("subject") is None
    view = await control.report.kernel_membership(A, ip_address("8.8.8.8"))
    assert view["available"] and view["dispatched"]
    assert [s["set"] for s in view["sets"]] == ["subj_s_u_1_allow_v4"]
    assert not (await control.report.kernel_membership(B, ip_address("8.8.8.8")))["dispatched"]


async def test_host_uid_subjects_for_the_refresh() -> None:
    control, _, _ = await make()
    ok(await control.handle(uid_binding("u-1", A)))
    ok(await control.handle(set_binding("net", ip="10.0.0.5")))
    assert control.learning.host_uid_subjects() == {A: "u-1"}
