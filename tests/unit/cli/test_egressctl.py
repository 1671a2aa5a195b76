"""egressctl against the real fleet HTTP app, served in-process from a background event loop."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp import web

from egressd.actionhandler.control import ControlPlane
from egressd.cli.client import CliError
from egressd.cli.commands.explain import split_port
from egressd.cli.egressctl import main
from egressd.fleet.server import FleetHTTP
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.metrics import EgressMetrics
from tests.unit.fakekernel import FakeTx

POLICY = json.dumps(
    {
        "defaultAction": "deny",
        "egress": [
            {"action": "allow", "target": "example.com"},
            {"action": "allow", "target": "10.1.0.0/16"},
            {"action": "deny", "target": "evil.example.com"},
        ],
    }
)


def failing_tx() -> FakeTx:
    """The table reset works (daemon ready) but every later transaction is refused."""
    tx = FakeTx(yield_each_call=False)
    tx.fail(kinds=("script", "batch"), times=None)
    return tx


class Daemon:
    """The fleet HTTP app on 127.0.0.1:<free port>, in its own thread and event loop."""

    def __init__(self, tx: FakeTx, *, reset: bool = True) -> None:
        self.tx = tx
        self.reset = reset
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="egressd-test", daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _start(self) -> None:
        control = ControlPlane(FleetPlanKernel(TableConfig(), self.tx))
        if self.reset:
            await control.reset_table()
        self.runner = web.AppRunner(FleetHTTP(control, EgressMetrics()).app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def _stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)

    def stop(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    """The daemon logs through structlog to stdout by default; keep captured stdout for the CLI."""
    saved = structlog.get_config()
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    yield
    structlog.configure(**saved)


def _serve(tx: FakeTx, *, reset: bool = True) -> Iterator[Daemon]:
    d = Daemon(tx, reset=reset)
    d.start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    yield from _serve(FakeTx(yield_each_call=False))


@pytest.fixture
def failing_daemon() -> Iterator[Daemon]:
    yield from _serve(failing_tx())


@pytest.fixture
def unready_daemon() -> Iterator[Daemon]:
    yield from _serve(FakeTx(yield_each_call=False), reset=False)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def ctl(capsys: pytest.CaptureFixture[str], d: Daemon, *argv: str) -> tuple[int, str, str]:
    return run(capsys, "--addr", d.addr, *argv)


def bind(capsys: pytest.CaptureFixture[str], d: Daemon, uid: str, ip: str, *extra: str) -> None:
    code, out, err = ctl(
        capsys, d, "send", "set-binding", "--uid", uid, "--ip", ip, "--policy", POLICY, *extra
    )
    assert (code, out, err) == (0, "200 OK\n{}\n", "")


def subjects_json(capsys: pytest.CaptureFixture[str], d: Daemon) -> list[dict[str, Any]]:
    code, out, _ = ctl(capsys, d, "--json", "subjects")
    assert code == 0
    doc = json.loads(out)
    assert isinstance(doc, list)
    return doc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# --------------------------------------------------------------------------- status


def test_status_human(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    bind(capsys, daemon, "u-1", "10.0.0.5")
    code, out, err = ctl(capsys, daemon, "status")
    assert code == 0, err
    assert err == ""
    lines = dict(line.split(None, 1) for line in out.splitlines())
    assert lines["instance"].startswith("egress-")
    assert lines["ready"] == "yes"
    assert lines["health"] == "ok"
    assert lines["subjects"] == "1 (denying 1)"
    assert lines["mitm-ca"] == "disabled"
    assert lines["name-check"].startswith("off")  # no MITM, no name check (docs/reference/behaviour.md §18)
    # Values are aligned in one column.
    assert len({line.index(v) for line, v in zip(out.splitlines(), lines.values(), strict=True)}) == 1


def test_status_json(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, err = ctl(capsys, daemon, "status", "--json")  # global option after the command
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc) == {"status", "healthy", "health", "subjects"}
    assert doc["subjects"] == {"total": 0, "byState": {}}
    assert doc["healthy"] is True
    assert doc["health"] == "ok"
    assert doc["status"]["apiVersion"] == "sandbox.fast.io/actions/v1"
    assert doc["status"]["ready"] is True
    assert doc["status"]["instanceId"].startswith("egress-")
    assert doc["status"]["nameCheck"] is False


def test_status_not_ready(capsys: pytest.CaptureFixture[str], unready_daemon: Daemon) -> None:
    code, out, err = ctl(capsys, unready_daemon, "status")
    assert code == 1
    assert err == "egressctl: daemon not ready: enforcement not installed\n"
    lines = dict(line.split(None, 1) for line in out.splitlines())
    assert lines["ready"] == "no"
    assert lines["health"] == "503 enforcement not installed"
    code, out, _ = ctl(capsys, unready_daemon, "--json", "status")
    assert code == 1
    doc = json.loads(out)
    assert doc["healthy"] is False
    assert doc["health"] == "enforcement not installed"
    assert doc["status"]["ready"] is False


def test_addr_from_environment(
    capsys: pytest.CaptureFixture[str], daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EGRESSCTL_ADDR", daemon.addr)
    code, _, err = run(capsys, "status")
    assert code == 0, err


# --------------------------------------------------------------------------- subjects


def test_subjects_empty(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, _ = ctl(capsys, daemon, "subjects")
    assert code == 0
    assert out.split() == [
        "SUBJECT",
        "STATE",
        "SOURCE-IP",
        "GATEWAY",
        "POLICY",
        "PENDING",
        "VAULT-REV",
        "LEASES",
    ]
    assert subjects_json(capsys, daemon) == []


def test_subjects_after_set_binding(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    bind(capsys, daemon, "u-1", "10.0.0.5")
    bind(capsys, daemon, "u-2", "10.0.7.9", "--gateway", "10.0.7.254")
    code, out, _ = ctl(capsys, daemon, "subjects")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == [
        "SUBJECT",
        "STATE",
        "SOURCE-IP",
        "GATEWAY",
        "POLICY",
        "PENDING",
        "VAULT-REV",
        "LEASES",
    ]
    assert [r.split() for r in rows] == [
        ["s-u-1", "denying", "10.0.0.5", "10.0.0.1", "-", "yes", "-", "0"],
        ["s-u-2", "denying", "10.0.7.9", "10.0.7.254", "-", "yes", "-", "0"],
    ]
    # Columns are aligned on the header.
    assert {r.index("denying") for r in rows} == {header.index("STATE")}

    doc = subjects_json(capsys, daemon)
    assert [s["uid"] for s in doc] == ["u-1", "u-2"]
    first = doc[0]
    assert first["subject"] == "s-u-1"
    assert first["state"] == "denying"
    assert first["sourceIp"] == "10.0.0.5"
    assert first["gateway"] == "10.0.0.1"
    assert first["specGeneration"] == 1
    assert first["pending"] is True
    assert first["policy"] is None


# --------------------------------------------------------------------------- send


def test_full_flow(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    bind(capsys, daemon, "u-1", "10.0.0.5", "--spec-generation", "7")
    assert ctl(capsys, daemon, "send", "hook", "runtime-ready", "--uid", "u-1") == (0, "200 OK\n{}\n", "")
    assert ctl(capsys, daemon, "send", "hook", "sandbox.data-plane-ready", "--uid", "u-1") == (
        0,
        "200 OK\n{}\n",
        "",
    )

    code, out, _ = ctl(capsys, daemon, "subjects")
    assert code == 0
    assert out.splitlines()[1].split() == [
        "s-u-1",
        "active",
        "10.0.0.5",
        "10.0.0.1",
        "default=deny,rules=3",
        "no",
        "-",
        "0",
    ]
    (subject,) = subjects_json(capsys, daemon)
    assert subject["state"] == "active"
    assert subject["specGeneration"] == 7
    assert subject["policy"] == {"defaultAction": "deny", "rules": 3}
    assert subject["kernelInstalled"] is True

    code, out, _ = ctl(capsys, daemon, "status")
    assert code == 0
    assert "1 (active 1)" in out

    code, out, _ = ctl(capsys, daemon, "--json", "send", "remove", "--uid", "u-1")
    assert code == 0
    assert json.loads(out) == {"code": 200, "body": {}}
    assert subjects_json(capsys, daemon) == []


def test_hook_short_and_full_names_and_fence(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    bind(capsys, daemon, "u-1", "10.0.0.5", "--runtime-instance-id", "rt-9", "--attachment-id", "att-3")
    # Default fence (r1/a1) does not match the registered one: refused.
    code, out, _ = ctl(capsys, daemon, "send", "hook", "data-plane-ready", "--uid", "u-1")
    assert code == 1
    assert out.startswith("409 ")
    code, out, _ = ctl(
        capsys,
        daemon,
        "send",
        "hook",
        "data-plane-ready",
        "--uid",
        "u-1",
        "--runtime-instance-id",
        "rt-9",
        "--attachment-id",
        "att-3",
    )
    assert (code, out) == (0, "200 OK\n{}\n")


def test_set_binding_null(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    bind(capsys, daemon, "u-1", "10.0.0.5")
    code, out, err = ctl(capsys, daemon, "send", "set-binding", "--uid", "u-1", "--ip", "10.0.0.5", "--null")
    assert (code, out, err) == (0, "200 OK\n{}\n", "")
    (subject,) = subjects_json(capsys, daemon)
    assert subject["state"] == "denying"
    assert subject["pending"] is False
    # Without --ip, --null sends no attachment: a no-op for an unknown subject.
    code, out, _ = ctl(capsys, daemon, "send", "set-binding", "--uid", "u-new", "--null")
    assert (code, out) == (0, "200 OK\n{}\n")


def test_set_binding_default_policy_notes_on_stderr(
    capsys: pytest.CaptureFixture[str], daemon: Daemon
) -> None:
    code, out, err = ctl(capsys, daemon, "send", "set-binding", "--uid", "u-1", "--ip", "10.0.0.5")
    assert (code, out) == (0, "200 OK\n{}\n")
    assert err.count("\n") == 1
    assert err.startswith("egressctl: note:") and "{}" in err
    assert ctl(capsys, daemon, "send", "hook", "data-plane-ready", "--uid", "u-1")[0] == 0
    (subject,) = subjects_json(capsys, daemon)
    assert subject["policy"] == {"defaultAction": "deny", "rules": 0}


def test_set_binding_policy_file_and_stdin(
    capsys: pytest.CaptureFixture[str], daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy_file = tmp_path / "policy.json"
    policy_file.write_text('{"defaultAction":"allow","egress":[{"action":"deny","target":"x.com"}]}\n')
    args = ("send", "set-binding", "--uid", "u-1", "--ip", "10.0.0.5")
    assert ctl(capsys, daemon, *args, "--policy-file", str(policy_file)) == (0, "200 OK\n{}\n", "")

    monkeypatch.setattr("sys.stdin", io.StringIO('{"defaultAction":"allow"}'))
    args2 = ("send", "set-binding", "--uid", "u-2", "--ip", "10.0.1.5")
    assert ctl(capsys, daemon, *args2, "--policy-file", "-") == (0, "200 OK\n{}\n", "")
    for uid in ("u-1", "u-2"):
        assert ctl(capsys, daemon, "send", "hook", "data-plane-ready", "--uid", uid)[0] == 0
    policies = [s["policy"] for s in subjects_json(capsys, daemon)]
    assert policies == [{"defaultAction": "allow", "rules": 1}, {"defaultAction": "allow", "rules": 0}]


def test_invalid_policy_is_400(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    args = ("send", "set-binding", "--uid", "u-1", "--ip", "10.0.0.5", "--policy", "not-json")
    code, out, err = ctl(capsys, daemon, *args)
    assert code == 1
    assert out.startswith("400 Bad Request\ninvalid binding input")
    assert out.count("\n") == 2
    assert err.startswith("egressctl: POST /_fastlet/v1/actions: 400 ") and err.count("\n") == 1
    code, out, _ = ctl(capsys, daemon, "--json", *args)
    assert code == 1
    doc = json.loads(out)
    assert doc["code"] == 400
    assert isinstance(doc["body"], str) and doc["body"]
    assert subjects_json(capsys, daemon) == []


def test_enforcement_failure_is_500(capsys: pytest.CaptureFixture[str], failing_daemon: Daemon) -> None:
    code, out, err = ctl(
        capsys, failing_daemon, "send", "set-binding", "--uid", "u-1", "--ip", "10.0.0.5", "--policy", "{}"
    )
    assert code == 1
    assert out.startswith("500 ")
    assert "injected failure" in out
    assert err.startswith("egressctl: POST /_fastlet/v1/actions: 500 ") and err.count("\n") == 1


def test_hook_for_unknown_uid_is_409(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, _ = ctl(capsys, daemon, "send", "hook", "runtime-ready", "--uid", "nobody")
    assert code == 1
    assert out.startswith("409 ")
    code, out, _ = ctl(capsys, daemon, "--json", "send", "hook", "data-plane-ready", "--uid", "nobody")
    assert code == 1
    assert json.loads(out)["code"] == 409


def test_raw_send(capsys: pytest.CaptureFixture[str], daemon: Daemon, tmp_path: Path) -> None:
    envelope = {
        "apiVersion": "sandbox.fast.io/actions/v1",
        "operation": "SET_BINDING",
        "sandbox": {"uid": "raw-1"},
        "revision": {"runtimeInstanceId": "r", "attachmentId": "a"},
        "attachment": {"network": {"ip": "10.9.0.5", "gateway": "10.9.0.1", "hostVeth": "v"}},
        "binding": {"input": "{}"},
    }
    path = tmp_path / "env.json"
    path.write_text(json.dumps(envelope))
    assert ctl(capsys, daemon, "send", "raw", "--file", str(path)) == (0, "200 OK\n{}\n", "")
    (subject,) = subjects_json(capsys, daemon)
    assert subject["uid"] == "raw-1"

    path.write_text("{")
    code, out, _ = ctl(capsys, daemon, "send", "raw", "--file", str(path))
    assert code == 1
    assert out.startswith("400 Bad Request\ninvalid action envelope")


def test_raw_send_from_stdin(
    capsys: pytest.CaptureFixture[str], daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO('{"apiVersion":"v1"}'))
    code, out, _ = ctl(capsys, daemon, "--json", "send", "raw", "--file", "-")
    assert code == 1
    doc = json.loads(out)
    assert doc["code"] == 400
    assert "apiVersion" in doc["body"]


# --------------------------------------------------------------------------- local errors


def _one_error_line(err: str) -> None:
    assert err.count("\n") == 1, err
    assert err.startswith("egressctl: ")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ("status",),
        ("--json", "status"),
        ("subjects",),
        ("send", "remove", "--uid", "u-1"),
        ("send", "set-binding", "--uid", "u-1", "--ip", "10.0.0.5", "--policy", "{}"),
    ],
)
def test_connection_refused(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]) -> None:
    code, out, err = run(capsys, "--addr", f"127.0.0.1:{free_port()}", "--timeout", "2", *argv)
    assert code == 3
    assert out == ""
    _one_error_line(err)
    assert "cannot reach egressd" in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (("send", "set-binding", "--uid", "u", "--ip", "10.0.0.300"), "--ip"),
        (("send", "set-binding", "--uid", "u", "--ip", "nope", "--policy", "{}"), "--ip"),
        (("send", "set-binding", "--uid", "u", "--ip", "fd00::5"), "--gateway is required"),
        (("send", "set-binding", "--uid", "u", "--ip", "10.0.0.1"), "--gateway"),
        (("send", "set-binding", "--uid", "u", "--ip", "10.0.0.5", "--gateway", "x"), "--gateway"),
        (("send", "set-binding", "--uid", "u"), "--ip is required"),
        (
            ("send", "set-binding", "--uid", "u", "--ip", "10.0.0.5", "--null", "--policy", "{}"),
            "not allowed",
        ),
        (
            ("send", "set-binding", "--uid", "u", "--ip", "10.0.0.5", "--spec-generation", "-1"),
            "spec-generation",
        ),
        (
            ("send", "set-binding", "--uid", "u", "--ip", "10.0.0.5", "--policy-file", "/nonexistent/p"),
            "cannot read",
        ),
        (("send", "raw", "--file", "/nonexistent/envelope.json"), "cannot read"),
        (("send", "hook", "before-delete", "--uid", "u"), "unknown hook"),
        (("send", "hook", "runtime-ready"), "--uid"),
        (("send",), "required"),
        (("bogus",), "invalid choice"),
        (("--timeout", "0", "status"), "--timeout"),
        (("--addr", "127.0.0.1:99999", "status"), "--addr"),
    ],
)
def test_bad_local_input(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], fragment: str) -> None:
    # Nothing listens there: every case must fail locally, before any request (a later --addr wins).
    code, out, err = run(capsys, "--addr", f"127.0.0.1:{free_port()}", *argv)
    assert code == 2
    assert out == ""
    _one_error_line(err)
    assert fragment in err
    assert "cannot reach" not in err


def test_bad_ip_sends_nothing(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    code, out, err = ctl(
        capsys, daemon, "send", "set-binding", "--uid", "u", "--ip", "10.0.0", "--policy", "{}"
    )
    assert (code, out) == (2, "")
    _one_error_line(err)
    assert subjects_json(capsys, daemon) == []


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for name in ("status", "subjects", "explain", "send", "vault", "ca"):
        assert name in out
    # The exit codes are documented in the help text.
    flat = " ".join(out.split())
    for text in ("0 success", "1 the daemon answered", "2 usage error", "3 the daemon could not be reached"):
        assert text in flat
    code, out, _ = run(capsys, "send", "set-binding", "--help")
    assert code == 0
    assert "--policy-file" in out


def test_explain(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    bind(capsys, daemon, "u-1", "10.0.0.5")
    # Denying: everything dropped, whatever the policy will say.
    code, out, _ = ctl(capsys, daemon, "--json", "explain", "10.0.0.5", "8.8.8.8")
    assert code == 0 and json.loads(out)["decision"] == "deny" and json.loads(out)["state"] == "denying"
    ctl(capsys, daemon, "send", "hook", "data-plane-ready", "--uid", "u-1")
    code, out, _ = ctl(capsys, daemon, "explain", "10.0.0.5", "8.8.8.8")
    assert code == 0
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert fields["verdict"] in ("ALLOW", "DENY") and fields["subject"].startswith("s-u-1 (active)")
    assert fields["source"] == "10.0.0.5" and fields["layer"] == "ip"
    assert fields["kernel"] == "in no set: unmarked, dropped"
    code, out, _ = ctl(capsys, daemon, "explain", "10.0.0.5", "10.1.2.3")
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert (fields["verdict"], fields["kernel"]) == ("ALLOW", "allow set")
    code, out, _ = ctl(capsys, daemon, "explain", "10.0.0.5", "example.com")
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert (fields["layer"], fields["rule"]) == ("dns", "allow example.com")
    assert fields["kernel"] == "answers are added to the dyn set as leases"
    # Unknown source, and a bad request.
    code, out, _ = ctl(capsys, daemon, "--json", "explain", "10.9.9.9", "example.com")
    assert json.loads(out)["state"] == "absent" and json.loads(out)["decision"] == "deny"
    code, _, err = ctl(capsys, daemon, "explain", "not-an-ip", "example.com")
    assert code == 2 and err.startswith("egressctl: ") and err.count("\n") == 1


def test_audit_mode_shows_in_subjects_and_explain(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    audit = '{"defaultAction":"deny","mode":"audit","egress":[{"action":"allow","target":"example.com"}]}'
    code, out, err = ctl(
        capsys, daemon, "send", "set-binding", "--uid", "u-a", "--ip", "10.0.0.8", "--policy", audit
    )
    assert code == 0, err
    ctl(capsys, daemon, "send", "hook", "data-plane-ready", "--uid", "u-a")
    code, out, _ = ctl(capsys, daemon, "subjects")
    row = next(r.split() for r in out.splitlines() if r.startswith("s-u-a"))
    assert row[4] == "default=deny,rules=1,audit"
    code, out, _ = ctl(capsys, daemon, "explain", "10.0.0.8", "other.example.org")
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert fields["verdict"].startswith("WOULD-DENY")


@pytest.mark.parametrize(
    ("target", "split"),
    [
        ("example.com:443", ("example.com", 443)),
        ("example.com", ("example.com", None)),
        ("10.0.0.1:80", ("10.0.0.1", 80)),
        ("2001:db8::1", ("2001:db8::1", None)),
        ("[2001:db8::1]:443", ("2001:db8::1", 443)),
        ("[2001:db8::1]", ("2001:db8::1", None)),
    ],
)
def test_explain_splits_a_port_off_the_target(target: str, split: tuple[str, int | None]) -> None:
    assert split_port(target) == split


@pytest.mark.parametrize("target", ["x.io:0", "x.io:65536", "x.io:http", "[::1", "[::1]x"])
def test_explain_refuses_a_bad_port(target: str) -> None:
    with pytest.raises(CliError):
        split_port(target)


def test_explain_with_a_port_and_the_name_check(capsys: pytest.CaptureFixture[str], daemon: Daemon) -> None:
    bind(capsys, daemon, "u-p", "10.0.0.9")
    ctl(capsys, daemon, "send", "hook", "data-plane-ready", "--uid", "u-p")
    code, out, _ = ctl(capsys, daemon, "explain", "10.0.0.9", "example.com:443")
    assert code == 0
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert fields["port"] == "tcp 443"
    assert fields["name-check"].startswith("off")  # this daemon runs without the MITM
    code, out, _ = ctl(capsys, daemon, "--json", "explain", "10.0.0.9", "example.com:443")
    assert json.loads(out)["port"] == 443 and json.loads(out)["nameCheck"]["enabled"] is False
