"""collector/receivers/receive.py: Content-Encoding undone within the bound, bodies parsed by Content-Type."""

from __future__ import annotations

import gzip
import zlib
from array import array

import msgpack
import orjson
import pytest
import zstandard

from tracecar.collector.receivers.receive import EXT_INT32_ARRAY, MAX_GZIP_MEMBERS, BodyError, decompress, parse

BODY = orjson.dumps({"worker": "w", "spans": [{"span_id": "a" * 16, "inputs": {"text": "x" * 5000}}]})


def deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize("encoding, encode", [
    (None, lambda b: b), ("identity", lambda b: b), (" GZIP ", gzip.compress), ("x-gzip", gzip.compress),
    ("deflate", deflate), ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
])
def test_each_encoding_round_trips(encoding, encode) -> None:
    assert bytes(decompress(encode(BODY), encoding, 10 * len(BODY))) == BODY


def test_identity_hands_back_the_buffer_it_was_given() -> None:
    body = bytearray(BODY)
    assert decompress(body, None, 1) is body  # the bound is on decompressed bytes; identity was bounded on the wire


@pytest.mark.parametrize("encoding, encode", [
    ("gzip", gzip.compress), ("deflate", deflate), ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
])
def test_a_body_past_the_bound_is_413_naming_the_setting(encoding, encode) -> None:
    bomb = encode(b"\0" * 1_000_000)
    with pytest.raises(BodyError) as e:
        decompress(bomb, encoding, 1000)
    assert e.value.status == 413 and "TRACECAR_MAX_DECOMPRESSED_BYTES=1000" in e.value.reason


def test_exactly_the_bound_is_accepted() -> None:
    assert len(decompress(gzip.compress(b"y" * 1000), "gzip", 1000)) == 1000


def test_gzip_members_are_concatenated_and_zero_padding_is_ignored() -> None:
    body = gzip.compress(b"first ") + gzip.compress(b"second") + b"\0" * 7
    assert decompress(body, "gzip", 100) == b"first second"


def test_garbage_after_the_last_member_is_400() -> None:
    with pytest.raises(BodyError) as e:
        decompress(gzip.compress(b"ok") + b"not gzip", "gzip", 100)
    assert e.value.status == 400 and e.value.field == "Content-Encoding"


def test_too_many_gzip_members_is_400() -> None:
    one = gzip.compress(b"")
    with pytest.raises(BodyError) as e:
        decompress(one * (MAX_GZIP_MEMBERS + 1), "gzip", 10)
    assert e.value.status == 400 and str(MAX_GZIP_MEMBERS) in e.value.reason


@pytest.mark.parametrize("encoding, body, words", [
    ("gzip", gzip.compress(BODY)[:40], "truncated"),
    ("gzip", b"plain text", "not valid gzip"),
    ("zstd", b"plain text", "not valid zstd"),
])
def test_broken_compressed_bodies_are_400_saying_why(encoding, body, words) -> None:
    with pytest.raises(BodyError) as e:
        decompress(body, encoding, 10_000)
    assert e.value.status == 400 and words in e.value.reason


def test_an_unknown_encoding_is_415_listing_the_known_ones() -> None:
    with pytest.raises(BodyError) as e:
        decompress(BODY, "br", 10_000)
    assert e.value.status == 415 and "gzip, deflate, zstd or identity" in e.value.reason


def test_json_and_msgpack_parse_alike() -> None:
    data = {"worker": "w", "spans": [{"n": 1, "s": "é"}]}
    assert parse(orjson.dumps(data), None) == data  # JSON is the default
    assert parse(orjson.dumps(data), "application/json; charset=utf-8") == data
    for media in ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack"):
        assert parse(msgpack.packb(data), media) == data


def test_packed_int32_ids_unpack_to_lists_and_a_ragged_array_stays_an_ext_value() -> None:
    ids = [0, 1, 128_000, 2**31 - 1]
    packed = msgpack.packb({"ids": msgpack.ExtType(EXT_INT32_ARRAY, array("i", ids).tobytes())})
    assert parse(packed, "application/msgpack") == {"ids": ids}
    # one span's bad value: kept as sent (as an unknown ext type is), never the whole body's 400
    ragged = parse(msgpack.packb({"ids": msgpack.ExtType(EXT_INT32_ARRAY, b"\1\2\3"), "ok": 1}), "application/msgpack")
    assert ragged == {"ids": msgpack.ExtType(EXT_INT32_ARRAY, b"\1\2\3"), "ok": 1}


def test_a_json_number_past_a_doubles_range_keeps_its_text_and_costs_nothing_else() -> None:
    body = b'{"worker": "w", "spans": [{"output": {"x": 1e400, "y": -2E999, "z": 1.5, "n": 7}}]}'
    assert parse(body, "application/json") == {"worker": "w", "spans": [{"output": {"x": "1e400", "y": "-2E999", "z": 1.5, "n": 7}}]}
    for bad in (b'{"x": NaN}', b'{"x": Infinity}', b'{"x": 1e400'):  # still not JSON: 400, as before
        with pytest.raises(BodyError) as e:
            parse(bad, "application/json")
        assert e.value.status == 400
    # the syntax error is the one reported, not orjson's refusal of the number
    with pytest.raises(BodyError) as e:
        parse(b'{"x": 1e400,', "application/json")
    assert "infinity" not in e.value.reason and "line 1" in e.value.reason


def test_beside_a_wide_number_every_other_number_reads_as_orjson_reads_it() -> None:
    # one span's 1e400 must not change how another span's numbers are read
    others = b'"u64": 18446744073709551615, "i64": -9223372036854775808, "past": 18446744073709551616, "f": 0.25, "e": 1e300'
    alone = orjson.loads(b"{" + others + b"}")
    beside = parse(b'{"wide": 1e400, "huge": 1' + b"0" * 400 + b", " + others + b"}", "application/json")
    assert beside.pop("wide") == "1e400" and beside.pop("huge") == "1" + "0" * 400
    assert beside == alone and [type(v) for v in beside.values()] == [type(v) for v in alone.values()]


@pytest.mark.parametrize("body, media, status, field", [
    (b"{not json", "application/json", 400, "body"),
    (b"\xc1", "application/msgpack", 400, "body"),
    (b"{}", "text/plain", 415, "Content-Type"),
])
def test_unparsable_or_unknown_bodies_name_the_problem(body, media, status, field) -> None:
    with pytest.raises(BodyError) as e:
        parse(body, media)
    assert (e.value.status, e.value.field) == (status, field)
