"""Lease renewal on kernels where re-adding a timed set element does not extend it (issue 15
item 4): the renewal operations of both modes, the start-up probes of both profiles against
fake kernels of both kinds, and the control plane / sidecar engine using the mode."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from functools import partial

import pytest

from egressd.actionhandler.control import ControlPlane
from egressd.addr import IPAddress
from egressd.engine.selftest import SelfTestError, run_selftest
from egressd.fleetnft import selftest as fleet_selftest
from egressd.fleetnft.contents import dyn_add
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.selftest import selftest_probes as fleet_probes
from egressd.fleetnft.table import TableConfig
from egressd.kernel.applier import NftError
from egressd.kernel.netlink_dump import SetElement
from egressd.kernel.ops import AddSet, AddTimed, DeleteElement, NetlinkBatch
from egressd.kernel.renewal import PROBE_FIRST_S, LeaseRenewal, extended
from egressd.policy import parse_policy
from egressd.sidecar.engine import SidecarEngine
from egressd.sidecarnft import ruleset as sidecar_ruleset
from egressd.sidecarnft import selftest as sidecar_selftest
from egressd.sidecarnft.ruleset import SidecarTable
from egressd.sidecarnft.selftest import selftest_probes as sidecar_probes
from tests.unit.actionhandler.test_control_dns import FENCE, TABLE, activate
from tests.unit.fakekernel import FakeTx

A = ipaddress.ip_address("93.184.216.34")
B = ipaddress.ip_address("93.184.216.35")
C = ipaddress.ip_address("2606:2800::1")
LEASES: list[tuple[IPAddress, int]] = [(A, 90), (C, 60), (B, 360)]


# --------------------------------------------------------------------------- the operations


def test_fleet_renewal_ops_re_add() -> None:
    assert dyn_add("T", "n", LEASES) == NetlinkBatch(
        "T",
        (
            AddTimed("subj_n_dyn_v4", "v4", ((A, 90), (B, 360))),
            AddTimed("subj_n_dyn_v6", "v6", ((C, 60),)),
        ),
    )


def test_fleet_renewal_ops_delete_and_add_in_one_batch() -> None:
    v4 = AddTimed("subj_n_dyn_v4", "v4", ((A, 90), (B, 360)))
    v6 = AddTimed("subj_n_dyn_v6", "v6", ((C, 60),))
    assert dyn_add("T", "n", LEASES, replace=True) == NetlinkBatch(
        "T",
        (
            v4,  # first: every element exists, so no delete can fail on a missing/expired one
            DeleteElement("subj_n_dyn_v4", A),
            DeleteElement("subj_n_dyn_v4", B),
            v4,
            v6,
            DeleteElement("subj_n_dyn_v6", C),
            v6,
        ),
    )
    assert dyn_add("T", "n", [], replace=True) == NetlinkBatch("T", ())


def test_sidecar_renewal_script_re_add() -> None:
    table = SidecarTable(table="T", max_leases=0)
    assert sidecar_ruleset.dyn_add(table, [(A, 90), (C, 60)]) == (
        "add set inet T dyn_allow_v4 { type ipv4_addr; flags timeout; timeout 360s; "
        "elements = { 93.184.216.34 timeout 90s expires 90s } }\n"
        "add set inet T dyn_allow_v6 { type ipv6_addr; flags timeout; timeout 360s; "
        "elements = { 2606:2800::1 timeout 60s expires 60s } }\n"
    )


def test_sidecar_renewal_script_delete_and_add() -> None:
    table = SidecarTable(table="T", max_leases=0, renew_by_replace=True)
    declare = (
        "add set inet T dyn_allow_v4 { type ipv4_addr; flags timeout; timeout 360s; "
        "elements = { 93.184.216.34 timeout 90s expires 90s, 93.184.216.35 timeout 360s expires 360s } }"
    )
    script = sidecar_ruleset.dyn_add(table, [(A, 90), (B, 360)])
    assert script.splitlines() == [
        declare,
        "delete element inet T dyn_allow_v4 { 93.184.216.34, 93.184.216.35 }",
        declare,
    ]
    assert sidecar_ruleset.dyn_add(table, []) == ""


def test_extended() -> None:
    assert extended(PROBE_FIRST_S * 1000 + 1)
    assert not extended(PROBE_FIRST_S * 1000)
    assert not extended(None)


# --------------------------------------------------------------------------- fake kernels


@dataclass
class TimedKernel:
    """Timed sets as a kernel keeps them. ``readd_extends``: whether adding an existing element
    sets its new expiry (Linux >= 6.x) or leaves it (older kernels, e.g. 5.10). ``broken``:
    a delete does nothing (no way to renew at all)."""

    readd_extends: bool
    broken: bool = False
    sets: dict[str, dict[bytes, int]] = field(default_factory=dict)
    batches: int = 0

    def add(self, name: str, ip: IPAddress, seconds: int) -> None:
        elements = self.sets.setdefault(name, {})
        if ip.packed in elements and not self.readd_extends:
            return
        elements[ip.packed] = seconds * 1000

    def delete(self, name: str, ip: IPAddress) -> None:
        if self.broken or name not in self.sets:
            return  # not a set this fake models (the other probes' objects)
        if ip.packed not in self.sets[name]:
            raise NftError("netlink batch refused: No such file or directory")
        del self.sets[name][ip.packed]

    def batch(self, batch: NetlinkBatch) -> None:
        self.batches += 1
        for op in batch.ops:
            if isinstance(op, AddSet):
                self.sets.setdefault(op.name, {})
            elif isinstance(op, AddTimed):
                for ip, seconds in op.leases:
                    self.add(op.name, ip, seconds)
            elif isinstance(op, DeleteElement):
                self.delete(op.name, op.key)

    _DECL = re.compile(r"^add set inet \S+ (\S+) \{.* elements = \{ (.*) \} \}$")
    _DEL = re.compile(r"^delete element inet \S+ (\S+) \{ (.*) \}$")

    def script(self, text: str) -> None:
        """The two script shapes the sidecar's lease path writes; anything else is accepted."""
        for line in text.splitlines():
            # Port-scoped sets (addr . proto . port) are not the lease shape this models.
            if (m := self._DECL.match(line)) and " timeout " in m.group(2) and "inet_proto" not in line:
                for el in m.group(2).split(", "):
                    ip, _, seconds = el.split(" ")[:3]
                    self.add(m.group(1), ipaddress.ip_address(ip), int(seconds.rstrip("s")))
            elif m := self._DEL.match(line):
                for key in m.group(2).split(", "):
                    self.delete(m.group(1), ipaddress.ip_address(key))

    def elements(self, table: str, name: str) -> list[SetElement]:
        return [SetElement(k, timeout_ms=v, expires_ms=v) for k, v in self.sets.get(name, {}).items()]


# --------------------------------------------------------------------------- the probes


@pytest.mark.parametrize(("readd", "mode"), [(True, LeaseRenewal.READD), (False, LeaseRenewal.REPLACE)])
def test_fleet_probe_finds_the_kernels_renewal(readd: bool, mode: LeaseRenewal) -> None:
    k = TimedKernel(readd_extends=readd)
    assert fleet_selftest.probe_lease_renewal(k.batch, k.elements, "scratch") is mode


@pytest.mark.parametrize(("readd", "mode"), [(True, LeaseRenewal.READD), (False, LeaseRenewal.REPLACE)])
def test_sidecar_probe_finds_the_kernels_renewal(readd: bool, mode: LeaseRenewal) -> None:
    k = TimedKernel(readd_extends=readd)
    assert sidecar_selftest.probe_lease_renewal(k.script, k.elements, "scratch") is mode


def test_probes_refuse_a_kernel_that_cannot_renew() -> None:
    k = TimedKernel(readd_extends=False, broken=True)
    with pytest.raises(SelfTestError, match="timed set element renewal"):
        fleet_selftest.probe_lease_renewal(k.batch, k.elements, "scratch")
    with pytest.raises(SelfTestError, match="timed set element renewal"):
        sidecar_selftest.probe_lease_renewal(k.script, k.elements, "scratch")


@pytest.mark.parametrize("readd", [True, False])
def test_fleet_run_selftest_returns_the_mode_and_drops_its_table(readd: bool) -> None:
    k = TimedKernel(readd_extends=readd)
    scripts: list[str] = []
    mode = run_selftest(
        scripts.append,
        NftError,
        "t",
        partial(fleet_probes, cmd=scripts.append, batch=k.batch, elements=k.elements),
    )
    assert mode is (LeaseRenewal.READD if readd else LeaseRenewal.REPLACE)
    assert scripts[-1].startswith("delete table inet t-selftest-")


@pytest.mark.parametrize("readd", [True, False])
def test_sidecar_run_selftest_returns_the_mode_and_drops_its_table(readd: bool) -> None:
    k = TimedKernel(readd_extends=readd)
    scripts: list[str] = []

    def cmd(text: str) -> None:
        scripts.append(text)
        k.script(text)

    mode = run_selftest(
        cmd, NftError, "t", partial(sidecar_probes, cmd=cmd, elements=k.elements, dns_port=15353)
    )
    assert mode is (LeaseRenewal.READD if readd else LeaseRenewal.REPLACE)
    assert scripts[-1].endswith("delete table inet t-selftest-" + scripts[-1].rsplit("-", 1)[1])


def test_a_failing_read_back_refuses_start_up() -> None:
    k = TimedKernel(readd_extends=True)

    def no_dump(table: str, name: str) -> list[SetElement]:
        raise NftError("set element dump refused: Operation not permitted")

    def nothing(script: str) -> None:
        pass

    with pytest.raises(SelfTestError, match="timed set element renewal"):
        run_selftest(
            nothing, NftError, "t", partial(fleet_probes, cmd=nothing, batch=k.batch, elements=no_dump)
        )
    with pytest.raises(SelfTestError, match="timed set element renewal"):
        run_selftest(
            nothing, NftError, "t", partial(sidecar_probes, cmd=nothing, elements=no_dump, dns_port=15353)
        )


# --------------------------------------------------------------------------- the daemon uses it


async def test_control_plane_renews_by_delete_and_add_when_told() -> None:
    tx = FakeTx()
    control = ControlPlane(FleetPlanKernel(TableConfig(table=TABLE, renew_by_replace=True), tx))
    await control.reset_table()
    await activate(control)
    tx.clear()
    await control.learn("u-1", FENCE, [(A, 90)], "www.example.com")
    await control.renew_leases("u-1", [A], 360)
    learned, renewed = tx.ops("dynamic_add")
    assert learned == dyn_add(TABLE, "s_u_1", [(A, 90)], replace=True)
    assert renewed == dyn_add(TABLE, "s_u_1", [(A, 360)], replace=True)
    assert any(isinstance(op, DeleteElement) for op in renewed.ops)


async def test_control_plane_re_adds_by_default() -> None:
    tx = FakeTx()
    control = ControlPlane(FleetPlanKernel(TableConfig(table=TABLE), tx))
    await control.reset_table()
    await activate(control)
    tx.clear()
    await control.renew_leases("u-1", [A], 360)
    assert tx.ops("dynamic_add") == []  # never taught by a name: not renewed (14.1)
    await control.learn("u-1", FENCE, [(A, 90)], "www.example.com")
    await control.renew_leases("u-1", [A], 360)
    assert tx.ops("dynamic_add")[-1] == dyn_add(TABLE, "s_u_1", [(A, 360)])


@dataclass
class ScriptKernel:
    scripts: list[str] = field(default_factory=list)

    async def run_script(self, script: str, *, op: str) -> None:
        self.scripts.append(script)


@pytest.mark.parametrize("replace", [False, True])
async def test_sidecar_engine_uses_the_mode(replace: bool) -> None:
    kernel = ScriptKernel()
    policy = parse_policy('{"egress":[{"action":"allow","target":"www.example.com"}]}')
    engine = SidecarEngine(SidecarTable(table="T", renew_by_replace=replace), kernel, policy)
    await engine.install()
    await engine.learn("sidecar", engine.fence, [(A, 90)], "www.example.com")
    await engine.learn("sidecar", engine.fence, [(A, 360)], None)  # the refresh
    learned, renewed = kernel.scripts[1:]
    assert ("delete element inet T dyn_allow_v4 { 93.184.216.34 }" in renewed) is replace
    assert learned == sidecar_ruleset.dyn_add(engine.table, [(A, 90)])
