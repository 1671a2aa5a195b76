"""The relayed-connection watch (docs/reference/behaviour.md §19): a passed-through TLS connection
whose name a policy change makes judged is reset; a silent egressd is never asked per connection
and resets nothing; a decision egressd cannot give resets (closed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from egressd.mitmchild import interception as mod
from egressd.mitmchild.interception import Interception
from egressd.mitmchild.names import NameAnswer


class Gate:
    def __init__(self) -> None:
        self.stamp_now: object = (1, 1)
        self.judged_names: set[str] = set()
        self.asked: list[str] = []
        self.fail = False

    def stamp(self, conn: object, client_ip: str | None) -> object:
        return self.stamp_now

    async def judged(self, conn: object, client_ip: str | None, name: str | None) -> bool:
        self.asked.append(name or "")
        if self.fail:
            raise OSError("egressd unreachable")
        return name in self.judged_names


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> tuple[Interception, Gate, list[str]]:
    resets: list[str] = []

    def reset(client: Any) -> bool:
        resets.append(client.id)
        return True

    monkeypatch.setattr(mod, "reset", reset)
    monkeypatch.setattr(mod, "emit", lambda *a, **k: None)
    gate = Gate()
    icp = Interception(SimpleNamespace(), SimpleNamespace(on_disconnect=[], enabled=False), gate)  # type: ignore[arg-type]
    return icp, gate, resets


DEST = ("203.0.113.10", 443)


def relay(icp: Interception, gate: Gate, cid: str, name: str | None) -> Any:
    client = SimpleNamespace(id=cid, connected=True)
    icp.relayed[cid] = (client, "10.0.0.2", name, gate.stamp(client, "10.0.0.2"), DEST)  # type: ignore[assignment]
    return client


async def test_a_name_judged_after_a_policy_change_is_reset_and_others_stay(watch: Any) -> None:
    icp, gate, resets = watch
    relay(icp, gate, "c1", "api.x.io")
    relay(icp, gate, "c2", "w.x.io")
    await icp.check_relayed()
    assert resets == [] and gate.asked == []  # the stamp did not move: nothing asked
    gate.judged_names.add("api.x.io")
    gate.stamp_now = (1, 2)
    await icp.check_relayed()
    assert resets == ["c1"]
    assert set(icp.relayed) == {"c2"} and icp.relayed["c2"][3] == (1, 2)
    await icp.check_relayed()
    assert gate.asked == ["api.x.io", "w.x.io"]  # once per change


async def test_a_silent_egressd_is_not_asked_and_resets_nothing(watch: Any) -> None:
    icp, gate, resets = watch
    relay(icp, gate, "c1", "api.x.io")
    gate.stamp_now = None  # the heartbeat is stale
    gate.fail = True
    for _ in range(3):
        await icp.check_relayed()
    assert gate.asked == [] and resets == [] and "c1" in icp.relayed
    gate.stamp_now = (2, 1)  # back (a restart: a new epoch) but its answer fails: closed
    await icp.check_relayed()
    assert resets == ["c1"] and not icp.relayed


async def test_closed_connections_are_forgotten(watch: Any) -> None:
    icp, gate, resets = watch
    client = relay(icp, gate, "c1", "api.x.io")
    client.connected = False
    gate.stamp_now = (1, 2)
    await icp.check_relayed()
    assert not icp.relayed and gate.asked == [] and resets == []


class Names:
    """The name gate's surface the watch uses: admits the names in ``allowed``."""

    def __init__(self, allowed: set[str | None]) -> None:
        self.enabled = True
        self.allowed = allowed
        self.asked: list[tuple[str, str | None, str, int]] = []

    async def ask(
        self, conn: object, ip: str | None, wire: str, name: str | None, dst: str, port: int
    ) -> NameAnswer:
        self.asked.append((wire, name, dst, port))
        return NameAnswer(True, None) if name in self.allowed else NameAnswer(False, "sni_not_allowed")


async def test_a_narrowing_that_takes_a_relayed_name_away_resets_it(watch: Any) -> None:
    """§18 with §14.1: a passed-through TLS connection whose SNI the new policy no longer
    admits at that address is reset once the stamp moves (the address may stay open for
    another name: the kernel's flow cut would keep it); one still admitted stays."""
    icp, gate, resets = watch
    names = Names({"a.cdn.test", "b.cdn.test"})
    icp.names = names
    relay(icp, gate, "c1", "a.cdn.test")
    relay(icp, gate, "c2", "b.cdn.test")
    await icp.check_relayed()
    assert names.asked == [] and resets == []  # no policy change: nothing asked
    names.allowed = {"b.cdn.test"}
    gate.stamp_now = (1, 2)
    await icp.check_relayed()
    assert resets == ["c1"] and set(icp.relayed) == {"c2"}
    assert names.asked == [("tls", "a.cdn.test", *DEST), ("tls", "b.cdn.test", *DEST)]


async def test_a_nameless_relay_is_watched_and_one_without_a_destination_goes(watch: Any) -> None:
    """TLS without SNI, admitted where an address rule opens the destination, is asked about
    again without a name; a relay whose destination is not known cannot be asked: it goes."""
    icp, gate, resets = watch
    icp.names = Names(set())
    icp._relaying(SimpleNamespace(id="c1", connected=True), "10.0.0.2", None, DEST)
    icp._relaying(SimpleNamespace(id="c2", connected=True), "10.0.0.2", "a.cdn.test", None)
    assert set(icp.relayed) == {"c1", "c2"}
    if icp._watch is not None:
        icp._watch.cancel()
    gate.stamp_now = (1, 2)
    await icp.check_relayed()
    assert sorted(resets) == ["c1", "c2"] and not icp.relayed
