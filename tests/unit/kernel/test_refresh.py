"""§9 connection refresh: conntrack parsing, the renewal plan and LeaseRefresher.tick."""

from __future__ import annotations

import ipaddress
import time
from pathlib import Path

import pytest

from egressd.addr import IPAddress
from egressd.kernel.refresh import (
    ACTIVE_TCP_STATES,
    RENEW_S,
    LeaseRefresher,
    RefreshPlan,
    parse_conntrack,
    plan_refresh,
)
from egressd.subject.leases import Lease, LeaseBook


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


def tcp4(src: str, dst: str, state: str = "ESTABLISHED", *, reply_src: str | None = None) -> str:
    """A /proc/net/nf_conntrack line for an IPv4 TCP flow (reply tuple NATed when reply_src given)."""
    rsrc = reply_src or dst
    unreplied = " [UNREPLIED]" if state == "SYN_SENT" else ""
    assured = " [ASSURED]" if state == "ESTABLISHED" else ""
    return (
        f"ipv4     2 tcp      6 431999 {state} src={src} dst={dst} sport=43210 dport=443{unreplied} "
        f"src={rsrc} dst={src} sport=443 dport=43210{assured} mark=2 zone=0 use=2"
    )


def tcp6(src: str, dst: str, state: str = "ESTABLISHED") -> str:
    return (
        f"ipv6     10 tcp      6 299 {state} src={src} dst={dst} sport=51000 dport=443 "
        f"src={dst} dst={src} sport=443 dport=51000 [ASSURED] mark=0 zone=0 use=2"
    )


def udp4(src: str, dst: str) -> str:
    return (
        f"ipv4     2 udp      17 29 src={src} dst={dst} sport=5353 dport=443 "
        f"src={dst} dst={src} sport=443 dport=5353 [ASSURED] mark=0 zone=0 use=2"
    )


# --------------------------------------------------------------------------- parse_conntrack


def test_parse_conntrack_realistic_lines() -> None:
    lines = [
        tcp4("10.0.0.5", "93.184.216.34"),
        tcp4("10.0.0.5", "151.101.1.69", "SYN_SENT"),
        tcp4("10.0.0.5", "140.82.112.3", "TIME_WAIT"),
        tcp4("10.0.0.5", "140.82.112.4", "CLOSE"),
        tcp4("10.0.0.6", "1.1.1.1", "FIN_WAIT"),
        tcp6("fd00::5", "2606:2800:220:1:248:1893:25c8:1946"),
        tcp6("fd00::5", "2001:db8::dead", "TIME_WAIT"),
        udp4("10.0.0.5", "8.8.8.8"),  # QUIC / DNS: never renewed
        "ipv4     2 icmp     1 29 src=10.0.0.5 dst=9.9.9.9 type=8 code=0 id=1 src=9.9.9.9 dst=10.0.0.5 "
        "type=0 code=0 id=1 mark=0 zone=0 use=2",
    ]
    assert parse_conntrack(lines) == {
        ip("10.0.0.5"): {ip("93.184.216.34"), ip("151.101.1.69")},
        ip("10.0.0.6"): {ip("1.1.1.1")},
        ip("fd00::5"): {ip("2606:2800:220:1:248:1893:25c8:1946")},
    }


@pytest.mark.parametrize("state", sorted(ACTIVE_TCP_STATES))
def test_every_active_state_counts(state: str) -> None:
    assert parse_conntrack([tcp4("10.0.0.5", "1.2.3.4", state)]) == {ip("10.0.0.5"): {ip("1.2.3.4")}}


@pytest.mark.parametrize("state", ["TIME_WAIT", "CLOSE", "NONE", "SYN_SENT2", "LISTEN"])
def test_inactive_states_are_ignored(state: str) -> None:
    assert parse_conntrack([tcp4("10.0.0.5", "1.2.3.4", state)]) == {}


def test_active_state_set_is_the_specified_one() -> None:
    assert (
        frozenset({"ESTABLISHED", "SYN_SENT", "SYN_RECV", "FIN_WAIT", "CLOSE_WAIT", "CLOSING", "LAST_ACK"})
        == ACTIVE_TCP_STATES
    )


def test_original_tuple_is_the_first_src_and_dst() -> None:
    # DNATed to the MITM: the reply tuple comes from the gateway, the original dst is what counts.
    line = tcp4("10.0.0.5", "93.184.216.34", reply_src="10.0.0.1")
    assert parse_conntrack([line]) == {ip("10.0.0.5"): {ip("93.184.216.34")}}


def test_ipv4_mapped_addresses_are_unmapped() -> None:
    assert parse_conntrack([tcp6("::ffff:10.0.0.5", "::ffff:1.2.3.4")]) == {ip("10.0.0.5"): {ip("1.2.3.4")}}


@pytest.mark.parametrize(
    "line",
    [
        "",
        "garbage",
        "ipv4 2 tcp 6",
        "ipv4     2 tcp      6 431999 ESTABLISHED sport=1 dport=2",
        "ipv4     2 tcp      6 431999 ESTABLISHED src=10.0.0.5 sport=1 dport=2",
        "ipv4     2 tcp      6 431999 ESTABLISHED src=not-an-ip dst=1.2.3.4 sport=1 dport=2",
        "ipv4     2 tcp      6 431999 ESTABLISHED src=10.0.0.5 dst=1.2.3 sport=1 dport=2",
    ],
)
def test_malformed_lines_are_skipped(line: str) -> None:
    assert parse_conntrack([line, tcp4("10.0.0.7", "5.5.5.5")]) == {ip("10.0.0.7"): {ip("5.5.5.5")}}


def test_several_flows_to_one_destination_collapse() -> None:
    lines = [tcp4("10.0.0.5", "1.2.3.4"), tcp4("10.0.0.5", "1.2.3.4", "CLOSE_WAIT")]
    assert parse_conntrack(lines) == {ip("10.0.0.5"): {ip("1.2.3.4")}}


# --------------------------------------------------------------------------- plan_refresh

NOW = 1000.0
A_, B_, C_, D_, E_ = (ip(f"93.184.216.{i}") for i in range(1, 6))


def test_plan_renews_active_tracked_addresses() -> None:
    mirror = {
        A_: NOW + 100,  # active now -> renew
        B_: NOW - 5,  # active last tick only -> renew once
        C_: NOW - 5,  # inactive -> not renewed
        D_: NOW + 100,  # live, inactive -> not renewed
        E_: NOW - 1,  # active now -> renew
    }
    untracked = ip("8.8.8.8")
    plan = plan_refresh(mirror, {A_, E_, untracked}, {B_, untracked})
    assert set(plan.renew) == {A_, B_, E_}
    assert untracked not in plan.renew


def test_plan_never_renews_untracked_addresses() -> None:
    plan = plan_refresh({}, {A_, B_}, {C_})
    assert plan == RefreshPlan(())


def test_plan_is_deterministic() -> None:
    mirror = {ip("10.0.0.9"): NOW + 1, ip("10.0.0.10"): NOW + 1, ip("1.1.1.1"): NOW + 1}
    plan = plan_refresh(mirror, set(mirror), set())
    assert plan.renew == tuple(sorted(mirror, key=str))


def test_plan_does_not_mutate_its_inputs() -> None:
    mirror = {A_: NOW - 1}
    now_set, last_set = {B_}, {C_}
    plan_refresh(mirror, now_set, last_set)
    assert mirror == {A_: NOW - 1} and now_set == {B_} and last_set == {C_}


# --------------------------------------------------------------------------- LeaseRefresher


class Renewals:
    def __init__(self, fail_for: set[str] | None = None) -> None:
        self.calls: list[tuple[str, list[IPAddress], int]] = []
        self.fail_for = fail_for or set()

    async def __call__(self, uid: str, ips: list[IPAddress], seconds: int) -> None:
        self.calls.append((uid, sorted(ips, key=str), seconds))
        if uid in self.fail_for:
            raise RuntimeError("nft refused")


SUBJECTS = {ip("10.0.0.5"): "u-1", ip("10.0.0.6"): "u-2", ip("fd00::5"): "u-1"}


def book(mirror: dict[IPAddress, float]) -> LeaseBook:
    """A lease book holding ``mirror`` (ip -> expiry), each lease taught by one name."""
    out = LeaseBook()
    for addr, expiry in mirror.items():
        out._leases[addr] = Lease(expiry, {"x.test": expiry})
    out._next_end = 0.0  # filled behind the book's back: let the next expire() walk it
    return out


def make(
    path: Path, leases: dict[str, dict[IPAddress, float]], renew: Renewals, **kw: object
) -> LeaseRefresher:
    books = {uid: book(m) for uid, m in leases.items()}
    return make_books(path, books, renew, **kw)


def make_books(path: Path, books: dict[str, LeaseBook], renew: Renewals, **kw: object) -> LeaseRefresher:
    return LeaseRefresher(SUBJECTS.get, books, renew, path=path, **kw)  # type: ignore[arg-type]


def later(seconds: float = 300.0) -> float:
    return time.monotonic() + seconds


def expired() -> float:
    return time.monotonic() - 10.0


async def test_tick_renews_one_call_per_subject(tmp_path: Path) -> None:
    path = tmp_path / "nf_conntrack"
    path.write_text(
        "\n".join(
            [
                tcp4("10.0.0.5", str(A_)),
                tcp4("10.0.0.5", str(B_)),
                tcp6("fd00::5", "2001:db8::1"),  # same subject over v6
                tcp4("10.0.0.5", "8.8.8.8"),  # untracked
                tcp4("10.0.0.6", str(C_)),
                tcp4("10.0.0.6", str(A_)),  # u-2 never learned A
                tcp4("10.0.0.99", str(D_)),  # unknown source
                udp4("10.0.0.5", str(E_)),  # UDP never renews
            ]
        )
        + "\n"
    )
    leases = {
        "u-1": {A_: later(), B_: later(), E_: later(), ip("2001:db8::1"): later()},
        "u-2": {C_: later()},
        "u-3": {D_: later()},
    }
    renew = Renewals()
    await make(path, leases, renew).tick()
    assert sorted(renew.calls) == [
        ("u-1", [ip("2001:db8::1"), A_, B_], RENEW_S),
        ("u-2", [C_], RENEW_S),
    ]
    assert RENEW_S == 360


async def test_tick_uses_the_configured_renewal(tmp_path: Path) -> None:
    path = tmp_path / "ct"
    path.write_text(tcp4("10.0.0.5", str(A_)) + "\n")
    renew = Renewals()
    await make(path, {"u-1": {A_: later()}}, renew, renew_s=120).tick()
    assert renew.calls == [("u-1", [A_], 120)]


async def test_tick_forgets_expired_inactive_leases(tmp_path: Path) -> None:
    path = tmp_path / "ct"
    path.write_text(tcp4("10.0.0.5", str(A_)) + "\n")
    mirror = book({A_: expired(), B_: expired(), C_: later()})
    renew = Renewals()
    await make_books(path, {"u-1": mirror}, renew).tick()
    # An ended lease is forgotten and never renewed, even with a flow still open: the kernel
    # dropped it already, and renewing would reopen it (docs/reference/behaviour.md §14.1, 14.4).
    assert set(mirror) == {C_}
    assert renew.calls == []


async def test_flow_closed_between_ticks_is_renewed_exactly_once_more(tmp_path: Path) -> None:
    path = tmp_path / "ct"
    mirror = {A_: later()}
    renew = Renewals()
    refresher = make(path, {"u-1": mirror}, renew)

    path.write_text(tcp4("10.0.0.5", str(A_)) + "\n")
    await refresher.tick()
    path.write_text(tcp4("10.0.0.5", str(A_), "TIME_WAIT") + "\n")
    await refresher.tick()  # active last tick only -> once more
    await refresher.tick()  # gone for two ticks -> no more
    assert renew.calls == [("u-1", [A_], 360), ("u-1", [A_], 360)]


async def test_read_error_skips_and_clears_last_tick(tmp_path: Path) -> None:
    path = tmp_path / "ct"
    mirror = book({A_: later()})
    renew = Renewals()
    refresher = make_books(path, {"u-1": mirror}, renew)

    path.write_text(tcp4("10.0.0.5", str(A_)) + "\n")
    await refresher.tick()
    assert renew.calls == [("u-1", [A_], 360)]

    path.unlink()
    await refresher.tick()  # read error: nothing renewed, last tick forgotten
    assert len(renew.calls) == 1

    path.write_text("")
    await refresher.tick()  # A was active "last tick", but that memory was cleared
    assert len(renew.calls) == 1
    assert A_ in mirror  # nothing forgotten on an error tick or for a live lease


async def test_without_read_error_the_closed_flow_would_be_renewed(tmp_path: Path) -> None:
    # Control for the test above: same sequence minus the error renews once more.
    path = tmp_path / "ct"
    renew = Renewals()
    refresher = make(path, {"u-1": {A_: later()}}, renew)
    path.write_text(tcp4("10.0.0.5", str(A_)) + "\n")
    await refresher.tick()
    path.write_text("")
    await refresher.tick()
    assert len(renew.calls) == 2


async def test_read_error_does_not_forget_expired_leases(tmp_path: Path) -> None:
    mirror = book({A_: expired()})
    renew = Renewals()
    await make_books(tmp_path / "missing", {"u-1": mirror}, renew).tick()
    assert set(mirror) == {A_}
    assert renew.calls == []


async def test_renew_failure_of_one_subject_does_not_stop_the_others(tmp_path: Path) -> None:
    path = tmp_path / "ct"
    path.write_text(tcp4("10.0.0.5", str(A_)) + "\n" + tcp4("10.0.0.6", str(B_)) + "\n")
    renew = Renewals(fail_for={"u-1", "u-2"})
    await make(path, {"u-1": {A_: later()}, "u-2": {B_: later()}}, renew).tick()
    assert sorted(c[0] for c in renew.calls) == ["u-1", "u-2"]


async def test_subject_without_mirror_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "ct"
    path.write_text(tcp4("10.0.0.5", str(A_)) + "\n")
    renew = Renewals()
    await make(path, {}, renew).tick()
    assert renew.calls == []


async def test_mirror_shared_with_the_owner_is_edited_in_place(tmp_path: Path) -> None:
    path = tmp_path / "ct"
    path.write_text("")
    leases = {"u-1": book({A_: expired()})}
    mirror = leases["u-1"]
    await make_books(path, leases, Renewals()).tick()
    assert leases["u-1"] is mirror
    assert len(mirror) == 0
