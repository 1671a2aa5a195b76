"""The sealed-vault key rules of docs/reference/behaviour.md §11 while egressd runs (KeyStore, real files).

A temporary key directory and an injected clock: removed keys stop decrypting within the
rescan bound, added keys decrypt, only the newest key plus the last N=3 decrypt ("newest" =
file mtime, ties by kid), a key file that turns invalid is ignored with one warning naming
only the kid, and no kid pattern makes the store scan the directory more than once a second.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from egressd.vault.keys import ACTIVE_KEYS, KeyDirError, KeyStore
from egressd.vault.sealed import SealError, open_sealed, parse_sealed, seal

UID = "u-1"
PLAINTEXT = json.dumps({"credentials": [], "bindings": []}).encode()
JUNK = b"PLANTED-NOT-A-KEY-5d1e"  # what an operator might paste by mistake: never logged


def key_of(kid: str) -> bytes:
    """A distinct, reproducible 32-byte key per kid."""
    return (kid.encode() * 32)[:32]


def put(directory: Path, kid: str, *, t: int | None = None, data: bytes | None = None) -> None:
    """Write ``<kid>.key`` (its key, or ``data``) atomically, as the rotation procedure says;
    ``t`` = modification time in whole seconds."""
    tmp = directory / f".{kid}.tmp"
    tmp.write_bytes(data if data is not None else key_of(kid))
    tmp.replace(directory / f"{kid}.key")
    if t is not None:
        os.utime(directory / f"{kid}.key", ns=(t * 10**9, t * 10**9))


def opens(store: KeyStore, kid: str) -> bool:
    """A vault sealed with ``kid``'s key opens; False = refused as an unknown kid."""
    obj = parse_sealed(seal(PLAINTEXT, UID, kid, key_of(kid)))
    try:
        assert open_sealed(obj, UID, store.lookup(kid)) == PLAINTEXT
    except SealError as exc:
        # The one refusal of a kid the store will not use: nothing about files or key material.
        assert str(exc) == f"vault: unknown kid {kid!r}"
        return False
    return True


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    d.mkdir()
    return d


@pytest.fixture
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    with capture_logs() as captured:
        yield captured


def assert_clean(logs: list[MutableMapping[str, Any]]) -> None:
    text = repr(logs)
    assert JUNK.decode() not in text
    for kid in ("k1", "k2", "k3", "k4", "k5", "k6"):
        assert key_of(kid).hex() not in text and base64.b64encode(key_of(kid)).decode() not in text


# --------------------------------------------------------------------------- removal / addition


def test_removed_key_stops_decrypting_within_the_rescan_bound(keys_dir: Path, clock: Clock) -> None:
    put(keys_dir, "k1", t=1)
    put(keys_dir, "k2", t=2)
    store = KeyStore(keys_dir, clock=clock)
    assert opens(store, "k1") and opens(store, "k2")
    (keys_dir / "k1.key").unlink()
    clock.advance(1.0)  # the bound: one rescan interval after the removal
    assert not opens(store, "k1")
    assert opens(store, "k2")
    # Putting it back brings it back (it is a file like any other).
    put(keys_dir, "k1", t=3)
    clock.advance(1.0)
    assert opens(store, "k1")


def test_every_key_removed_means_every_vault_is_refused(keys_dir: Path, clock: Clock) -> None:
    put(keys_dir, "k1")
    store = KeyStore(keys_dir, clock=clock)
    assert opens(store, "k1")
    (keys_dir / "k1.key").unlink()
    keys_dir.rmdir()  # even the directory: its keys are gone, nothing decrypts
    clock.advance(1.0)
    assert not opens(store, "k1")
    assert len(store.ring) == 0 and store.last_error is not None


def test_added_key_decrypts(keys_dir: Path, clock: Clock) -> None:
    put(keys_dir, "k1", t=1)
    store = KeyStore(keys_dir, clock=clock)
    put(keys_dir, "k2", t=2)
    clock.advance(1.0)
    assert opens(store, "k2") and opens(store, "k1")
    assert store.ring.newest_kid == "k2"


def test_replaced_symlink_target_is_followed(tmp_path: Path, keys_dir: Path, clock: Clock) -> None:
    # Kubernetes secret volumes: <kid>.key -> ..data/<kid>.key, updated by swapping ..data.
    old, new = tmp_path / "data-1", tmp_path / "data-2"
    old.mkdir()
    new.mkdir()
    (old / "k1.key").write_bytes(key_of("k1"))
    (new / "k1.key").write_bytes(key_of("other"))
    (keys_dir / "k1.key").symlink_to(old / "k1.key")
    store = KeyStore(keys_dir, clock=clock)
    assert opens(store, "k1")
    (keys_dir / "k1.key").unlink()
    (keys_dir / "k1.key").symlink_to(new / "k1.key")
    clock.advance(1.0)
    # The kid now names another key: what was sealed with the old one no longer opens.
    with pytest.raises(SealError, match="authentication failed"):
        open_sealed(parse_sealed(seal(PLAINTEXT, UID, "k1", key_of("k1"))), UID, store.lookup("k1"))
    assert store.lookup("k1").key("k1") == key_of("other")


# --------------------------------------------------------------------------- newest 1 + 3


@pytest.mark.parametrize("count", [5, 6])
def test_only_the_newest_four_decrypt(keys_dir: Path, clock: Clock, count: int) -> None:
    assert ACTIVE_KEYS == 4
    # Distinct mtimes that disagree with the names: the order is the files' time.
    mtimes = {f"k{i}": (i * 7) % 11 for i in range(1, count + 1)}
    for kid, t in mtimes.items():
        put(keys_dir, kid, t=t)
    order = sorted(mtimes, key=mtimes.__getitem__)  # oldest first
    refused, active = order[: count - 4], order[count - 4 :]
    assert refused == (["k5"] if count == 5 else ["k5", "k2"])
    store = KeyStore(keys_dir, clock=clock)
    assert [kid for kid in order if not opens(store, kid)] == refused
    assert all(opens(store, kid) for kid in active)
    assert store.ring.kids == tuple(active) and store.ring.newest_kid == "k3"


def test_newest_ties_are_broken_by_kid(keys_dir: Path, clock: Clock) -> None:
    # Equal mtimes: digit runs compare as numbers, so k9 is the oldest of k9..k13.
    for kid in ("k10", "k11", "k9", "k12", "k13"):
        put(keys_dir, kid, t=50)
    store = KeyStore(keys_dir, clock=clock)
    assert not opens(store, "k9")
    assert store.ring.kids == ("k10", "k11", "k12", "k13")


def test_a_new_key_retires_the_oldest_and_touch_revives_it(keys_dir: Path, clock: Clock) -> None:
    for i in range(1, 5):
        put(keys_dir, f"k{i}", t=i)
    store = KeyStore(keys_dir, clock=clock)
    assert opens(store, "k1")
    put(keys_dir, "k5", t=5)
    clock.advance(1.0)
    assert not opens(store, "k1") and opens(store, "k5") and opens(store, "k2")
    # The order is the files' mtime: touching k1 makes it the newest, k2 drops out.
    os.utime(keys_dir / "k1.key", ns=(6 * 10**9, 6 * 10**9))
    clock.advance(1.0)
    assert opens(store, "k1") and not opens(store, "k2")
    assert store.ring.newest_kid == "k1"


# --------------------------------------------------------------------------- invalid files


def test_key_turned_invalid_is_ignored_with_one_warning(
    keys_dir: Path, clock: Clock, logs: list[MutableMapping[str, Any]]
) -> None:
    for i in (1, 2, 3):
        put(keys_dir, f"k{i}", t=i)
    store = KeyStore(keys_dir, clock=clock)
    put(keys_dir, "k2", t=4, data=JUNK)  # bad length and not base64
    clock.advance(1.0)
    assert not opens(store, "k2")
    assert opens(store, "k1") and opens(store, "k3")
    warnings = [e for e in logs if e["event"] == "vault.key_ignored"]
    assert len(warnings) == 1
    assert warnings[0]["log_level"] == "warning" and warnings[0]["kid"] == "k2"
    assert set(warnings[0]) == {"event", "log_level", "kid", "reason"}
    # Unchanged at the next scans: no new line.
    clock.advance(1.0)
    assert opens(store, "k1")
    clock.advance(1.0)
    assert opens(store, "k3")
    assert len([e for e in logs if e["event"] == "vault.key_ignored"]) == 1
    # Repaired: it decrypts again.
    put(keys_dir, "k2", t=5, data=base64.b64encode(key_of("k2")) + b"\n")
    clock.advance(1.0)
    assert opens(store, "k2")
    assert_clean(logs)


def test_invalid_key_written_later_is_ignored_and_others_keep_working(
    keys_dir: Path, clock: Clock, logs: list[MutableMapping[str, Any]]
) -> None:
    put(keys_dir, "k1", t=1)
    store = KeyStore(keys_dir, clock=clock)
    put(keys_dir, "k2", t=2, data=base64.b64encode(bytes(16)))  # base64, but of 16 bytes
    put(keys_dir, "k3", t=3)  # a good key added in the same change
    (keys_dir / "bad name.key").write_bytes(key_of("k4"))  # not a kid
    clock.advance(1.0)
    assert opens(store, "k3") and opens(store, "k1") and not opens(store, "k2")
    assert store.ring.kids == ("k1", "k3")
    assert sorted(store.ignored) == ["bad name", "k2"]
    warned = sorted(e["kid"] for e in logs if e["event"] == "vault.key_ignored")
    assert warned == ["'bad name'", "k2"]
    assert_clean(logs)


def test_invalid_key_at_startup_is_still_a_startup_error(keys_dir: Path) -> None:
    put(keys_dir, "k1")
    put(keys_dir, "k2", data=JUNK)
    with pytest.raises(KeyDirError, match=r"k2\.key") as info:
        KeyStore(keys_dir)
    assert JUNK.decode() not in str(info.value)


# --------------------------------------------------------------------------- rescan bound


@pytest.fixture
def scandirs(monkeypatch: pytest.MonkeyPatch, keys_dir: Path) -> list[str]:
    """Every listing of the key directory, with the name of the thread that did it."""
    calls: list[str] = []
    real = os.scandir

    def counting(path: Any = ".") -> Any:
        if Path(path) == keys_dir:
            calls.append(threading.current_thread().name)
        return real(path)

    monkeypatch.setattr("egressd.vault.keys.os.scandir", counting)
    return calls


def test_unknown_kid_flood_scans_at_most_once_per_second(
    keys_dir: Path, clock: Clock, scandirs: list[str]
) -> None:
    put(keys_dir, "k1")
    store = KeyStore(keys_dir, clock=clock)
    start = len(scandirs)  # the start-up load
    # 5000 opens with ever new unknown kids over 10 s of clock (and known ones in between).
    for i in range(5000):
        kid = f"flood{i}" if i % 10 else "k1"
        assert store.lookup(kid) is store.ring
        clock.advance(0.002)
    scans = len(scandirs) - start
    assert 9 <= scans <= 11, scans  # at most one per second of clock, and it does keep scanning
    assert store.scans == scans
    # A frozen clock: no scan at all, however many unknown kids.
    for i in range(1000):
        store.lookup(f"burst{i}")
    assert len(scandirs) - start == scans


async def test_rescan_runs_in_a_worker_thread(keys_dir: Path, clock: Clock, scandirs: list[str]) -> None:
    put(keys_dir, "k1")
    store = KeyStore(keys_dir, clock=clock)
    del scandirs[:]
    await store.refresh_async()  # not due: nothing
    assert scandirs == []
    clock.advance(1.0)
    put(keys_dir, "k2")
    await store.refresh_async()
    assert len(scandirs) == 1 and scandirs[0] != threading.main_thread().name
    # The lookup right after finds the scan done and does no I/O on the loop.
    assert opens(store, "k2") and len(scandirs) == 1
