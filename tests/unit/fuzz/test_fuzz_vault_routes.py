"""Fuzzing vault bodies and /policy edits through both HTTP surfaces that take them.

* ``proxy_route``: :meth:`ProxyRouteAPI.handle` (fleet, docs/reference/behaviour.md §4, §6) for every method on
  every route suffix, both addressing forms, generation headers, and bodies that are §6
  create/mutation documents, /policy documents, PATCH/DELETE arrays, mutated or junk, against
  the seeded fleet (active, denying, vault-holding and absent subjects).
* ``sidecar``: the sidecar's ``/policy`` and ``/credential-vault`` handlers (§5, §6, §13) on
  an engine with a never-failing kernel and, half of the time, a seeded vault.

Oracles: no exception and no 5xx (the kernel never fails, and one request cannot fill the
pending cache); every 4xx leaves all state (registry, kernel views, vaults, pending pushes,
transactions / policy, persisted policy, kernel scripts) exactly as it was; no reply and no
log event carries a planted credential value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp.test_utils import make_mocked_request
from hypothesis import event, given
from hypothesis import strategies as st

from egressd.metrics import EgressMetrics
from egressd.policy import parse_policy
from egressd.sidecar.engine import SidecarEngine
from egressd.sidecar.http import SidecarHTTP, VaultPrerequisites
from egressd.sidecarnft.ruleset import SidecarTable
from egressd.web.route import GENERATION_HEADER, UID_HEADER
from egressd.web.vaultapi import Reply
from tests.unit.fakekernel import FakeTx
from tests.unit.fuzz import fleet as F
from tests.unit.fuzz.strategies import (
    json_values,
    mutate_bytes,
    mutate_json,
    policies,
    rules,
    targets,
    vault_bodies,
    vault_mutations,
)
from tests.unit.fuzz.support import (
    assert_no_crash_logged,
    assert_not_in_logs,
    canary,
    captured_logs,
    fuzz,
    hit,
    only_in_value_fields,
    run,
)

SUFFIXES = [
    "/credential-vault",
    "/credential-vault/",
    "/credential-vault/credentials",
    "/credential-vault/credentials/tok",
    "/credential-vault/credentials/%2e%2e",
    "/credential-vault/bindings",
    "/credential-vault/bindings/b1",
    "/credential-vault/_active",
    "/credential-vault/x",
    "/policy",
    "/policy/",
    "/",
]
# Writes weighted up: they are where state can change.
METHODS = ["GET", "PUT", "PUT", "POST", "POST", "PATCH", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def valid_bodies(secret: str) -> list[Any]:
    """Near-valid documents, so a good share of requests get past validation and mutate."""
    cred = {"name": "tok", "source": {"type": "inline", "value": secret}}
    return [
        F.seed_vault(secret),
        {**F.seed_vault(secret), "bindings": []},
        {"credentials": {"replace": [cred]}},
        {"expectedRevision": 1, "credentials": {"add": [{**cred, "name": "tok2"}]}},
        {"bindings": {"delete": ["b1"]}},
        {"credentials": {"delete": ["tok"]}},
        {"defaultAction": "deny", "egress": [{"action": "allow", "target": "api.example.com"}]},
        [{"action": "deny", "target": "api.example.com"}],
        [{"action": "allow", "target": "new.example.com"}],
        ["9.9.9.9"],
        ["api.example.com"],
    ]


@st.composite
def bodies(draw: st.DrawFn, secret_id: int) -> bytes:
    kind = draw(
        st.sampled_from(
            ["valid", "valid", "create", "mutation", "policy", "patch", "delete", "junk", "empty"]
        )
    )
    doc: Any
    if kind == "valid":
        doc = draw(st.sampled_from(valid_bodies(canary(secret_id))))
    elif kind == "create":
        doc = draw(vault_bodies(secret_id))
    elif kind == "mutation":
        doc = draw(vault_mutations(secret_id))
    elif kind == "policy":
        doc = draw(policies)
    elif kind == "patch":
        doc = draw(st.lists(rules, max_size=4))
    elif kind == "delete":
        doc = draw(st.lists(targets, max_size=4))
    elif kind == "junk":
        doc = draw(json_values)
    else:
        return b""
    if draw(st.integers(0, 3)) == 0:
        doc = draw(mutate_json(doc))
    body = json.dumps(doc).encode()
    if draw(st.integers(0, 4)) == 0:
        body = draw(mutate_bytes(body))
    return body


@st.composite
def coherent(draw: st.DrawFn, secret_id: int) -> tuple[str, str, bytes]:
    """A method, suffix and body that belong together (then maybe mutated): most of these get
    past validation, so the success paths (and their state changes) are fuzzed too."""
    secret = canary(secret_id)
    cred = {"name": "tok", "source": {"type": "inline", "value": secret}}
    method, suffix, doc = draw(
        st.sampled_from(
            [
                ("PUT", "/credential-vault", F.seed_vault(secret)),
                ("POST", "/credential-vault", F.seed_vault(secret)),
                ("PATCH", "/credential-vault", {"credentials": {"replace": [cred]}}),
                (
                    "PATCH",
                    "/credential-vault",
                    {"expectedRevision": 1, "credentials": {"add": [{**cred, "name": "t2"}]}},
                ),
                ("PATCH", "/credential-vault", {"bindings": {"delete": ["b1"]}}),
                ("DELETE", "/credential-vault", None),
                ("PUT", "/policy", F.POLICY),
                ("POST", "/policy", {"defaultAction": "allow"}),
                ("PATCH", "/policy", [{"action": "allow", "target": "new.example.com"}]),
                ("PATCH", "/policy", [{"action": "deny", "target": "api.example.com"}]),
                ("DELETE", "/policy", ["9.9.9.9"]),
                ("DELETE", "/policy", ["api.example.com"]),
            ]
        )
    )
    if doc is not None and draw(st.integers(0, 2)) == 0:
        doc = draw(mutate_json(doc))
    body = b"" if doc is None else json.dumps(doc).encode()
    if draw(st.integers(0, 5)) == 0:
        body = draw(mutate_bytes(body))
    return method, suffix, body


@st.composite
def route_requests(draw: st.DrawFn) -> tuple[str, str, dict[str, str], bytes, int]:
    secret_id = draw(st.integers(0, 2**32 - 1))
    uid = draw(
        st.sampled_from(
            [
                F.ACTIVE,
                F.ACTIVE,
                F.WITH_VAULT,
                F.WITH_VAULT,
                F.DENYING,
                F.ABSENT,
                "",
                " u-act ",
                "a%2Fb",
                "x" * 129,
            ]
        )
    )
    suffix = draw(st.sampled_from(["/credential-vault", "/policy", *SUFFIXES]))
    headers: dict[str, str] = {}
    form = draw(st.sampled_from(["path", "path", "header", "both", "mismatch"]))
    if form == "header":
        path = suffix
        headers[UID_HEADER] = uid
    else:
        path = f"/v1/sandboxfleets/{uid}/egress{suffix}"
        if form == "both":
            headers[UID_HEADER] = uid
        elif form == "mismatch":
            headers[UID_HEADER] = F.ACTIVE
    if draw(st.booleans()):
        headers[GENERATION_HEADER] = draw(
            st.sampled_from(["0", "1", "2", " 3 ", "-1", "x", "18446744073709551616", ""])
        )
    method, body = draw(st.sampled_from(METHODS)), draw(bodies(secret_id))
    if draw(st.booleans()):
        method, coherent_suffix, body = draw(coherent(secret_id))
        path = path.replace(suffix, coherent_suffix, 1) if suffix != "/" else path
    return method, path, headers, body, secret_id


def _reply_text(reply: Reply) -> str:
    return f"{reply.status} {reply.text!r} {json.dumps(reply.json)} {reply.allow!r}"


@fuzz("proxy_route", ci=200, campaign=8_000)
@given(req=route_requests())
def test_proxy_route_never_5xx_and_refusals_change_nothing(
    req: tuple[str, str, dict[str, str], bytes, int],
) -> None:
    hit("proxy_route")
    method, path, headers, body, secret_id = req
    secret = canary(secret_id)
    fleet = run(F.make_fleet())
    before = F.snapshot(fleet)
    with captured_logs() as logs:
        reply = run(fleet.proxy.handle(method, path, headers, body))
    event(f"status {reply.status}")
    assert reply.status < 500, _reply_text(reply)
    if reply.status >= 400:
        assert F.snapshot(fleet) == before, f"{_reply_text(reply)} changed state"
    assert_no_crash_logged(logs)
    assert F.SEED_VALUE not in _reply_text(reply)
    if only_in_value_fields(body, secret):
        assert secret.lower() not in _reply_text(reply).lower()
        assert_not_in_logs(logs, secret, F.SEED_VALUE)


# --------------------------------------------------------------------------- sidecar


@dataclass
class Sidecar:
    engine: SidecarEngine
    kernel: FakeTx
    http: SidecarHTTP
    persisted: list[str] = field(default_factory=list)


async def make_sidecar(with_vault: bool) -> Sidecar:
    kernel = FakeTx(yield_each_call=False)  # never fails
    persisted: list[str] = []
    engine = SidecarEngine(
        SidecarTable(table="T", mode="dns+nft"),
        kernel,
        parse_policy(F.POLICY_TEXT),
        persist_path=Path("/nonexistent/egressd-fuzz/policy.json"),
        writer=lambda _path, text: persisted.append(text),  # no disk I/O, but recorded
    )
    await engine.install()
    prereqs = VaultPrerequisites(True, True, False, "dns+nft", lambda: True)
    http = SidecarHTTP(engine, EgressMetrics(), token="t", max_rules=8, prerequisites=prereqs)
    sidecar = Sidecar(engine, kernel, http, persisted)
    if with_vault:
        status, text = await sidecar_call(
            sidecar, "PUT", "/credential-vault", json.dumps(F.seed_vault()).encode()
        )
        assert status == 201, text
    return sidecar


async def sidecar_call(sidecar: Sidecar, method: str, path: str, body: bytes) -> tuple[int, str]:
    request = make_mocked_request(method, path)
    handler = sidecar.http.policy if path.split("?")[0] in ("/policy",) else sidecar.http.credential_vault
    resp = await handler(request, body)
    return resp.status, resp.text or ""


def sidecar_snapshot(sidecar: Sidecar) -> Any:
    store = sidecar.http.vault
    vault = None
    if store is not None:
        snap = store.snapshot()
        vault = (store.tag, None if store.vault is None else store.vault.state(), snap and snap.to_json())
    engine = sidecar.engine
    return (
        engine.user,
        engine.effective,
        engine.generation,
        dict(engine.leases._leases),
        vault,
        list(sidecar.kernel.scripts),
        list(sidecar.persisted),
    )


@st.composite
def sidecar_requests(draw: st.DrawFn) -> tuple[str, str, bytes, int]:
    secret_id = draw(st.integers(0, 2**32 - 1))
    path = draw(
        st.sampled_from(
            [
                "/policy",
                "/policy",
                "/credential-vault",
                *[s for s in SUFFIXES if s.startswith("/credential-vault")],
            ]
        )
    )
    if draw(st.booleans()):
        method, path, body = draw(coherent(secret_id))
        return method, path, body, secret_id
    return draw(st.sampled_from(METHODS)), path, draw(bodies(secret_id)), secret_id


@fuzz("sidecar", ci=200, campaign=8_000)
@given(req=sidecar_requests(), with_vault=st.booleans())
def test_sidecar_never_5xx_and_refusals_change_nothing(
    req: tuple[str, str, bytes, int], with_vault: bool
) -> None:
    hit("sidecar")
    method, path, body, secret_id = req
    secret = canary(secret_id)

    async def scenario() -> tuple[Sidecar, Any, tuple[int, str]]:
        sidecar = await make_sidecar(with_vault)
        before = sidecar_snapshot(sidecar)
        return sidecar, before, await sidecar_call(sidecar, method, path, body)

    with captured_logs() as logs:
        sidecar, before, (status, text) = run(scenario())
    event(f"status {status}")
    assert status < 500, (status, text)
    if status >= 400:
        assert sidecar_snapshot(sidecar) == before, f"{status} {text!r} changed state"
    assert_no_crash_logged(logs)
    assert F.SEED_VALUE not in text
    if only_in_value_fields(body, secret):
        assert secret.lower() not in text.lower()
        assert_not_in_logs(logs, secret, F.SEED_VALUE)
