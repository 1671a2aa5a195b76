"""Sealed vault of the binding input (docs/reference/behaviour.md §11): wrapper, sealed object, AEAD, key directory."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from egressd.vault.keys import KeyDirError, KeyRing, KeyStore, decode_key, load_keys
from egressd.vault.sealed import (
    Sealed,
    SealError,
    build_wrapper,
    decode_vault_plaintext,
    is_wrapper,
    open_sealed,
    parse_sealed,
    parse_wrapper,
    seal,
)

SECRET = "sk-PLANTED-SECRET-0123456789"
PLAINTEXT = json.dumps(
    {
        "credentials": [{"name": "gh", "source": {"type": "inline", "value": SECRET}}],
        "bindings": [
            {
                "name": "b",
                "match": {"hosts": ["api.github.com"]},
                "auth": {"type": "bearer", "credential": "gh"},
            }
        ],
    }
).encode()
KEY1 = bytes(range(32))
KEY2 = bytes(range(100, 132))
UID = "u-1"


def ring(*entries: tuple[str, bytes]) -> KeyRing:
    return KeyRing(entries or [("k1", KEY1)])


def sealed_obj(
    plaintext: bytes = PLAINTEXT, uid: str = UID, kid: str = "k1", key: bytes = KEY1
) -> dict[str, object]:
    return seal(plaintext, uid, kid, key)


def raw_ct(obj: dict[str, object]) -> bytes:
    ct = obj["ct"]
    assert isinstance(ct, str)
    return base64.b64decode(ct)


def with_ct(obj: dict[str, object], blob: bytes) -> dict[str, object]:
    return {**obj, "ct": base64.b64encode(blob).decode()}


def assert_no_secret(exc: BaseException) -> None:
    text = f"{exc} {exc!r} {getattr(exc, 'reason', '')}"
    assert SECRET not in text
    assert "\n" not in str(exc)


# --------------------------------------------------------------------------- AEAD


def test_round_trip() -> None:
    obj = sealed_obj()
    assert set(obj) == {"v", "kid", "alg", "ct"}
    assert obj["v"] == 1 and obj["kid"] == "k1" and obj["alg"] == "A256GCM"
    assert len(raw_ct(obj)) == 12 + len(PLAINTEXT) + 16
    plaintext = open_sealed(parse_sealed(obj), UID, ring())
    assert plaintext == PLAINTEXT
    assert decode_vault_plaintext(plaintext) == json.loads(PLAINTEXT)


def test_interoperates_with_plain_aesgcm() -> None:
    """The format is nonce || ciphertext || tag with AAD = UTF-8 uid, as any AES-GCM library produces it."""
    nonce = os.urandom(12)
    uid = "sandbox-ü"
    blob = nonce + AESGCM(KEY1).encrypt(nonce, b"{}", uid.encode("utf-8"))
    obj = {"v": 1, "kid": "k1", "alg": "A256GCM", "ct": base64.b64encode(blob).decode()}
    assert open_sealed(parse_sealed(obj), uid, ring()) == b"{}"


def test_fresh_nonce_per_seal() -> None:
    assert raw_ct(sealed_obj())[:12] != raw_ct(sealed_obj())[:12]


def test_empty_plaintext_is_28_bytes() -> None:
    obj = sealed_obj(b"")
    assert len(raw_ct(obj)) == 28
    assert open_sealed(parse_sealed(obj), UID, ring()) == b""


def test_unknown_kid() -> None:
    obj = sealed_obj(kid="k9")
    with pytest.raises(SealError, match="unknown kid 'k9'") as info:
        open_sealed(parse_sealed(obj), UID, ring())
    assert info.value.status == 400
    assert_no_secret(info.value)
    with pytest.raises(SealError, match="unknown kid"):
        open_sealed(parse_sealed(obj), UID, KeyRing.empty())


def test_wrong_key_under_known_kid() -> None:
    obj = sealed_obj(key=KEY2)
    with pytest.raises(SealError, match="cannot be opened") as info:
        open_sealed(parse_sealed(obj), UID, ring())
    assert_no_secret(info.value)


def test_transplanted_to_another_uid_fails() -> None:
    obj = sealed_obj(uid="u-1")
    with pytest.raises(SealError, match="cannot be opened") as info:
        open_sealed(parse_sealed(obj), "u-2", ring())
    assert_no_secret(info.value)
    # Prefix / case variants are other sandboxes too.
    for other in ("u-1 ", "U-1", "u-", ""):
        with pytest.raises(SealError):
            open_sealed(parse_sealed(obj), other, ring())


@pytest.mark.parametrize("where", [0, 12, -1, -16])
def test_corrupted_bytes_fail(where: int) -> None:
    blob = bytearray(raw_ct(sealed_obj()))
    blob[where] ^= 0x01  # nonce, first ciphertext byte, last tag byte, first tag byte
    with pytest.raises(SealError, match="cannot be opened") as info:
        open_sealed(parse_sealed(with_ct(sealed_obj(), bytes(blob))), UID, ring())
    assert_no_secret(info.value)


def test_truncated_tag_fails() -> None:
    blob = raw_ct(sealed_obj())
    with pytest.raises(SealError):
        open_sealed(parse_sealed(with_ct(sealed_obj(), blob[:-1])), UID, ring())


def test_rotation_both_keys_decrypt(tmp_path: Path) -> None:
    (tmp_path / "old.key").write_bytes(KEY1)
    (tmp_path / "new.key").write_text(base64.b64encode(KEY2).decode() + "\n")
    os.utime(tmp_path / "old.key", ns=(1_000_000_000, 1_000_000_000))
    os.utime(tmp_path / "new.key", ns=(2_000_000_000, 2_000_000_000))
    keys = load_keys(tmp_path)
    assert keys.kids == ("old", "new")
    assert keys.newest_kid == "new"
    for kid, key in (("old", KEY1), ("new", KEY2)):
        obj = sealed_obj(kid=kid, key=key)
        assert open_sealed(parse_sealed(obj), UID, keys) == PLAINTEXT


def test_seal_rejects_bad_kid_and_key() -> None:
    with pytest.raises(SealError, match="kid"):
        seal(b"x", UID, "bad/kid", KEY1)
    with pytest.raises(SealError, match="32 bytes"):
        seal(b"x", UID, "k1", KEY1[:16])


def test_non_json_plaintext() -> None:
    obj = sealed_obj(b"\xff" + SECRET.encode())
    plaintext = open_sealed(parse_sealed(obj), UID, ring())
    with pytest.raises(SealError, match="not UTF-8 JSON") as info:
        decode_vault_plaintext(plaintext)
    assert_no_secret(info.value)
    with pytest.raises(SealError) as info:
        decode_vault_plaintext(f'{{"value": "{SECRET}"'.encode())
    assert_no_secret(info.value)


# --------------------------------------------------------------------------- sealed object


def good() -> dict[str, object]:
    return {"v": 1, "kid": "k1", "alg": "A256GCM", "ct": base64.b64encode(bytes(40)).decode()}


def test_parse_sealed_good() -> None:
    parsed = parse_sealed(good())
    assert parsed == Sealed("k1", bytes(12), bytes(28))
    assert "ct" not in repr(parsed) and "nonce" not in repr(parsed)


@pytest.mark.parametrize(
    ("patch", "reason"),
    [
        ({"v": 2}, "vault.v"),
        ({"v": True}, "vault.v"),
        ({"v": 1.0}, "vault.v"),
        ({"v": "1"}, "vault.v"),
        ({"kid": ""}, "vault.kid"),
        ({"kid": "a" * 65}, "vault.kid"),
        ({"kid": "k/1"}, "vault.kid"),
        ({"kid": 3}, "vault.kid"),
        ({"alg": "A128GCM"}, "vault.alg"),
        ({"alg": "a256gcm"}, "vault.alg"),
        ({"alg": None}, "vault.alg"),
        ({"ct": 5}, "vault.ct"),
        ({"ct": ""}, "too short"),
        ({"ct": base64.b64encode(bytes(27)).decode()}, "too short"),
        ({"ct": "!!!!" + base64.b64encode(bytes(40)).decode()}, "base64"),
        ({"ct": base64.b64encode(bytes(40)).decode().rstrip("=")}, "base64"),
        ({"ct": base64.urlsafe_b64encode(b"\xfb\xff" * 20).decode()}, "base64"),
        ({"ct": " " + base64.b64encode(bytes(40)).decode()}, "base64"),
        ({"ct": base64.b64encode(bytes(40)).decode() + "\n"}, "base64"),
        ({"ct": "AAAA" * 10 + "=AAA"}, "base64"),
        ({"ct": "ÄAAA" * 10}, "base64"),
        ({"extra": 1}, "unknown key"),
    ],
)
def test_parse_sealed_bad(patch: dict[str, object], reason: str) -> None:
    with pytest.raises(SealError, match=reason) as info:
        parse_sealed({**good(), **patch})
    assert info.value.status == 400


@pytest.mark.parametrize("missing", ["v", "kid", "alg", "ct"])
def test_parse_sealed_missing(missing: str) -> None:
    obj = good()
    del obj[missing]
    with pytest.raises(SealError, match=f"missing {missing}"):
        parse_sealed(obj)


@pytest.mark.parametrize("value", [None, [], "x", 1])
def test_parse_sealed_not_object(value: object) -> None:
    with pytest.raises(SealError, match="JSON object"):
        parse_sealed(value)


# --------------------------------------------------------------------------- wrapper


def test_parse_wrapper() -> None:
    policy = {"defaultAction": "deny"}
    vault = sealed_obj()
    assert parse_wrapper({"osbEgressInput": 1, "policy": policy, "vault": vault}) == (policy, vault, True)
    assert parse_wrapper({"osbEgressInput": 1, "policy": policy, "vault": None}) == (policy, None, True)
    assert parse_wrapper({"osbEgressInput": 1, "policy": policy}) == (policy, None, False)
    w = parse_wrapper(build_wrapper(policy, vault))
    assert w.policy == policy and w.vault == vault and w.has_vault_key
    assert build_wrapper(policy, None) == {"osbEgressInput": 1, "policy": policy}


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ({"osbEgressInput": True, "policy": {}}, "osbEgressInput must be 1"),
        ({"osbEgressInput": 1.0, "policy": {}}, "osbEgressInput must be 1"),
        ({"osbEgressInput": 2, "policy": {}}, "osbEgressInput must be 1"),
        ({"osbEgressInput": "1", "policy": {}}, "osbEgressInput must be 1"),
        ({"osbEgressInput": None, "policy": {}}, "osbEgressInput must be 1"),
        ({"policy": {}}, "osbEgressInput must be 1"),
        ({"osbEgressInput": 1}, "policy is required"),
        ({"osbEgressInput": 1, "policy": {}, SECRET: 1}, "unknown wrapper key"),
        ([], "JSON object"),
    ],
)
def test_parse_wrapper_bad(obj: object, reason: str) -> None:
    with pytest.raises(SealError, match=reason) as info:
        parse_wrapper(obj)
    assert_no_secret(info.value)


def test_is_wrapper() -> None:
    assert is_wrapper({"osbEgressInput": 1})
    assert is_wrapper({"osbEgressInput": None})
    assert not is_wrapper({"defaultAction": "deny"})
    assert not is_wrapper(["osbEgressInput"])


# --------------------------------------------------------------------------- keys


def test_decode_key_formats() -> None:
    assert decode_key(KEY1) == KEY1
    b64 = base64.b64encode(KEY2)
    assert decode_key(b64) == KEY2
    assert decode_key(b"  " + b64 + b"\r\n") == KEY2
    for bad in (
        KEY1 + b"\n",  # 33 bytes, not base64
        KEY1[:31],
        base64.b64encode(bytes(31)),
        base64.b64encode(bytes(33)),
        b64.rstrip(b"="),
        base64.urlsafe_b64encode(b"\xff" * 32),
        b"",
    ):
        with pytest.raises(ValueError):
            decode_key(bad)


def test_load_keys_formats(tmp_path: Path) -> None:
    (tmp_path / "raw.key").write_bytes(KEY1)
    (tmp_path / "b64.key").write_bytes(base64.b64encode(KEY2) + b"\n")
    (tmp_path / "README").write_text("not a key")
    (tmp_path / "raw.key.bak").write_bytes(b"junk")
    (tmp_path / "subdir").mkdir()
    keys = load_keys(tmp_path)
    assert sorted(keys.kids) == ["b64", "raw"]
    assert keys.key("raw") == KEY1 and keys.key("b64") == KEY2
    assert "raw" in keys and "README" not in keys and len(keys) == 2
    assert KEY1.hex() not in repr(keys) and "raw" in repr(keys)


def test_load_keys_symlink_followed(tmp_path: Path) -> None:
    data = tmp_path / "..data"
    data.mkdir()
    (data / "k1.key").write_bytes(KEY1)
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    (keys_dir / "k1.key").symlink_to(data / "k1.key")
    assert load_keys(keys_dir).key("k1") == KEY1


@pytest.mark.parametrize(
    "content",
    [KEY1[:16], KEY1 + b"\n", base64.b64encode(bytes(16)), b"", SECRET.encode(), b"\xff" * 44],
)
def test_load_keys_bad_content(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "good.key").write_bytes(KEY1)
    (tmp_path / "bad.key").write_bytes(content)
    with pytest.raises(KeyDirError, match=r"bad\.key") as info:
        load_keys(tmp_path)
    assert SECRET not in str(info.value)
    assert KEY1.hex() not in str(info.value)


@pytest.mark.parametrize("name", ["bad kid.key", "a+b.key", ".key", ("k" * 65) + ".key"])
def test_load_keys_bad_kid(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_bytes(KEY1)
    with pytest.raises(KeyDirError, match="invalid kid"):
        load_keys(tmp_path)


def test_load_keys_not_regular(tmp_path: Path) -> None:
    (tmp_path / "d.key").mkdir()
    with pytest.raises(KeyDirError, match=r"d\.key: not a regular file"):
        load_keys(tmp_path)
    (tmp_path / "d.key").rmdir()
    os.mkfifo(tmp_path / "f.key")
    with pytest.raises(KeyDirError, match=r"f\.key: not a regular file"):
        load_keys(tmp_path)


def test_load_keys_too_large(tmp_path: Path) -> None:
    (tmp_path / "big.key").write_bytes(b"A" * 10_000)
    with pytest.raises(KeyDirError, match="too large"):
        load_keys(tmp_path)


def test_load_keys_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(KeyDirError, match="does not exist"):
        load_keys(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(KeyDirError, match="not a directory"):
        load_keys(tmp_path / "file")


def test_load_keys_empty_dir(tmp_path: Path) -> None:
    keys = load_keys(tmp_path)
    assert len(keys) == 0 and keys.newest_kid is None


def test_newest_kid_order(tmp_path: Path) -> None:
    for name, key, t in (("k9", KEY1, 5), ("k10", KEY2, 5), ("a", bytes(32), 1)):
        (tmp_path / f"{name}.key").write_bytes(key)
        os.utime(tmp_path / f"{name}.key", ns=(t * 10**9, t * 10**9))
    # mtime first; equal mtimes: digit runs compare as numbers (k10 after k9).
    assert load_keys(tmp_path).kids == ("a", "k9", "k10")
    os.utime(tmp_path / "a.key", ns=(9 * 10**9, 9 * 10**9))
    assert load_keys(tmp_path).newest_kid == "a"


def test_keyring_is_immutable_and_validated() -> None:
    keys = ring()
    with pytest.raises(AttributeError):
        keys._keys = {}
    with pytest.raises(ValueError):
        KeyRing([("k1", KEY1), ("k1", KEY2)])
    with pytest.raises(ValueError):
        KeyRing([("k 1", KEY1)])
    with pytest.raises(ValueError):
        KeyRing([("k1", KEY1[:5])])


def test_keystore_rescans_on_unknown_kid(tmp_path: Path) -> None:
    now = [100.0]
    (tmp_path / "k1.key").write_bytes(KEY1)
    store = KeyStore(tmp_path, clock=lambda: now[0])
    assert store.ring.kids == ("k1",)
    (tmp_path / "k2.key").write_bytes(KEY2)
    # Within the interval: no rescan.
    now[0] += 0.5
    assert "k2" not in store.lookup("k2")
    now[0] += 0.6
    assert store.lookup("k2").key("k2") == KEY2
    # A broken file at a rescan is ignored; the others keep decrypting.
    (tmp_path / "bad.key").write_bytes(b"short")
    now[0] += 5
    assert store.lookup("k1").kids == ("k1", "k2")
    assert set(store.ignored) == {"bad"}
    assert store.last_error is None


def test_keystore_without_dir() -> None:
    store = KeyStore(None)
    assert len(store.lookup("k1")) == 0
    with pytest.raises(KeyDirError):
        KeyStore(Path("/nonexistent/egressd-keys"))
