"""The one redactor (egressd/mitmchild/redact.py, docs/reference/behaviour.md §10): whole or streamed in any
split, the same output as a plain reference (every occurrence found on the original, overlaps
merged into one marker), never holding back more than the longest string minus one byte, and
holding back nothing when the data ends in bytes no redaction string starts with."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.mitmchild.redact import MARKER, StreamRedactor, compile_needles, redact_bytes, redact_str


def reference(data: bytes, needles: list[bytes]) -> bytes:
    """The textbook algorithm: all spans on the original, sorted, overlapping ones merged."""
    spans = []
    for n in {x for x in needles if x}:
        i = data.find(n)
        while i >= 0:
            spans.append((i, i + len(n)))
            i = data.find(n, i + 1)
    spans.sort()
    merged: list[list[int]] = []
    for s, e in spans:
        if merged and s < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    out, pos = b"", 0
    for s, e in merged:
        out += data[pos:s] + MARKER
        pos = e
    return out + data[pos:]


def streamed(data: bytes, cuts: list[int], needles: list[bytes]) -> tuple[bytes, int]:
    r = StreamRedactor(compile_needles([n.decode() for n in needles]))
    out, held_max, last = b"", 0, 0
    for cut in [*sorted({min(max(c, 0), len(data)) for c in cuts}), len(data)]:
        out += r.feed(data[last:cut])
        held_max = max(held_max, r.held)
        last = cut
    return out + r.finish(), held_max


# A small alphabet makes overlaps, nesting and near misses frequent.
_alpha = st.text(alphabet="abAB-", min_size=0, max_size=60).map(str.encode)
_needle = st.text(alphabet="abAB-", min_size=1, max_size=7)


@settings(max_examples=600, deadline=None)
@given(data=_alpha, needles=st.lists(_needle, min_size=1, max_size=5), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_every_split_redacts_like_the_whole(data: bytes, needles: list[str], cuts: list[int]) -> None:
    raw = [n.encode() for n in needles]
    want = reference(data, raw)
    assert redact_bytes(data, compile_needles(needles)) == want
    got, held_max = streamed(data, cuts, raw)
    assert got == want
    assert held_max <= max(len(n) for n in raw) - 1


@settings(max_examples=300, deadline=None)
@given(data=_alpha, needles=st.lists(_needle, min_size=1, max_size=5))
def test_byte_by_byte(data: bytes, needles: list[str]) -> None:
    raw = [n.encode() for n in needles]
    got, _ = streamed(data, list(range(len(data))), raw)
    assert got == reference(data, raw)


def test_marker_semantics() -> None:
    n = compile_needles(["SECRET", "Bearer SECRET", "RED"])
    assert redact_bytes(b"xBearer SECRETy RED", n) == b"x[REDACTED]y [REDACTED]"
    assert redact_bytes(b"ABAB", compile_needles(["AB"])) == b"[REDACTED][REDACTED]"  # adjacent: two
    assert redact_bytes(b"xABCDEy", compile_needles(["ABC", "CDE"])) == b"x[REDACTED]y"  # overlap: one
    assert redact_bytes(b"clean", n) == b"clean"
    # Markers are never rescanned: the output still "contains" RED, nothing loops.
    assert redact_bytes(b"[REDACTED]", compile_needles(["RED", "ACT"])) == b"[" + MARKER * 2 + b"ED]"
    assert redact_str("t=SECRET", n) == "t=[REDACTED]"


def test_an_event_is_released_whole_when_it_ends_in_bytes_no_string_starts_with() -> None:
    """Server-sent events end in blank lines: redaction must add no delay to them."""
    r = StreamRedactor(compile_needles(["sk-live-0123456789"]))
    event = b'data: {"delta": "hello sk-"}\n\n'
    assert r.feed(event) == event and r.held == 0
    held = r.feed(b"data: sk-live-01")  # may be the start of the secret: held back
    assert held == b"data: " and r.held == len(b"sk-live-01")
    assert r.feed(b"23456789 done\n\n") == b"[REDACTED] done\n\n"
    assert r.finish() == b""


def test_a_secret_split_across_many_chunks() -> None:
    secret = b"sk-live-MITM-4f9a2c"
    n = compile_needles([secret.decode()])
    body = b"A" * 10 + secret + b"B" * 10
    for size in (1, 2, 3, 7):
        r = StreamRedactor(n)
        out = b"".join(r.feed(body[i : i + size]) for i in range(0, len(body), size)) + r.finish()
        assert out == b"A" * 10 + MARKER + b"B" * 10
    assert secret not in out


def test_no_needles_passes_bytes_through() -> None:
    r = StreamRedactor(compile_needles([]))
    assert r.feed(b"abc") == b"abc" and r.finish() == b""
    assert redact_bytes(b"abc", compile_needles(["", ""])) == b"abc"


def test_needles_are_never_in_a_repr() -> None:
    n = compile_needles(["sk-super-secret"])
    assert "sk-super-secret" not in repr(n) and "redacted" in repr(n)


def test_unicode_strings_match_their_utf8_bytes() -> None:
    n = compile_needles(["clé-secrète"])
    assert redact_bytes("x clé-secrète y".encode(), n) == b"x [REDACTED] y"
    assert redact_str("x clé-secrète y", n) == "x [REDACTED] y"
