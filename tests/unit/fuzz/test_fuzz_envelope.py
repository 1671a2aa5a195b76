"""Fuzzing the action envelope (docs/reference/behaviour.md §1, §3, §11) at two depths.

* ``envelope``: :func:`parse_action` alone, on structurally mutated envelopes and on byte-wise
  mutated wire bodies. Oracle: it returns an action or raises :class:`EnvelopeError` with a
  one-line reason that never quotes the binding input.
* ``actions``: the whole POST /_fastlet/v1/actions core (``FleetHTTP._act``) against a control
  plane seeded with an active, a denying and a vault-holding subject, on a kernel that never
  fails. Oracles: no 5xx (no kernel cause exists), a 400 or 409 leaves registry, kernel views,
  vaults, pending state and the list of transactions exactly as they were, no log event
  carries the planted secret or an unexpected exception, and the registry invariants hold.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import event, example, given
from hypothesis import strategies as st

from egressd.actionhandler.envelope import (
    EnvelopeError,
    LifecycleHook,
    RemoveBinding,
    SetBinding,
    parse_action,
)
from egressd.subject.registry import State
from egressd.vault.sealed import build_wrapper
from tests.unit.fuzz import fleet as F
from tests.unit.fuzz.strategies import (
    json_values,
    mutate_bytes,
    mutate_json,
    policies,
    seal_with_nonce,
    vault_bodies,
)
from tests.unit.fuzz.support import (
    assert_no_crash_logged,
    assert_not_in_logs,
    canary,
    captured_logs,
    fuzz,
    hit,
    run,
)

# The planted secret lives inside every binding input: the binding input is never logged (§12)
# and never quoted in a reason. Lower-case so that policy normalisation cannot hide it.
INPUT_SECRET = "zzinputcanary7f3a"


def _inputs(secret_id: int) -> st.SearchStrategy[Any]:
    """Binding inputs: null, bare policies (secret in a target or an ignored key), wrappers
    with a sealed vault (secret in the credential value), junk strings, non-strings."""
    bare = policies.map(lambda p: json.dumps({**p, "note": INPUT_SECRET}))
    secret_target = st.sampled_from(
        [
            json.dumps({"egress": [{"action": "allow", "target": f"{INPUT_SECRET}.com"}]}),
            json.dumps({"egress": [{"action": "bogus", "target": INPUT_SECRET}]}),
            json.dumps({"defaultAction": INPUT_SECRET}),
            json.dumps({"egress": [{"target": f"{INPUT_SECRET}/99"}]}),
            json.dumps({"egress": [{"target": f"*{INPUT_SECRET}*"}]}),
            json.dumps({"mode": INPUT_SECRET}),
            f"not json {INPUT_SECRET}",
        ]
    )
    sealed = st.tuples(
        vault_bodies(secret_id),
        st.sampled_from(["u-new", F.ACTIVE, "other"]),
        st.booleans(),
        st.binary(min_size=12, max_size=12),  # the nonce: drawn, so a replayed case is identical
    ).map(
        lambda t: json.dumps(
            build_wrapper(
                F.POLICY,
                seal_with_nonce(json.dumps(t[0]).encode(), t[1], F.KID, F.KEY if t[2] else bytes(32), t[3]),
            )
        )
    )
    return st.one_of(st.none(), bare, secret_target, sealed, st.sampled_from(["", "null", "{}"]), json_values)


@st.composite
def envelopes(draw: st.DrawFn) -> tuple[Any, int]:
    secret_id = draw(st.integers(0, 2**32 - 1))
    uid = draw(
        st.sampled_from([F.ACTIVE, F.DENYING, F.WITH_VAULT, F.ABSENT, "u-new", "U-ACT", "u_act", "x" * 129])
    )
    op = draw(st.sampled_from(["SET_BINDING", "LIFECYCLE_HOOK", "REMOVE_BINDING"]))
    ip = draw(
        st.sampled_from(["10.0.0.5", "10.0.0.6", "10.0.0.9", "::ffff:10.0.0.9", "2001:db8::9", "", "bad"])
    )
    if op == "SET_BINDING":
        doc = F.set_binding(
            uid, ip, input=draw(_inputs(secret_id)), gen=draw(st.sampled_from([0, 1, 2, 2**64 - 1]))
        )
        doc["attachment"]["network"]["privateCidr"] = draw(
            st.sampled_from(["10.0.0.0/24", "", "10.0.0.0/33"])
        )
    elif op == "LIFECYCLE_HOOK":
        doc = F.hook(uid, draw(st.sampled_from(["sandbox.data-plane-ready", "sandbox.runtime-ready", "x"])))
    else:
        doc = F.remove(uid)
    if draw(st.booleans()):
        doc["revision"]["attachmentId"] = draw(st.sampled_from(["a1", "a2", ""]))
    if draw(st.integers(0, 2)) == 0:
        doc = draw(mutate_json(doc))
    return doc, secret_id


def _wire(draw: Any, doc: Any) -> bytes:  # a DrawFn or DataObject.draw
    body = json.dumps(doc).encode()
    if draw(st.integers(0, 3)) == 0:
        body = draw(mutate_bytes(body))
    return body


def _check_parse(body: bytes) -> None:
    try:
        action = parse_action(body)
    except EnvelopeError as exc:
        reason = str(exc)
        assert reason and "\n" not in reason and len(reason) < 400, reason
        assert INPUT_SECRET not in reason.lower()
        return
    assert isinstance(action, SetBinding | LifecycleHook | RemoveBinding)
    assert action.uid and len(action.uid) <= 128
    assert action.fence.runtime_instance_id and action.fence.attachment_id
    assert INPUT_SECRET not in repr(action).lower()


@fuzz("envelope", ci=400, campaign=120_000)
@given(data=st.data())
@example(data=None)  # the §1.1 vectors, once each (see the test body)
def test_parse_action_only_raises_envelope_errors(data: st.DataObject | None) -> None:
    hit("envelope")
    if data is None:
        for body in (
            b"{",
            b"",
            b"[]",
            b"null",
            b"\xff",
            b'{"apiVersion":"sandbox.fast.io/actions/v1"}',
            b"1e999",
        ):
            _check_parse(body)
        return
    doc, _ = data.draw(envelopes())
    _check_parse(json.dumps(doc).encode())
    _check_parse(_wire(data.draw, doc))


@fuzz("actions", ci=150, campaign=8_000)
@given(data=st.data())
def test_actions_never_5xx_and_refusals_change_nothing(data: st.DataObject) -> None:
    hit("actions")
    fleet = run(F.make_fleet())
    doc, secret_id = data.draw(envelopes())
    body = _wire(data.draw, doc)
    before = F.snapshot(fleet)
    with captured_logs() as logs:
        status, text = run(fleet.act(body))
    event(f"status {status}")
    # The one 5xx with no kernel cause that the spec itself asks for (§1: a missing gateway
    # parses, then the deny-first install fails with 500); everything else 5xx is a finding.
    spec_500 = status == 500 and "attachment.network.gateway is required" in text
    assert status in (200, 400, 409) or spec_500, (status, text)
    assert text.count("\n") <= 1, text
    lowered = text.lower()
    assert INPUT_SECRET not in lowered and canary(secret_id).lower() not in lowered
    if status in (400, 409):
        assert F.snapshot(fleet) == before, f"{status} {text!r} changed state"
    assert_not_in_logs(logs, INPUT_SECRET, canary(secret_id), F.SEED_VALUE)
    assert_no_crash_logged(logs)
    for entry in fleet.control.registry:
        if entry.state is State.ACTIVE:
            assert entry.policy is not None and entry.pending is None
            view = fleet.control.registry.kernel(entry.uid)
            assert view.objects and view.rules, "active without kernel objects"
