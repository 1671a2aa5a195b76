"""hypothesis strategies shared by the fuzz targets: JSON values, structural mutation of a
document, byte-wise mutation of a wire message, and generators of the daemon's input shapes
(policies, vault bodies with a planted credential, binding inputs)."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import strategies as st

from tests.unit.fuzz.support import canary

# Values that sit on the edges of the parsers: types, empties, numbers at the limits, strings
# that look like other fields' vocabulary, controls and lone surrogates.
EDGE_STRINGS = [
    "",
    " ",
    "null",
    "{}",
    "[]",
    "x",
    "*",
    "*.",
    "*.example.com",
    "a.*.com",
    "api.example.com",
    "API.Example.COM.",
    "xn--vil-9la.com",
    "évil.com",
    "10.0.0.5",
    "10.0.0.0/24",
    "10.0.0.1/33",
    "::1",
    "::ffff:10.0.0.5",
    "fe80::1%eth0",
    "2001:db8::/32",
    "allow",
    "deny",
    " ALLOW ",
    "audit",
    "enforce",
    "SET_BINDING",
    "LIFECYCLE_HOOK",
    "REMOVE_BINDING",
    "sandbox.data-plane-ready",
    "sandbox.runtime-ready",
    "sandbox.fast.io/actions/v1",
    "bearer",
    "basic",
    "apiKey",
    "customHeaders",
    "passthrough",
    "inline",
    "https",
    "http",
    "/v1/*",
    "/*",
    "..",
    "a/b",
    "a\\b",
    "\x00",
    "\ud800",
    "\n",
    "Authorization",
    "Host",
    "-1",
    "18446744073709551616",
    "x" * 300,
    "a." * 130 + "com",
]
EDGE_NUMBERS: list[Any] = [0, 1, -1, 2, 2**63, 2**64 - 1, 2**64, -(2**64), 1.0, 1.5, -0.0, 1e308]

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EDGE_NUMBERS),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(EDGE_STRINGS),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


# --------------------------------------------------------------------------- mutation


@st.composite
def mutate_json(draw: st.DrawFn, doc: Any, max_steps: int = 3) -> Any:
    """``doc`` after 1..max_steps structural edits: a node (object member or array item at any
    depth) replaced by another JSON value, removed, or an extra member/item added."""
    out = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, max_steps))):
        # Walk down a random path; stop anywhere.
        parent: Any = None
        key: Any = None
        node = out
        while isinstance(node, dict | list) and node and draw(st.booleans()):
            keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
            parent, key = node, draw(st.sampled_from(keys))
            node = node[key]
        op = draw(st.sampled_from(["replace", "delete", "add", "retype"]))
        if parent is None:
            if op == "replace":
                out = draw(json_values)
            elif isinstance(out, dict) and op == "add":
                out[draw(st.text(max_size=12))] = draw(json_values)
            continue
        if op == "delete":
            del parent[key]
        elif op == "add" and isinstance(node, dict):
            node[draw(st.sampled_from(["foo", "", "mode", "egress", "input", "value", "extra"]))] = draw(
                json_values
            )
        elif op == "add" and isinstance(node, list):
            node.append(draw(json_values))
        elif op == "retype":
            # The same content in another JSON type: "1" <-> 1, [x] around, {"k": x}.
            parent[key] = draw(st.sampled_from([[node], {"k": node}, json.dumps(node), None]))
        else:
            parent[key] = draw(json_values)
    return out


INTERESTING_BYTES = [
    b'"',
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"\\",
    b"\x00",
    b"\xff",
    b"\xc3",
    b"null",
    b"\\u0000",
    b"\\ud800",
    b"1e999",
    b"-",
]


@st.composite
def mutate_bytes(draw: st.DrawFn, data: bytes, max_steps: int = 4) -> bytes:
    """``data`` after 1..max_steps byte-level edits: bit flips, deletions, insertions of random
    or syntax bytes, duplicated or truncated slices (the classic mutation-fuzzer operators)."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, max_steps))):
        op = draw(st.sampled_from(["flip", "set", "delete", "insert", "dup", "truncate"]))
        n = len(buf)
        if n == 0:
            buf += draw(st.binary(min_size=1, max_size=8))
            continue
        i = draw(st.integers(0, n - 1))
        if op == "flip":
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            buf[i] = draw(st.integers(0, 255))
        elif op == "delete":
            del buf[i : i + draw(st.integers(1, 8))]
        elif op == "insert":
            buf[i:i] = draw(st.one_of(st.sampled_from(INTERESTING_BYTES), st.binary(min_size=1, max_size=8)))
        elif op == "dup":
            j = draw(st.integers(i, min(n, i + 16)))
            buf[i:i] = buf[i:j]
        else:
            del buf[i:]
    return bytes(buf)


# --------------------------------------------------------------------------- daemon shapes

domain_labels = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=10)
domains = st.builds(
    lambda labels, tld: ".".join([*labels, tld]),
    st.lists(domain_labels, min_size=1, max_size=3),
    st.sampled_from(["com", "org", "example", "test"]),
)
targets = st.one_of(
    domains,
    domains.map(lambda d: "*." + d),
    st.sampled_from(
        ["api.example.com", "*.svc.example.org", "9.9.9.9", "10.0.0.0/8", "2001:db8::1", "evil.com"]
    ),
    st.ip_addresses().map(str),
    st.tuples(st.ip_addresses(v=4), st.integers(0, 32)).map(lambda t: f"{t[0]}/{t[1]}"),
    st.sampled_from(EDGE_STRINGS),
)
rules = st.fixed_dictionaries(
    {"target": targets}, optional={"action": st.sampled_from(["allow", "deny", "ALLOW", " deny ", "", "foo"])}
)
policies = st.fixed_dictionaries(
    {},
    optional={
        "defaultAction": st.sampled_from(["allow", "deny", "", "Deny", "bogus"]),
        "egress": st.one_of(st.none(), st.lists(rules, max_size=6)),
        "mode": st.sampled_from(["enforce", "audit", "", "x"]),
    },
)

hosts = st.one_of(
    st.sampled_from(["api.example.com", "x.svc.example.org", "*.svc.example.org", "evil.com", "10.0.0.1"]),
    domains,
)
credential_names = st.sampled_from(["tok", "tok2", "k", "", " tok "])


@st.composite
def vault_bodies(draw: st.DrawFn, secret_id: int) -> dict[str, Any]:
    """A §6 create body whose every credential value carries the planted canary."""
    secret = canary(secret_id)
    creds = [
        {
            "name": name,
            "source": {"type": "inline", "value": secret + draw(st.sampled_from(["", " x", "/+%&="]))},
        }
        for name in draw(st.lists(credential_names, min_size=0, max_size=3))
    ]
    bindings = []
    for i in range(draw(st.integers(0, 3))):
        auth_type = draw(
            st.sampled_from(["bearer", "basic", "apiKey", "customHeaders", "passthrough", "oauth"])
        )
        auth: dict[str, Any] = {"type": auth_type, "credential": draw(credential_names)}
        if auth_type == "apiKey":
            auth["name"] = draw(st.sampled_from(["X-Api-Key", "Host", "bad name", ""]))
        if auth_type == "customHeaders":
            auth = {"type": auth_type, "headers": [{"name": "X-A", "credential": draw(credential_names)}]}
        if draw(st.booleans()):
            auth["substitutions"] = [
                {
                    "credential": draw(credential_names),
                    "placeholder": "PH_" + str(i),
                    "in": draw(
                        st.lists(st.sampled_from(["path", "query", "header", "body", "x"]), max_size=3)
                    ),
                }
            ]
        match: dict[str, Any] = {"hosts": draw(st.lists(hosts, min_size=0, max_size=3))}
        if draw(st.booleans()):
            match["paths"] = draw(
                st.lists(st.sampled_from(["/v1/*", "/v1/foo", "/*", "v1", "/x"]), max_size=2)
            )
        if draw(st.booleans()):
            match["methods"] = draw(st.lists(st.sampled_from(["GET", "post", "", "PUT"]), max_size=2))
        if draw(st.booleans()):
            match["schemes"] = draw(st.lists(st.sampled_from(["https", "http", "ftp"]), max_size=2))
        if draw(st.booleans()):
            match["ports"] = draw(st.lists(st.sampled_from([443, 80, 8443]), max_size=2))
        bindings.append({"name": draw(st.sampled_from([f"b{i}", "b0", ""])), "match": match, "auth": auth})
    return {"credentials": creds, "bindings": bindings}


@st.composite
def vault_mutations(draw: st.DrawFn, secret_id: int) -> dict[str, Any]:
    """A §6 PATCH body; added/replaced credential values carry the canary."""
    body = draw(vault_bodies(secret_id))
    out: dict[str, Any] = {}
    if draw(st.booleans()):
        out["expectedRevision"] = draw(st.sampled_from([1, 2, 0, -1, "1", None]))
    ops: dict[str, Any] = {}
    for op in ("add", "replace"):
        if draw(st.booleans()):
            ops[op] = body["credentials"]
    if draw(st.booleans()):
        ops["delete"] = draw(st.lists(credential_names, max_size=2))
    if ops:
        out["credentials"] = ops
    bops: dict[str, Any] = {}
    for op in ("add", "replace"):
        if draw(st.booleans()):
            bops[op] = body["bindings"]
    if draw(st.booleans()):
        bops["delete"] = draw(st.lists(st.sampled_from(["b0", "b1", "x"]), max_size=2))
    if bops:
        out["bindings"] = bops
    return out


def seal_with_nonce(plaintext: bytes, uid: str, kid: str, key: bytes, nonce: bytes) -> dict[str, Any]:
    """:func:`egressd.vault.sealed.seal` with a drawn nonce: seal() takes its nonce from
    os.urandom, and hypothesis needs a strategy to draw the same bytes when it replays a case."""
    ct = AESGCM(key).encrypt(nonce, plaintext, uid.encode("utf-8"))
    return {"v": 1, "kid": kid, "alg": "A256GCM", "ct": base64.b64encode(nonce + ct).decode("ascii")}
