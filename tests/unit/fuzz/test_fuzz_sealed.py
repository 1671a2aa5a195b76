"""Fuzzing the sealed-vault wrapper (docs/reference/behaviour.md §11) through :func:`parse_binding_input`.

Genuine wrappers are sealed for a sandbox with the harness key, their plaintext a §6 body whose
credential values carry a planted canary; then the wrapper, the sealed object, the base64 text,
the decoded nonce/ciphertext/tag and the opening sandbox uid are mutated. Oracles:

* only :class:`InputError` escapes (every wrapper/AEAD failure is a permanent 400, never 500);
* a reason is one line and never carries the canary, the ``ct`` text or the plaintext;
* AEAD integrity: a vault opens only if its nonce, ciphertext and tag are byte-identical to
  what was sealed, with the same key and the same sandbox uid (AAD);
* the parsed input's ``repr`` never shows the canary.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from egressd.actionhandler.inputs import InputError, VaultAction, parse_binding_input
from egressd.policy import parse_policy_obj
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
from tests.unit.fuzz.support import canary, fuzz, hit

KEYS = F.make_keystore()
UIDS = ["u-1", "u-2", "U-1", "u-1 ", "ü"]


@st.composite
def sealed_inputs(draw: st.DrawFn) -> tuple[str, str, str, bool, int, str]:
    """(binding input text, opening uid, sealing uid, sealed with the daemon's key?, secret id,
    ct text as sealed)."""
    secret_id = draw(st.integers(0, 2**32 - 1))
    body: Any = draw(vault_bodies(secret_id))
    plaintext = json.dumps(body).encode()
    if draw(st.integers(0, 4)) == 0:
        plaintext = draw(mutate_bytes(plaintext))  # still sealed correctly: tests §6 after AEAD
    seal_uid = draw(st.sampled_from(UIDS))
    open_uid = seal_uid if draw(st.integers(0, 3)) else draw(st.sampled_from(UIDS))
    key = F.KEY if draw(st.integers(0, 5)) else bytes(32)
    vault = seal_with_nonce(plaintext, seal_uid, F.KID, key, draw(st.binary(min_size=12, max_size=12)))
    sealed_ct = vault["ct"]
    policy: Any = F.POLICY if draw(st.booleans()) else draw(policies)
    wrapper: Any = build_wrapper(policy, vault)
    how = draw(st.sampled_from(["none", "none", "blob", "b64", "fields", "wrapper"]))
    if how == "blob":
        blob = base64.b64decode(sealed_ct)
        wrapper["vault"]["ct"] = base64.b64encode(draw(mutate_bytes(blob))).decode()
    elif how == "b64":
        wrapper["vault"]["ct"] = draw(mutate_bytes(sealed_ct.encode())).decode("latin-1")
    elif how == "fields":
        wrapper["vault"] = draw(mutate_json(wrapper["vault"]))
    elif how == "wrapper":
        wrapper = draw(mutate_json(wrapper))
    text = json.dumps(wrapper)
    if draw(st.integers(0, 9)) == 0:
        text = draw(mutate_bytes(text.encode())).decode("utf-8", "replace")
    if draw(st.integers(0, 19)) == 0:
        text = json.dumps(draw(json_values))
    return text, open_uid, seal_uid, key == F.KEY, secret_id, sealed_ct


@fuzz("sealed", ci=400, campaign=30_000)
@given(case=sealed_inputs())
def test_sealed_wrappers_fail_closed_and_quietly(case: tuple[str, str, str, bool, int, str]) -> None:
    hit("sealed")
    text, uid, seal_uid, right_key, secret_id, sealed_ct = case
    secret = canary(secret_id)
    try:
        parsed = parse_binding_input(text, uid=uid, keys=KEYS)
    except InputError as exc:
        reason = str(exc)
        assert "\n" not in reason, reason
        assert secret.lower() not in reason.lower() and sealed_ct[:24] not in reason, reason
        return
    assert secret not in repr(parsed)
    if parsed.vault is VaultAction.SET:
        # Something opened: it must be exactly what was sealed, for this sandbox, with our key.
        wrapper = json.loads(text.strip())
        opened = base64.b64decode(wrapper["vault"]["ct"])
        assert opened == base64.b64decode(sealed_ct), "a tampered vault was opened"
        assert uid == seal_uid, "a vault sealed for another sandbox was opened"
        assert right_key, "a vault sealed with another key was opened"
        assert parsed.content is not None
        assert parsed.policy == parse_policy_obj(wrapper["policy"])
