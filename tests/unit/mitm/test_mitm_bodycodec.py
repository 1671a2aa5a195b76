"""Incremental content decoding for the body scan (egressd/mitmchild/bodycodec.py): every coding
decodes the same whatever the chunking, stacked codings and several members/frames work,
corrupt and truncated bodies are errors, and a chunk that expands beyond the limit is refused
before its output is held (decompression bombs)."""

from __future__ import annotations

import gzip
import zlib

import brotli
import pytest
from backports import zstd
from hypothesis import given, settings
from hypothesis import strategies as st

from egressd.mitmchild.bodycodec import PIECE, DecodedTooLarge, DecodeError, Decoder, parse_codings

TEXT = b"".join(b"line %d: the quick brown fox sk-live-secret\n" % i for i in range(3000))


def encode(data: bytes, coding: str) -> bytes:
    if coding == "gzip":
        return gzip.compress(data)
    if coding == "deflate":
        return zlib.compress(data)
    if coding == "raw-deflate":
        c = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
        return c.compress(data) + c.flush()
    if coding == "br":
        return bytes(brotli.compress(data))
    assert coding == "zstd"
    return zstd.compress(data)


def decode_all(codings: tuple[str, ...], body: bytes, size: int, limit: int = 1 << 30) -> bytes:
    d = Decoder(codings, limit)
    out = b"".join(b"".join(d.feed(body[i : i + size])) for i in range(0, len(body), size))
    d.finish()
    return out


@pytest.mark.parametrize("coding", ["gzip", "deflate", "raw-deflate", "br", "zstd"])
@pytest.mark.parametrize("size", [1, 7, 4096, 1 << 20])
def test_each_coding_decodes_whatever_the_chunking(coding: str, size: int) -> None:
    body = encode(TEXT if size > 1 else TEXT[:3000], coding)
    name = "deflate" if coding == "raw-deflate" else coding
    assert decode_all((name,), body, size) == (TEXT if size > 1 else TEXT[:3000])


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=6), coding=st.sampled_from(["gzip", "deflate", "br", "zstd"]))
def test_any_split_decodes_the_same(cuts: list[int], coding: str) -> None:
    data = TEXT[:1500]
    body = encode(data, coding)
    d = Decoder((coding,))
    out, last = b"", 0
    for cut in [*sorted({min(c, len(body)) for c in cuts}), len(body)]:
        out += b"".join(d.feed(body[last:cut]))
        last = cut
    d.finish()
    assert out == data


def test_stacked_codings_and_several_members() -> None:
    inner = encode(TEXT, "br")
    assert decode_all(("br", "gzip"), gzip.compress(inner), 333) == TEXT  # "br, gzip": gzip outermost
    two = gzip.compress(TEXT[:100]) + gzip.compress(TEXT[100:200])
    assert decode_all(("gzip",), two, 5) == TEXT[:200]
    frames = zstd.compress(TEXT[:100]) + zstd.compress(TEXT[100:200])
    assert decode_all(("zstd",), frames, 5) == TEXT[:200]
    assert decode_all(("gzip",), gzip.compress(b"x") + b"\0\0\0", 2) == b"x"  # padding after the end


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd"])
def test_truncated_and_corrupt_bodies_are_errors(coding: str) -> None:
    body = encode(TEXT, coding)
    with pytest.raises(DecodeError):
        decode_all((coding,), body[: len(body) // 2], 100)
    with pytest.raises(DecodeError):
        decode_all((coding,), b"\x00\xff" * 50 + body, 100)
    d = Decoder((coding,))
    d.finish()  # no body at all (a 204, a HEAD): nothing to complain about


@pytest.mark.parametrize("coding", ["gzip", "br", "zstd"])
def test_a_chunk_that_expands_beyond_the_limit_is_refused(coding: str) -> None:
    bomb = encode(bytes(64 << 20), coding)
    d = Decoder((coding,), limit=4 << 20)
    with pytest.raises(DecodedTooLarge):
        for i in range(0, len(bomb), 1 << 16):
            d.feed(bomb[i : i + (1 << 16)])


def test_output_comes_in_bounded_pieces() -> None:
    pieces = Decoder(("gzip",)).feed(gzip.compress(bytes(1 << 20)))
    assert sum(map(len, pieces)) == 1 << 20
    assert max(map(len, pieces)) <= PIECE


def test_zstd_window_over_8_mib_is_refused() -> None:
    """RFC 9659 bounds a zstd window for HTTP at 8 MiB: a frame asking for more would make the
    decoder allocate it."""
    c = zstd.ZstdCompressor(options={zstd.CompressionParameter.window_log: 27})
    body = c.compress(TEXT * 10) + c.flush(zstd.ZstdCompressor.FLUSH_FRAME)  # size unknown: the window stays
    with pytest.raises(DecodeError):
        decode_all(("zstd",), body, 1 << 16)


@pytest.mark.parametrize(
    ("values", "want"),
    [
        ([], ()),
        (["identity"], ()),
        (["gzip"], ("gzip",)),
        (["x-gzip"], ("gzip",)),
        (["GZIP, br"], ("gzip", "br")),
        (["gzip", "zstd"], ("gzip", "zstd")),
        (["compress"], None),
        (["gzip, dcb"], None),
        (["gzip, gzip, gzip, gzip"], None),
    ],
)
def test_parse_codings(values: list[str], want: tuple[str, ...] | None) -> None:
    assert parse_codings(values) == want
