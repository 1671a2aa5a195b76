"""CA delivery (``EGRESSD_MITM_CA_EXPORT_DIR``): the public certificate only, written
atomically, stale files replaced; the configuration and start-up checks; the CA re-checked
and re-exported before every MITM restart."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

import pytest

from egressd.config import ConfigError, parse_config
from egressd.mitm.ca import CA_FILE, ensure_ca
from egressd.mitm.export import (
    CRT_NAME,
    PEM_NAME,
    TMP_PREFIX,
    TMP_SUFFIX,
    ExportError,
    certificate_only,
    check_separate,
    export_ca,
)
from egressd.mitm.service import CaKeeper, MitmStartupError, start_mitm
from egressd.mitm.supervisor import MitmSupervisor


@pytest.fixture
def ca_pem(tmp_path: Path) -> str:
    return ensure_ca(tmp_path / "conf").pem


def key_and_cert(tmp_path: Path) -> bytes:
    """The confdir's key file: a private key followed by the certificate (mitmproxy's layout)."""
    return (tmp_path / "conf" / CA_FILE).read_bytes()


def test_writes_both_names_with_the_certificate_only(tmp_path: Path, ca_pem: str) -> None:
    out = tmp_path / "export"
    old = os.umask(0o077)  # the files are 0644 whatever the daemon's umask
    try:
        assert export_ca(out, key_and_cert(tmp_path)) == [PEM_NAME, CRT_NAME]
    finally:
        os.umask(old)
    assert sorted(p.name for p in out.iterdir()) == sorted([PEM_NAME, CRT_NAME])
    for name in (PEM_NAME, CRT_NAME):
        data = (out / name).read_bytes()
        assert data.decode() == ca_pem
        assert b"PRIVATE KEY" not in data, "the key block given with the certificate is not copied"
        assert os.stat(out / name).st_mode & 0o777 == 0o644
    assert os.stat(out).st_mode & 0o777 == 0o755


def test_nothing_but_a_certificate_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="no PEM certificate"):
        export_ca(tmp_path / "export", "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    assert not (tmp_path / "export").exists()
    with pytest.raises(ExportError):
        certificate_only(b"not pem")


def test_stale_files_are_replaced_and_foreign_files_kept(tmp_path: Path, ca_pem: str) -> None:
    out = tmp_path / "export"
    out.mkdir()
    target = tmp_path / "elsewhere.txt"
    target.write_text("do not touch")
    (out / PEM_NAME).write_text("an old CA\n")
    os.chmod(out / PEM_NAME, 0o600)
    (out / CRT_NAME).symlink_to(target)  # replaced itself, never written through
    stale_tmp = out / f"{TMP_PREFIX}abc{TMP_SUFFIX}"
    stale_tmp.write_text("half a certi")
    (out / "other-ca.pem").write_text("someone else's")
    assert export_ca(out, ca_pem) == [PEM_NAME, CRT_NAME]
    assert (out / PEM_NAME).read_text() == ca_pem and (out / CRT_NAME).read_text() == ca_pem
    assert not (out / CRT_NAME).is_symlink() and target.read_text() == "do not touch"
    assert not stale_tmp.exists()
    assert (out / "other-ca.pem").read_text() == "someone else's"
    assert os.stat(out / PEM_NAME).st_mode & 0o777 == 0o644


def test_current_files_are_left_alone(tmp_path: Path, ca_pem: str) -> None:
    out = tmp_path / "export"
    export_ca(out, ca_pem)
    before = {n: os.stat(out / n).st_ino for n in (PEM_NAME, CRT_NAME)}
    assert export_ca(out, ca_pem) == []
    assert {n: os.stat(out / n).st_ino for n in (PEM_NAME, CRT_NAME)} == before


def test_a_crash_mid_write_leaves_the_previous_file_and_no_temporary(
    tmp_path: Path, ca_pem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "export"
    export_ca(out, ca_pem)
    new_pem = ensure_ca(tmp_path / "conf2").pem
    real_write = os.write

    def half_then_fail(fd: int, data: bytes | memoryview) -> int:
        real_write(fd, bytes(data[:10]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_fail)
    with pytest.raises(ExportError, match="No space left on device"):
        export_ca(out, new_pem)
    monkeypatch.undo()
    assert (out / PEM_NAME).read_text() == ca_pem and (out / CRT_NAME).read_text() == ca_pem
    assert [p.name for p in out.iterdir() if p.name.startswith(TMP_PREFIX)] == []


def test_readers_never_see_a_partial_file(tmp_path: Path, ca_pem: str) -> None:
    out = tmp_path / "export"
    other = ensure_ca(tmp_path / "conf2").pem
    export_ca(out, ca_pem)
    seen: set[str] = set()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            for name in (PEM_NAME, CRT_NAME):
                try:
                    seen.add((out / name).read_text())
                except FileNotFoundError:
                    seen.add("<missing>")

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(200):
            export_ca(out, other if i % 2 == 0 else ca_pem)
    finally:
        stop.set()
        t.join()
    assert seen <= {ca_pem, other}, "only whole certificates, and never no file at all"


def test_a_bad_directory_is_an_export_error(tmp_path: Path, ca_pem: str) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for bad in (a_file, a_file / "below"):
        with pytest.raises(ExportError) as exc:
            export_ca(bad, ca_pem)
        assert "\n" not in str(exc.value) and "not a directory" in str(exc.value).lower()
    assert a_file.read_text() == "x"


def test_the_export_dir_must_not_overlap_the_confdir(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    (tmp_path / "link").symlink_to(conf)
    for bad in (conf, conf / "pub", tmp_path, tmp_path / "link"):
        with pytest.raises(ExportError, match="overlaps"):
            check_separate(bad, conf)
    check_separate(tmp_path / "pub", conf)


# ------------------------------------------------------------------------------ configuration


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "OPENSANDBOX_EGRESS_PROFILE": "fleet",
        "OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT": "1",
        "EGRESSD_MITM_CONFDIR": str(tmp_path / "conf"),
        "OPENSANDBOX_EGRESS_MITMPROXY_UPSTREAM_TRUST_DIR": str(tmp_path),
        "OPENSANDBOX_CREDENTIAL_PROXY_SOCKET": str(tmp_path / "run" / "active.sock"),
        **extra,
    }


def test_config_export_dir(tmp_path: Path) -> None:
    assert parse_config(_env(tmp_path)).mitm.ca_export_dir is None
    cfg = parse_config(_env(tmp_path), ["--mitm-ca-export-dir", str(tmp_path / "pub")])
    assert cfg.mitm.ca_export_dir == tmp_path / "pub"
    with pytest.raises(ConfigError, match="OPENSANDBOX_EGRESS_MITMPROXY_TRANSPARENT"):
        parse_config({"OPENSANDBOX_EGRESS_PROFILE": "fleet", "EGRESSD_MITM_CA_EXPORT_DIR": str(tmp_path)})
    for bad in (tmp_path / "conf", tmp_path / "conf" / "pub", tmp_path):
        with pytest.raises(ConfigError, match="CA key"):
            parse_config(_env(tmp_path, EGRESSD_MITM_CA_EXPORT_DIR=str(bad)))


async def test_start_mitm_exports_and_refuses_a_bad_directory(tmp_path: Path) -> None:
    cfg = parse_config(_env(tmp_path, EGRESSD_MITM_CA_EXPORT_DIR=str(tmp_path / "pub")))
    mitm = await start_mitm(cfg.mitm, lambda ip: None, lambda c, h, d: False)
    try:
        assert (tmp_path / "pub" / PEM_NAME).read_text() == mitm.ca.pem
        assert (tmp_path / "pub" / CRT_NAME).read_text() == mitm.ca.pem
    finally:
        await mitm.close()
    (tmp_path / "file").write_text("x")
    cfg = parse_config(_env(tmp_path, EGRESSD_MITM_CA_EXPORT_DIR=str(tmp_path / "file")))
    with pytest.raises(MitmStartupError, match=r"^EGRESSD_MITM_CA_EXPORT_DIR: .*not a directory$"):
        await start_mitm(cfg.mitm, lambda ip: None, lambda c, h, d: False)
    # A symlink that leads into the confdir passes the (lexical) configuration check only.
    (tmp_path / "sneaky").symlink_to(tmp_path / "conf")
    cfg = parse_config(_env(tmp_path, EGRESSD_MITM_CA_EXPORT_DIR=str(tmp_path / "sneaky")))
    with pytest.raises(MitmStartupError, match="overlaps"):
        await start_mitm(cfg.mitm, lambda ip: None, lambda c, h, d: False)


def test_the_keeper_follows_a_replaced_ca(tmp_path: Path) -> None:
    conf, pub = tmp_path / "conf", tmp_path / "pub"
    keeper = CaKeeper(conf, pub, ensure_ca(conf))
    keeper.export()
    first = keeper.ca
    keeper.refresh()  # unchanged: same CA, nothing rewritten
    assert keeper.ca == first
    other = ensure_ca(tmp_path / "other")
    (conf / CA_FILE).write_bytes((tmp_path / "other" / CA_FILE).read_bytes())
    keeper.refresh()
    assert keeper.ca.fingerprint == other.fingerprint != first.fingerprint
    assert (pub / PEM_NAME).read_text() == other.pem == (pub / CRT_NAME).read_text()
    (conf / CA_FILE).write_text("broken")
    with pytest.raises(Exception, match=r"mitmproxy-ca\.pem"):
        keeper.refresh()
    assert keeper.ca.fingerprint == other.fingerprint, "a broken CA is never taken over"
    assert (pub / PEM_NAME).read_text() == other.pem


async def test_no_restart_while_the_before_restart_check_fails(tmp_path: Path) -> None:
    """The check runs before every start but the first; while it raises, no child runs (the
    port stays closed) and it is retried with the backoff."""
    calls: list[int] = []
    allow = threading.Event()

    def check() -> None:
        calls.append(1)
        if not allow.is_set():
            raise RuntimeError("mitmproxy-ca.pem: the private key does not match the certificate")

    script = "import json,time; print(json.dumps({'event':'mitm.ready'}), flush=True); time.sleep(0.2)"
    sup = MitmSupervisor([sys.executable, "-c", script], backoff=(0.05, 0.1), before_restart=check)
    task = asyncio.create_task(sup.run())
    try:
        assert await sup.wait_ready(10)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while len(calls) < 3 and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert len(calls) >= 3 and sup.starts == 1 and not sup.ready
        allow.set()
        deadline = loop.time() + 10
        while sup.starts < 2 and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert sup.starts >= 2
    finally:
        await sup.stop()
        task.cancel()
