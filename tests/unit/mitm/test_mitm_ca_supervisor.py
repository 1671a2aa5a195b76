"""The MITM CA (generated once, or pinned) and the supervisor (argv, readiness, restart)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from egressd.mitm.ca import CA_FILE, CERT_FILE, CaError, ensure_ca
from egressd.mitm.supervisor import MitmOptions, MitmSupervisor, _parse_event, mitmdump_argv

# --------------------------------------------------------------------------- CA


def test_generated_once_then_pinned(tmp_path: Path) -> None:
    conf = tmp_path / "mitm"
    first = ensure_ca(conf)
    assert not first.pinned
    assert os.stat(conf).st_mode & 0o777 == 0o700
    assert os.stat(conf / CA_FILE).st_mode & 0o777 == 0o600
    cert = x509.load_pem_x509_certificate((conf / CERT_FILE).read_bytes())
    assert first.fingerprint == hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert "PRIVATE KEY" not in first.pem and "PRIVATE KEY" not in (conf / CERT_FILE).read_text()
    again = ensure_ca(conf)
    assert again.pinned and again.fingerprint == first.fingerprint


def test_pinned_ca_restores_a_missing_public_cert(tmp_path: Path) -> None:
    conf = tmp_path / "mitm"
    first = ensure_ca(conf)
    (conf / CERT_FILE).unlink()
    assert ensure_ca(conf).fingerprint == first.fingerprint
    assert (conf / CERT_FILE).read_text() == first.pem


def test_bad_pinned_ca_is_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    ensure_ca(a)
    ensure_ca(b)
    key_a = (a / CA_FILE).read_text().split("-----BEGIN CERTIFICATE-----")[0]
    cert_b = (b / CERT_FILE).read_text()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / CA_FILE).write_text(key_a + cert_b)
    with pytest.raises(CaError, match="does not match"):
        ensure_ca(bad)
    (bad / CA_FILE).write_text("junk")
    with pytest.raises(CaError) as info:
        ensure_ca(bad)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- supervisor


def test_argv_never_dumps_flows_and_connects_lazily(tmp_path: Path) -> None:
    opts = MitmOptions(18081, tmp_path / "conf", tmp_path / "a.sock", Path("/etc/ssl/certs"))
    argv = mitmdump_argv(opts)
    joined = " ".join(argv)
    assert argv[1:3] == ["-m", "egressd.mitmchild.runner"]
    for needle in (
        "--set mode=transparent",
        "--set listen_port=18081",
        "connection_strategy=lazy",
        "upstream_cert=false",
        "ssl_verify_upstream_trusted_confdir=/etc/ssl/certs",
        f"egressd_active_socket={tmp_path / 'a.sock'}",
        "egressd_lookup_timeout_ms=250",
        "egressd_name_check=false",
        "egressd_kernel_relay=true",
    ):
        assert needle in joined, needle
    assert "egressd_kernel_relay=false" in " ".join(mitmdump_argv(MitmOptions(1, tmp_path, tmp_path / "s", None, kernel_relay=False)))
    assert "egressd_name_check=true" in " ".join(mitmdump_argv(MitmOptions(1, tmp_path, tmp_path / "s", None, name_check=True)))
    assert "ssl_insecure" not in joined
    insecure = " ".join(mitmdump_argv(MitmOptions(1, tmp_path, tmp_path / "s", None, ssl_insecure=True)))
    assert "ssl_insecure=true" in insecure and "trusted_confdir" not in insecure


def test_only_addon_events_are_parsed() -> None:
    assert _parse_event('{"event":"mitm.ready"}') == {"event": "mitm.ready"}
    assert _parse_event('{"event":"other"}') is None
    assert _parse_event("{broken") is None
    assert _parse_event("plain warning") is None


async def test_restarts_a_dying_child_and_tracks_readiness(tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    script = (
        "import json,sys,time,pathlib;"
        f"p=pathlib.Path({str(marker)!r});n=len(p.read_text()) if p.exists() else 0;"
        "p.write_text('x'*(n+1));"
        "print(json.dumps({'event':'mitm.ready'}),flush=True);"
        "time.sleep(0.3 if n==0 else 30)"
    )
    sup = MitmSupervisor([sys.executable, "-c", script], backoff=(0.05, 0.2))
    task = asyncio.create_task(sup.run())
    try:
        assert await sup.wait_ready(10)
        first = sup.pid
        # The first child exits after 0.3 s; readiness drops, then a new child is ready.
        deadline = asyncio.get_running_loop().time() + 10
        while sup.starts < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert await sup.wait_ready(10)
        assert sup.pid != first and sup.starts == 2
    finally:
        await sup.stop()
        task.cancel()
    assert json.dumps(sup.ready) in ("true", "false")


async def test_not_ready_until_the_child_says_so(tmp_path: Path) -> None:
    sup = MitmSupervisor([sys.executable, "-c", "import time; print('noise', flush=True); time.sleep(30)"])
    task = asyncio.create_task(sup.run())
    try:
        assert not await sup.wait_ready(0.5)
        assert not sup.ready and sup.pid is not None
    finally:
        await sup.stop()
        task.cancel()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to change gid")
async def test_child_runs_under_the_given_gid(tmp_path: Path) -> None:
    out = tmp_path / "ids"
    script = f"import os,pathlib,time; pathlib.Path({str(out)!r}).write_text(f'{{os.getuid()}} {{os.getgid()}} {{os.getgroups()}} '+[l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff','CapPrm','NoNewPrivs'))].__repr__()); time.sleep(30)"
    sup = MitmSupervisor([sys.executable, "-c", script], gid=65532)
    task = asyncio.create_task(sup.run())
    try:
        for _ in range(200):
            if out.exists() and out.read_text():
                break
            await asyncio.sleep(0.02)
        # Same uid, the given gid only, and no capability at all (no_new_privs keeps it so).
        assert out.read_text() == "0 65532 [] ['0000000000000000', '0000000000000000', '1']"
    finally:
        await sup.stop()
        task.cancel()


def test_pinned_ca_on_a_read_only_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno as errno_mod

    conf = tmp_path / "secret"
    first = ensure_ca(conf)
    os.chmod(conf, 0o755)  # as a Secret volume would show it

    def read_only(path: object, mode: int) -> None:
        raise OSError(errno_mod.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "chmod", read_only)
    again = ensure_ca(conf)  # the public cert is present and identical: nothing to write
    assert again.pinned and again.fingerprint == first.fingerprint


async def test_child_output_is_logged_by_kind_only() -> None:
    from structlog.testing import capture_logs

    secret = "sk-PLANTED-output-9"
    script = (
        "import json,time;"
        f"print('[04:22:01.123][10.0.0.5:4242] connection handler has crashed: Unexpected event {secret}');"
        f"print('AssertionError: DataReceived(data=b\"Authorization: Bearer {secret}\")');"
        "print('x' * 200000);"  # over the stream limit: skipped, remainder too
        "print(json.dumps({'event': 'mitm.pass', 'pid': 1, 'reason': 'no vault'}));"
        "print(json.dumps({'event': 'mitm.ready'}), flush=True); time.sleep(30)"
    )
    sup = MitmSupervisor([sys.executable, "-c", script])
    with capture_logs() as logs:
        task = asyncio.create_task(sup.run())
        try:
            assert await sup.wait_ready(10)
        finally:
            await sup.stop()
            task.cancel()
    assert secret not in repr(logs) and "xxxxxxxx" not in repr(logs)
    lines = [e["line"] for e in logs if e["event"] == "mitm.output"]
    assert lines == ["[04:22:01.123][10.0.0.5:4242] connection handler has crashed", "AssertionError"]
    assert any(e["event"] == "mitm.pass" for e in logs), "a pid key in an event does not break logging"
