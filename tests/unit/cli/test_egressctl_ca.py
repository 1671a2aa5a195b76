"""``egressctl ca`` against a fake aiohttp server speaking the ``GET /v1/mitm/ca`` contract, and
the fleet app's own handler (404 ``mitm disabled`` without a CA provider, 200 with one)."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from egressd.actionhandler.control import ControlPlane
from egressd.cli.ca import certificate_der, fingerprint, normalise_fingerprint
from egressd.cli.client import CliError
from egressd.cli.egressctl import main
from egressd.fleet.server import FleetHTTP
from egressd.fleetnft.plankernel import FleetPlanKernel
from egressd.fleetnft.table import TableConfig
from egressd.metrics import EgressMetrics
from tests.unit.fakekernel import FakeTx

HEADER = "X-Egressd-Mitm-Ca-Fingerprint"


def make_ca_pem() -> tuple[str, str]:
    """A throwaway self-signed CA: (PEM, SHA-256 hex of the DER)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "egressd test CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    der = cert.public_bytes(serialization.Encoding.DER)
    return cert.public_bytes(serialization.Encoding.PEM).decode(), hashlib.sha256(der).hexdigest()


PEM, FP = make_ca_pem()


@dataclass
class Server:
    """An aiohttp app on 127.0.0.1:<free port> in its own thread and event loop."""

    make_app: Callable[[], web.Application]
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    runner: web.AppRunner | None = None
    port: int = 0

    async def _start(self) -> None:
        self.runner = web.AppRunner(self.make_app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def _stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def __enter__(self) -> Server:
        self.thread = threading.Thread(target=self.loop.run_forever, name="ca-stub", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"


def fake(status: int, body: str, headers: dict[str, str] | None = None) -> Callable[[], web.Application]:
    """The contract of GET /v1/mitm/ca, as the lead's daemon will serve it."""

    async def handle(request: web.Request) -> web.Response:
        ctype = "application/x-pem-file" if status == 200 else "text/plain"
        return web.Response(status=status, text=body, content_type=ctype, headers=headers)

    def make() -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/mitm/ca", handle)
        return app

    return make


def fleet(mitm_ca: Callable[[], tuple[str, str] | None] | None) -> Callable[[], web.Application]:
    def make() -> web.Application:
        control = ControlPlane(FleetPlanKernel(TableConfig(), FakeTx(yield_each_call=False)))
        return FleetHTTP(control, EgressMetrics(), mitm_ca=mitm_ca).app()

    return make


def run(capsys: pytest.CaptureFixture[str], addr: str, *argv: str) -> tuple[int, str, str]:
    code = main(["--addr", addr, *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_fingerprint_helpers() -> None:
    assert fingerprint(certificate_der(PEM)) == FP
    assert normalise_fingerprint(":".join(FP[i : i + 2] for i in range(0, len(FP), 2)).upper()) == FP
    for bad in ("", "hello", "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----"):
        with pytest.raises(CliError):
            certificate_der(bad)


@pytest.mark.parametrize("header", [FP, FP.upper(), None])
def test_ca_prints_pem(capsys: pytest.CaptureFixture[str], header: str | None) -> None:
    with Server(fake(200, PEM, {HEADER: header} if header else None)) as srv:
        code, out, err = run(capsys, srv.addr, "ca")
        assert (code, out, err) == (0, PEM, "")
        code, out, err = run(capsys, srv.addr, "ca", "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc == {"fingerprint": FP, "pem": PEM}
    assert out.count("\n") == 1  # one JSON document, one line


def test_ca_fingerprint_mismatch_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with Server(fake(200, PEM, {HEADER: "00" * 32})) as srv:
        for argv in (("ca",), ("--json", "ca")):
            code, out, err = run(capsys, srv.addr, *argv)
            assert (code, out) == (1, "")
            assert err.startswith("egressctl: GET /v1/mitm/ca: certificate SHA-256 ") and err.count("\n") == 1


def test_ca_not_a_certificate(capsys: pytest.CaptureFixture[str]) -> None:
    with Server(fake(200, "<html>proxy login</html>")) as srv:
        code, out, err = run(capsys, srv.addr, "ca")
    assert (code, out) == (1, "")
    assert err == "egressctl: GET /v1/mitm/ca: the answer holds no PEM certificate\n"


def test_ca_server_error(capsys: pytest.CaptureFixture[str]) -> None:
    with Server(fake(500, "boom")) as srv:
        code, out, err = run(capsys, srv.addr, "--json", "ca")
    assert (code, out, err) == (1, "", "egressctl: GET /v1/mitm/ca: 500 boom\n")


def test_fleet_app_without_ca_is_404_mitm_disabled(capsys: pytest.CaptureFixture[str]) -> None:
    for provider in (None, lambda: None):
        with Server(fleet(provider)) as srv:
            for argv in (("ca",), ("ca", "--json")):
                code, out, err = run(capsys, srv.addr, *argv)
                assert (code, out) == (1, "")
                assert err == "egressctl: GET /v1/mitm/ca: 404 mitm disabled (MITM CA not available)\n"


def test_fleet_app_serves_the_provided_ca(capsys: pytest.CaptureFixture[str]) -> None:
    with Server(fleet(lambda: (PEM, FP))) as srv:
        code, out, _ = run(capsys, srv.addr, "--json", "ca")
    assert code == 0 and json.loads(out) == {"fingerprint": FP, "pem": PEM}
