"""``egressctl ca``: print the MITM CA certificate; its checks are :mod:`egressd.cli.ca`."""

from __future__ import annotations

import argparse
import sys

from egressd.cli.ca import CA_PATH, FINGERPRINT_HEADER, certificate_der, fingerprint, normalise_fingerprint
from egressd.cli.client import EXIT_FAILURE, EXIT_OK, CliError
from egressd.cli.command import Command, Context, _expect_ok
from egressd.terminal import visible

__all__ = ["CA", "cmd_ca"]


def cmd_ca(ctx: Context, args: argparse.Namespace) -> int:
    resp = ctx.client.get(CA_PATH)
    if resp.status == 404:
        # 404 is the daemon's way of saying the MITM is off: a refusal, not a missing route.
        raise CliError(f"GET {CA_PATH}: {resp.summary()} (MITM CA not available)", EXIT_FAILURE)
    _expect_ok(resp, "GET", CA_PATH)
    pem = resp.text()
    fp = fingerprint(certificate_der(pem))
    announced = resp.header(FINGERPRINT_HEADER)
    if announced is not None and normalise_fingerprint(announced) != fp:
        # Someone bakes this into images: a certificate that does not match what the daemon
        # says it serves is not printed at all.
        raise CliError(
            f"GET {CA_PATH}: certificate SHA-256 {fp} does not match {FINGERPRINT_HEADER} {announced}",
            EXIT_FAILURE,
        )
    if ctx.json_output:
        ctx.emit_json({"fingerprint": fp, "pem": pem})
    else:
        # The PEM text as served (redirect to a file and it is the certificate file), only
        # ever with its control characters made visible (a certificate has none).
        sys.stdout.write("".join(visible(line) + "\n" for line in pem.splitlines()))
    return EXIT_OK


CA = Command(
    "ca",
    "print the MITM CA certificate (PEM) to bake into sandbox images",
    run=cmd_ca,
    epilog=(
        f"GET {CA_PATH}. Prints the PEM as served; --json prints "
        '{"fingerprint": "<sha256 of the DER, lowercase hex>", "pem": "..."}.\n'
        "Exit 1 when the MITM is disabled (404) or the certificate does not match the daemon's "
        f"{FINGERPRINT_HEADER} header."
    ),
)
