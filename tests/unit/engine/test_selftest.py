"""The self-test runner both profiles share (egressd.engine.selftest), on a scripted kernel, and
what each backend counts as a missing feature; the probes against fake kernels are in
tests/unit/kernel/test_renewal.py, against real ones in the kernel tests."""

from __future__ import annotations

import os
from functools import partial

import pytest

from egressd.engine.selftest import Probe, Probes, SelfTestError, run_selftest, scratch_table
from egressd.fleetnft.selftest import selftest_probes as fleet_probes
from egressd.kernel.applier import NftError
from egressd.sidecarnft.selftest import selftest_probes as sidecar_probes


class Refused(Exception):
    """The fake nft error."""


class Kernel:
    """Records every step; ``fail`` maps a step to the exception it raises."""

    def __init__(self, **fail: Exception) -> None:
        self.fail = fail
        self.steps: list[str] = []

    def cmd(self, script: str) -> None:
        self.step(script.replace(scratch_table("p"), "T"))

    def step(self, name: str) -> None:
        self.steps.append(name)
        if name in self.fail:
            raise self.fail[name]

    def verdict(self) -> str:
        self.step("verdict")
        return "re-add"

    def probes(self, t: str) -> Probes[str]:
        assert t == scratch_table("p")
        return Probes(
            features=[
                Probe("setup", partial(self.step, "setup"), ()),
                Probe("scripts", partial(self.step, "scripts"), Refused),
                Probe("batches", partial(self.step, "batches"), Exception),
            ],
            verdict=Probe("renewal", self.verdict, Refused),
            cleanup="delete T",
        )

    def run(self) -> str:
        return run_selftest(self.cmd, Refused, "p", self.probes)


USABLE = "add table inet T\ndelete table inet T"


def test_every_probe_in_order_then_the_verdict_then_the_cleanup() -> None:
    k = Kernel()
    assert k.run() == "re-add"
    assert k.steps == [USABLE, "setup", "scripts", "batches", "verdict", "delete T"]
    assert scratch_table("p") == f"p-selftest-{os.getpid()}"


def test_an_unusable_namespace_refuses_before_any_probe_and_leaves_nothing_to_delete() -> None:
    k = Kernel(**{USABLE: Refused("Operation not permitted")})
    with pytest.raises(SelfTestError) as err:
        k.run()
    assert (
        str(err.value) == "nftables unusable in this namespace (need CAP_NET_ADMIN): Operation not permitted"
    )
    assert k.steps == [USABLE]


@pytest.mark.parametrize(
    ("step", "exc", "message"),
    [
        (
            "scripts",
            Refused("No such file or directory"),
            "kernel feature missing: scripts: No such file or directory",
        ),
        ("batches", ValueError("bad"), "kernel feature missing: batches: bad"),
        ("verdict", Refused("dump refused"), "kernel feature missing: renewal: dump refused"),
    ],
)
def test_a_missing_feature_refuses_in_one_line_and_the_table_is_deleted(
    step: str, exc: Exception, message: str
) -> None:
    k = Kernel(**{step: exc})
    with pytest.raises(SelfTestError) as err:
        k.run()
    assert str(err.value) == message
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert k.steps[-1] == "delete T"
    assert k.steps.index(step) == len(k.steps) - 2  # nothing after the failed probe but the cleanup


@pytest.mark.parametrize(
    ("step", "exc"), [("setup", Refused("x")), ("scripts", ValueError("x")), ("verdict", KeyError("x"))]
)
def test_a_failure_that_is_no_missing_feature_goes_up_as_it_is(step: str, exc: Exception) -> None:
    k = Kernel(**{step: exc})
    with pytest.raises(type(exc)):
        k.run()
    assert k.steps[-1] == "delete T"


def test_a_probes_own_refusal_goes_up_unwrapped() -> None:
    k = Kernel(verdict=SelfTestError("kernel feature missing: timed set element renewal (neither ...)"))
    with pytest.raises(SelfTestError) as err:
        k.run()
    assert str(err.value) == "kernel feature missing: timed set element renewal (neither ...)"


def test_a_failing_cleanup_is_ignored_and_the_refusal_kept() -> None:
    k = Kernel(scripts=Refused("nope"), **{"delete T": Refused("busy")})
    with pytest.raises(SelfTestError, match="kernel feature missing: scripts: nope"):
        k.run()
    assert Kernel(**{"delete T": Refused("busy")}).run() == "re-add"


# --------------------------------------------------------------------------- the backends' probes


def _noop(*args: object) -> None:
    return None


def test_the_fleets_probes_scripts_then_netlink_batches() -> None:
    probes = fleet_probes("t", _noop, _noop, lambda table, name: [])
    assert [(p.feature, p.missing) for p in probes.features][:2] == [
        ("table creation", NftError),
        ("regular chains", NftError),
    ]
    batches = [p for p in probes.features if p.feature.startswith("netlink")]
    assert batches == probes.features[-len(batches) :]  # after every script
    assert {p.missing for p in batches} == {Exception}
    assert [p.feature for p in batches][-2:] == ["netlink delete batches", "netlink delete batches"]
    assert (probes.verdict.feature, probes.verdict.missing) == ("timed set element renewal", Exception)
    assert probes.cleanup == "delete table inet t"


def test_the_sidecars_probes_scripts_only() -> None:
    probes = sidecar_probes("t", _noop, lambda table, name: [], dns_port=15353)
    first, *scripts = probes.features
    assert first.missing == ()  # the table the usability try just made: no feature of its own
    assert {p.missing for p in scripts} == {NftError}
    assert scripts[0].feature == "interval sets"
    assert (probes.verdict.feature, probes.verdict.missing) == ("timed set element renewal", NftError)
    assert probes.cleanup == "add table inet t\ndelete table inet t"
