"""egressctl vault seal / put|post|patch|get|delete and send set-binding --input-file, client side.

The daemon's vault routes are exercised elsewhere; here a stub aiohttp server records what the
CLI sends (method, raw path, headers, body) and answers with a scripted status and body.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from egressd.actionhandler.inputs import VaultAction, parse_binding_input
from egressd.cli.egressctl import main
from egressd.vault.keys import KeyRing
from egressd.vault.sealed import open_sealed, parse_sealed, parse_wrapper

KEY = bytes(range(32))
SECRET = "sk-PLANTED-SECRET-0123456789"
POLICY = {"defaultAction": "deny", "egress": [{"action": "allow", "target": "api.github.com"}]}
VAULT = {
    "credentials": [{"name": "gh", "source": {"type": "inline", "value": SECRET}}],
    "bindings": [
        {"name": "b", "match": {"hosts": ["api.github.com"]}, "auth": {"type": "bearer", "credential": "gh"}}
    ],
}
STATE = {
    "revision": 1,
    "credentials": [{"name": "gh", "sourceType": "inline", "revision": 1}],
    "bindings": [],
}


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Stub:
    """A tiny HTTP server in its own thread and event loop; answers from ``replies`` (FIFO)."""

    seen: list[Seen] = field(default_factory=list)
    replies: list[tuple[int, str, str]] = field(default_factory=list)  # status, content-type, body
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    runner: web.AppRunner | None = None
    port: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(Seen(request.method, request.raw_path, dict(request.headers), await request.read()))
        status, ctype, body = self.replies.pop(0) if self.replies else (200, "application/json", "{}")
        if status == 204:
            return web.Response(status=204)
        return web.Response(status=status, body=body.encode(), content_type=ctype)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def _stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def reply(self, status: int, body: Any = None, ctype: str = "application/json") -> None:
        text = "" if body is None else (body if isinstance(body, str) else json.dumps(body))
        self.replies.append((status, ctype, text))


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub()
    thread = threading.Thread(target=s.loop.run_forever, name="vault-stub", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(s._start(), s.loop).result(timeout=10)
    try:
        yield s
    finally:
        try:
            asyncio.run_coroutine_threadsafe(s._stop(), s.loop).result(timeout=10)
        finally:
            s.loop.call_soon_threadsafe(s.loop.stop)
            thread.join(timeout=10)
            s.loop.close()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def ctl(capsys: pytest.CaptureFixture[str], s: Stub, *argv: str) -> tuple[int, str, str]:
    return run(capsys, "--addr", s.addr, *argv)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {
        "policy": tmp_path / "policy.json",
        "vault": tmp_path / "vault.json",
        "key": tmp_path / "k7.key",
        "b64key": tmp_path / "other.key",
        "body": tmp_path / "body.json",
    }
    paths["policy"].write_text(json.dumps(POLICY))
    paths["vault"].write_text(json.dumps(VAULT, indent=2))
    paths["key"].write_bytes(KEY)
    paths["b64key"].write_text(base64.b64encode(KEY).decode() + "\n")
    paths["body"].write_text(json.dumps(VAULT))
    return paths


# --------------------------------------------------------------------------- vault seal


def open_wrapper(text: str, uid: str) -> tuple[object, Any]:
    wrapper = parse_wrapper(json.loads(text))
    plaintext = open_sealed(parse_sealed(wrapper.vault), uid, KeyRing([("k7", KEY)]))
    return wrapper.policy, json.loads(plaintext)


def test_seal_prints_wrapper_that_opens(capsys: pytest.CaptureFixture[str], files: dict[str, Path]) -> None:
    code, out, err = run(
        capsys,
        "vault", "seal", "--uid", "u-1", "--policy-file", str(files["policy"]),
        "--vault-file", str(files["vault"]), "--key-file", str(files["key"]),
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert out.endswith("\n") and out.count("\n") == 1
    text = out.rstrip("\n")
    doc = json.loads(text)
    assert list(doc) == ["osbEgressInput", "policy", "vault"]
    assert doc["osbEgressInput"] == 1 and doc["vault"]["kid"] == "k7"  # kid from <kid>.key
    assert SECRET not in text
    policy, vault = open_wrapper(text, "u-1")
    assert policy == POLICY and vault == VAULT
    # Sealed to u-1: another sandbox cannot open it.
    with pytest.raises(ValueError):
        open_wrapper(text, "u-2")
    # The daemon's current input parser recognises it as a wrapper with a vault.
    with pytest.raises(ValueError, match="vault"):
        parse_binding_input(text)


def test_seal_out_file_base64_key_and_kid(
    capsys: pytest.CaptureFixture[str], files: dict[str, Path], tmp_path: Path
) -> None:
    out_file = tmp_path / "input.txt"
    code, out, err = run(
        capsys,
        "vault", "seal", "--uid", "u-1", "--policy-file", str(files["policy"]),
        "--vault-file", str(files["vault"]), "--key-file", str(files["b64key"]), "--kid", "k7",
        "--out", str(out_file),
    )  # fmt: skip
    assert (code, out, err) == (0, "", "")
    text = out_file.read_text()
    assert not text.endswith("\n")
    assert open_wrapper(text, "u-1") == (POLICY, VAULT)


def test_seal_without_vault(capsys: pytest.CaptureFixture[str], files: dict[str, Path]) -> None:
    code, out, _ = run(capsys, "vault", "seal", "--uid", "u", "--policy-file", str(files["policy"]))
    assert code == 0
    assert json.loads(out) == {"osbEgressInput": 1, "policy": POLICY}
    assert parse_binding_input(out.strip()).vault is VaultAction.REMOVE


def test_seal_json_output(capsys: pytest.CaptureFixture[str], files: dict[str, Path]) -> None:
    code, out, _ = run(
        capsys, "--json", "vault", "seal", "--uid", "u-1", "--policy-file", str(files["policy"]),
        "--vault-file", str(files["vault"]), "--key-file", str(files["key"]),
    )  # fmt: skip
    assert code == 0
    doc = json.loads(out)
    assert doc["kid"] == "k7"
    assert open_wrapper(doc["input"], "u-1") == (POLICY, VAULT)


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (("--vault-file", "{vault}"), "--key-file is required"),
        (("--vault-file", "{vault}", "--key-file", "{badkey}"), "--key-file: expected 32 raw bytes"),
        (("--vault-file", "{vault}", "--key-file", "{anon}"), "--kid is required"),
        (("--vault-file", "{vault}", "--key-file", "{key}", "--kid", "bad/kid"), "--kid"),
        (("--vault-file", "{badjson}", "--key-file", "{key}"), "--vault-file: not valid JSON"),
        (("--vault-file", "/nonexistent/v.json", "--key-file", "{key}"), "--vault-file: cannot read"),
        (("--vault-file", "-", "--key-file", "-"), "only one of"),
    ],
)
def test_seal_local_errors(
    capsys: pytest.CaptureFixture[str],
    files: dict[str, Path],
    tmp_path: Path,
    extra: tuple[str, ...],
    reason: str,
) -> None:
    (tmp_path / "bad.key").write_bytes(SECRET.encode())
    (tmp_path / "anon.bin").write_bytes(KEY)
    (tmp_path / "bad.json").write_text('{"credentials": [{"value": "' + SECRET + '"')
    subst = {
        "vault": str(files["vault"]),
        "key": str(files["key"]),
        "badkey": str(tmp_path / "bad.key"),
        "anon": str(tmp_path / "anon.bin"),
        "badjson": str(tmp_path / "bad.json"),
    }
    argv = [a.format(**subst) for a in extra]
    code, out, err = run(capsys, "vault", "seal", "--uid", "u", "--policy-file", str(files["policy"]), *argv)
    assert code == 2 and out == ""
    assert err.startswith("egressctl: ") and err.count("\n") == 1
    assert reason in err
    assert SECRET not in err and "Traceback" not in err


# --------------------------------------------------------------------------- send set-binding --input-file


def test_set_binding_input_file_verbatim(
    capsys: pytest.CaptureFixture[str], stub: Stub, files: dict[str, Path], tmp_path: Path
) -> None:
    out_file = tmp_path / "input.txt"
    assert run(
        capsys,
        "vault", "seal", "--uid", "u-1", "--policy-file", str(files["policy"]),
        "--vault-file", str(files["vault"]), "--key-file", str(files["key"]), "--out", str(out_file),
    )[0] == 0  # fmt: skip
    stub.reply(200, {})
    code, out, err = ctl(
        capsys, stub, "send", "set-binding", "--uid", "u-1", "--ip", "10.0.0.5", "--input-file", str(out_file)
    )
    assert (code, out, err) == (0, "200 OK\n{}\n", "")
    (req,) = stub.seen
    assert (req.method, req.path) == ("POST", "/_fastlet/v1/actions")
    envelope = json.loads(req.body)
    assert envelope["operation"] == "SET_BINDING" and envelope["sandbox"]["uid"] == "u-1"
    assert envelope["binding"]["input"] == out_file.read_text()
    assert open_wrapper(envelope["binding"]["input"], "u-1") == (POLICY, VAULT)


def test_set_binding_input_file_exclusive(capsys: pytest.CaptureFixture[str], files: dict[str, Path]) -> None:
    code, _, err = run(
        capsys, "send", "set-binding", "--uid", "u", "--ip", "10.0.0.5",
        "--input-file", str(files["policy"]), "--policy", "{}",
    )  # fmt: skip
    assert code == 2 and "not allowed with" in err


# --------------------------------------------------------------------------- vault put|post|patch|get|delete


def test_put_sends_body_verbatim(
    capsys: pytest.CaptureFixture[str], stub: Stub, files: dict[str, Path]
) -> None:
    stub.reply(201, STATE)
    code, out, err = ctl(capsys, stub, "vault", "put", "--uid", "u-1", "--file", str(files["body"]))
    assert (code, err) == (0, "")
    assert out == "201 Created\n" + json.dumps(STATE, separators=(",", ":")) + "\n"
    (req,) = stub.seen
    assert (req.method, req.path) == ("PUT", "/v1/sandboxfleets/u-1/egress/credential-vault")
    assert req.body == files["body"].read_bytes()
    assert req.headers["Content-Type"] == "application/json"
    assert "X-Fast-Sandbox-Uid" not in req.headers and "X-Fast-Sandbox-Generation" not in req.headers


def test_post_patch_suffix_only_and_generation(
    capsys: pytest.CaptureFixture[str], stub: Stub, files: dict[str, Path]
) -> None:
    stub.reply(202)
    code, out, _ = ctl(
        capsys, stub, "vault", "post", "--uid", "u-9", "--file", str(files["body"]),
        "--suffix-only", "--generation", "7",
    )  # fmt: skip
    assert (code, out) == (0, "202 Accepted\n")
    stub.reply(200, STATE)
    code, _, _ = ctl(
        capsys,
        stub,
        "vault",
        "patch",
        "--uid",
        "u-9",
        "--file",
        "/dev/null",
        "--generation",
        "0",
        "--suffix-only",
    )
    assert code == 0
    post, patch = stub.seen
    assert (post.method, post.path) == ("POST", "/credential-vault")
    assert post.headers["X-Fast-Sandbox-Uid"] == "u-9"
    assert post.headers["X-Fast-Sandbox-Generation"] == "7"
    assert (patch.method, patch.path, patch.body) == ("PATCH", "/credential-vault", b"")
    assert patch.headers["X-Fast-Sandbox-Generation"] == "0"


def test_put_body_from_stdin(
    capsys: pytest.CaptureFixture[str], stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    body = json.dumps(VAULT).encode()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(body)))
    stub.reply(200, STATE)
    assert ctl(capsys, stub, "vault", "put", "--uid", "u", "--file", "-")[0] == 0
    assert stub.seen[0].body == body


def test_get_key_values(capsys: pytest.CaptureFixture[str], stub: Stub) -> None:
    stub.reply(200, STATE)
    code, out, err = ctl(capsys, stub, "vault", "get", "--uid", "u-1")
    assert (code, err) == (0, "")
    assert [line.split(None, 1) for line in out.splitlines()] == [
        ["revision", "1"],
        ["credentials.gh.sourceType", "inline"],
        ["credentials.gh.revision", "1"],
        ["bindings", "-"],
    ]
    (req,) = stub.seen
    assert (req.method, req.path, req.body) == ("GET", "/v1/sandboxfleets/u-1/egress/credential-vault", b"")


def test_get_never_prints_a_value_the_server_should_not_have_sent(
    capsys: pytest.CaptureFixture[str], stub: Stub
) -> None:
    leaky = {"revision": 1, "credentials": [{"name": "gh", "source": {"type": "inline", "value": SECRET}}]}
    for argv in (("vault", "get", "--uid", "u"), ("--json", "vault", "get", "--uid", "u")):
        stub.reply(200, leaky)
        code, out, err = ctl(capsys, stub, *argv)
        assert code == 0 and SECRET not in out + err and "<redacted>" in out


@pytest.mark.parametrize(
    ("sub", "path"),
    [
        ("credentials", "/credential-vault/credentials"),
        ("/credentials/", "/credential-vault/credentials"),
        ("credentials/gh", "/credential-vault/credentials/gh"),
        ("bindings", "/credential-vault/bindings"),
        ("bindings/my binding", "/credential-vault/bindings/my%20binding"),
        ("bindings/a/b", "/credential-vault/bindings/a%2Fb"),
        ("credential-vault/bindings/x", "/credential-vault/bindings/x"),
        ("bindings/x/", "/credential-vault/bindings/x"),
        ("/credential-vault", "/credential-vault"),
        ("", "/credential-vault"),
    ],
)
def test_get_sub_paths(capsys: pytest.CaptureFixture[str], stub: Stub, sub: str, path: str) -> None:
    stub.reply(200, {"revision": 1})
    assert ctl(capsys, stub, "vault", "get", "--uid", "u-1", "--path", sub)[0] == 0
    assert ctl(capsys, stub, "vault", "get", "--uid", "u-1", "--path", sub, "--suffix-only")[0] == 0
    full, suffix = stub.seen
    assert full.path == "/v1/sandboxfleets/u-1/egress" + path
    assert suffix.path == path and suffix.headers["X-Fast-Sandbox-Uid"] == "u-1"


def test_uid_is_one_path_segment(capsys: pytest.CaptureFixture[str], stub: Stub) -> None:
    stub.reply(400, "invalid sandbox id", "text/plain")
    code, out, _ = ctl(capsys, stub, "vault", "get", "--uid", "a/b")
    assert (code, out) == (1, "400 Bad Request\ninvalid sandbox id\n")
    assert stub.seen[0].path == "/v1/sandboxfleets/a%2Fb/egress/credential-vault"


def test_get_not_found_and_delete(capsys: pytest.CaptureFixture[str], stub: Stub) -> None:
    stub.reply(404, "credential vault not found", "text/plain")
    assert ctl(capsys, stub, "vault", "get", "--uid", "u") == (
        1,
        "404 Not Found\ncredential vault not found\n",
        "egressctl: GET /v1/sandboxfleets/u/egress/credential-vault: 404 credential vault not found\n",
    )
    stub.reply(204)
    assert ctl(capsys, stub, "vault", "delete", "--uid", "u", "--generation", "3") == (
        0,
        "204 No Content\n",
        "",
    )
    req = stub.seen[1]
    assert (req.method, req.path, req.body) == ("DELETE", "/v1/sandboxfleets/u/egress/credential-vault", b"")
    assert req.headers["X-Fast-Sandbox-Generation"] == "3"


def test_json_output(capsys: pytest.CaptureFixture[str], stub: Stub, files: dict[str, Path]) -> None:
    stub.reply(200, STATE)
    code, out, _ = ctl(capsys, stub, "--json", "vault", "get", "--uid", "u")
    assert code == 0 and json.loads(out) == {"code": 200, "body": STATE}
    stub.reply(409, "credential vault already exists", "text/plain")
    code, out, _ = ctl(capsys, stub, "vault", "post", "--uid", "u", "--file", str(files["body"]), "--json")
    assert code == 1 and json.loads(out) == {"code": 409, "body": "credential vault already exists"}
    stub.reply(204)
    code, out, _ = ctl(capsys, stub, "vault", "delete", "--uid", "u", "--json")
    assert code == 0 and json.loads(out) == {"code": 204, "body": ""}


def test_non_get_sub_resource_is_sent(capsys: pytest.CaptureFixture[str], stub: Stub) -> None:
    """The daemon answers 405; the CLI does not pre-empt it."""
    stub.reply(405, "method not allowed", "text/plain")
    code, out, _ = ctl(capsys, stub, "vault", "delete", "--uid", "u", "--path", "credentials/gh")
    assert (code, out) == (1, "405 Method Not Allowed\nmethod not allowed\n")
    assert stub.seen[0].method == "DELETE"


@pytest.mark.parametrize(
    "argv",
    [
        ("vault", "put", "--uid", "u"),  # --file required
        ("vault", "get", "--uid", "u", "--file", "x"),  # no body on GET
        ("vault", "get", "--uid", "u", "--path", "secrets"),
        ("vault", "get", "--uid", "u", "--path", "credentialsx/a"),
        ("vault", "get", "--uid", "u", "--path", "credential-vaultx"),
        ("vault", "get", "--uid", "u", "--generation", "-1"),
        ("vault", "get", "--uid", "u", "--generation", "x"),
        ("vault", "get", "--uid", "u\nX-Evil: 1", "--suffix-only"),
        ("vault", "put", "--uid", "u", "--file", "/nonexistent/body.json"),
        ("vault", "get"),
    ],
)
def test_local_errors(capsys: pytest.CaptureFixture[str], stub: Stub, argv: tuple[str, ...]) -> None:
    code, out, err = ctl(capsys, stub, *argv)
    assert code == 2 and out == ""
    assert err.startswith("egressctl: ") and err.count("\n") == 1 and "Traceback" not in err
    assert stub.seen == []


def test_connection_error(capsys: pytest.CaptureFixture[str], files: dict[str, Path]) -> None:
    code, out, err = run(
        capsys, "--addr", "127.0.0.1:1", "vault", "put", "--uid", "u", "--file", str(files["body"])
    )
    assert code == 3 and out == ""
    assert err.startswith("egressctl: cannot reach egressd") and SECRET not in err


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "vault", "--help")
    assert code == 0
    for name in ("seal", "put", "post", "patch", "get", "delete"):
        assert name in out
    code, out, _ = run(capsys, "vault", "get", "--help")
    assert code == 0 and "--suffix-only" in out and "--generation" in out
