"""Guarantee 6: hostile batches get a clear 4xx naming the field, good spans survive, no 5xx.

One real collector (uvicorn on 127.0.0.1, token2text on with a real BPE tokenizer, small
bounds) takes a table of hostile requests. Span-level problems reject only that span (the
good spans of the same batch are stored); body-level problems refuse the request with the
field named; suspicious-but-real values are stored with a recorded warning. After every case
the collector still takes a good batch. A property-based fuzz test then throws random
mutations and random bodies at it and finds no 5xx.
"""

from __future__ import annotations

import gzip
import json
import math
import urllib.parse
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgpack
import orjson
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(180)

KiB, MiB = 1024, 2**20
LIMITS = dict(max_body_bytes=256 * KiB, max_decompressed_bytes=1 * MiB, max_span_bytes=64 * KiB, max_batch_spans=50)


@dataclass
class Case:
    """One hostile request: what to send and what the collector must answer."""

    name: str
    build: Callable[[Any], tuple[Any, dict[str, str], list[str]]]  # kit -> (spans or raw body, headers, good ids)
    status: int
    fields: list[str] = field(default_factory=list)  # rejected fields (span level) or the error field (body level)
    warnings: list[str] = field(default_factory=list)  # warning prefixes recorded on stored spans
    fmt: str = "json"


def good(kit: Any) -> list[dict[str, Any]]:
    """A valid child + root pair; both must be stored whatever sits next to them."""
    return kit.trajectory(children=1)


def with_bad(mutate: Callable[[Any, dict[str, Any]], Any]) -> Callable[[Any], tuple[list[Any], dict[str, str], list[str]]]:
    """Batch [good child, hostile span (a mutated op span), good root]."""

    def build(kit: Any) -> tuple[list[Any], dict[str, str], list[str]]:
        child, root = good(kit)
        bad = dict(child, span_id=kit.new_id(), attributes=dict(child["attributes"]), inputs={}, output=None)
        result = mutate(kit, bad)
        return [child, bad if result is None else result, root], {}, [child["span_id"], root["span_id"]]

    return build


def setting(key: str, value: Any) -> Callable[[Any, dict[str, Any]], None]:
    def mutate(kit: Any, span: dict[str, Any]) -> None:
        target, _, sub = key.partition(".")
        if sub:
            span[target][sub] = value
        elif value is _DELETE:
            del span[target]
        else:
            span[target] = value

    return mutate


_DELETE = object()


def annotation_with(**attributes: Any) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    """The hostile span becomes a trainer annotation of the trajectory carrying ``attributes``."""

    def mutate(kit: Any, span: dict[str, Any]) -> dict[str, Any]:
        return dict(span, kind="annotation", name="annotation", parent_id=None, attributes=attributes)

    return mutate


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"d": value}
    return value


def raw(body: bytes, content_type: str = "application/json", encoding: str | None = None) -> Callable[[Any], tuple[bytes, dict[str, str], list[str]]]:
    def build(kit: Any) -> tuple[bytes, dict[str, str], list[str]]:
        headers = {"Content-Type": content_type}
        if encoding:
            headers["Content-Encoding"] = encoding
        return body, headers, []

    return build


def envelope(**overrides: Any) -> Callable[[Any], tuple[bytes, dict[str, str], list[str]]]:
    def build(kit: Any) -> tuple[bytes, dict[str, str], list[str]]:
        batch = {"v": 1, "worker": "w", "spans": good(kit), **overrides}
        batch = {k: v for k, v in batch.items() if v is not _DELETE}
        return orjson.dumps(batch), {"Content-Type": "application/json"}, []

    return build


def good_body(kit: Any, compress: Callable[[bytes], bytes], encoding: str) -> tuple[bytes, dict[str, str], list[str]]:
    body, headers = kit.encode(good(kit))
    return compress(body), {**headers, "Content-Encoding": encoding}, []


def gzip_members(kit: Any, pieces: int = 3, tail: bytes = b"") -> tuple[bytes, dict[str, str], list[str]]:
    """A good batch as several gzip members one after another (RFC 1952), as `cat a.gz b.gz` makes."""
    spans = good(kit)
    body, headers = kit.encode(spans)
    cut = [len(body) * i // pieces for i in range(pieces + 1)]
    packed = b"".join(gzip.compress(body[a:b]) for a, b in zip(cut, cut[1:])) + tail
    return packed, {**headers, "Content-Encoding": "gzip"}, [s["span_id"] for s in spans]


ZEROS = b"[" + b" " * (60 * MiB) + b"]"  # 60 MiB of JSON whitespace: compresses to ~60 KiB


def cycle(kit: Any) -> tuple[list[Any], dict[str, str], list[str]]:
    child, root = good(kit)
    a, b = kit.new_id(), kit.new_id()
    base = dict(child, attributes=dict(child["attributes"]))
    return [child, dict(base, span_id=a, parent_id=b), dict(base, span_id=b, parent_id=a), root], {}, [child["span_id"], root["span_id"]]


def orphan(kit: Any) -> tuple[list[Any], dict[str, str], list[str]]:
    """Stored as is (the parent may come later); the store view flags it parent_missing."""
    child, root = good(kit)
    lost = dict(child, span_id=kit.new_id(), parent_id=kit.new_id())
    return [child, lost, root], {}, [child["span_id"], lost["span_id"], root["span_id"]]


def duplicate_in_batch(kit: Any) -> tuple[list[Any], dict[str, str], list[str]]:
    child, root = good(kit)
    return [child, root, dict(child, name="again")], {}, [child["span_id"], root["span_id"]]


def stored_too(build: Callable[[Any], tuple[list[Any], dict[str, str], list[str]]]) -> Callable[[Any], tuple[list[Any], dict[str, str], list[str]]]:
    """The hostile span is stored as well (with a warning where one is due)."""

    def wrapped(kit: Any) -> tuple[list[Any], dict[str, str], list[str]]:
        spans, headers, good_ids = build(kit)
        return spans, headers, good_ids + [spans[1]["span_id"]]

    return wrapped


def with_literal(build: Callable[[Any], tuple[list[Any], dict[str, str], list[str]]],
                 literal: bytes) -> Callable[[Any], tuple[bytes, dict[str, str], list[str]]]:
    """``build``'s batch as JSON, its one ``"WIDE-NUMBER"`` string written as ``literal`` (a number
    that valid JSON may hold and no double does: Python cannot make one to encode)."""

    def raw_body(kit: Any) -> tuple[bytes, dict[str, str], list[str]]:
        spans, headers, good_ids = build(kit)
        body, enc_headers = kit.encode(spans, "json")
        assert body.count(b'"WIDE-NUMBER"') == 1
        return body.replace(b'"WIDE-NUMBER"', literal), {**enc_headers, **headers}, good_ids

    return raw_body


WIDE_INT = b"1" + b"0" * 400


CASES = [
    # ---- span level: that span is rejected by field, its neighbours stored ----------------
    Case("step is a string", with_bad(setting("attributes.step", "3")), 200, ["spans[1].attributes.step"]),
    Case("step is a bool", with_bad(setting("attributes.step", True)), 200, ["spans[1].attributes.step"]),
    Case("step beyond 64 bits", with_bad(setting("attributes.step", 2**64 - 1)), 200, ["spans[1].attributes.step"], fmt="msgpack"),
    Case("sample_index beyond int64", with_bad(setting("attributes.sample_index", 2**63)), 200, ["spans[1].attributes.sample_index"], fmt="msgpack"),
    Case("integer reward beyond int64", with_bad(setting("attributes.reward", 2**64 - 1)), 200, ["spans[1].attributes.reward"], fmt="msgpack"),
    # the store's trajectory index binds it as an SQLite INTEGER: accepted, it made every list a 500
    Case("advantage beyond int64", with_bad(annotation_with(advantage=2**63)), 200, ["spans[1].attributes.advantage"]),
    Case("advantage not a number", with_bad(annotation_with(advantage={"api_key": "sk-ECHO"})), 200,
         ["spans[1].attributes.advantage"]),
    Case("validate not a bool", with_bad(setting("attributes.validate", "yes")), 200, ["spans[1].attributes.validate"]),
    Case("experiment_name not a string", with_bad(setting("attributes.experiment_name", 7)), 200, ["spans[1].attributes.experiment_name"]),
    Case("attributes not an object", with_bad(setting("attributes", [1, 2])), 200, ["spans[1].attributes"]),
    Case("inputs not an object", with_bad(setting("inputs", "text")), 200, ["spans[1].inputs"]),
    Case("missing span_id", with_bad(setting("span_id", _DELETE)), 200, ["spans[1].span_id"]),
    Case("span_id with spaces", with_bad(setting("span_id", "a b")), 200, ["spans[1].span_id"]),
    Case("span_id of 200 chars", with_bad(setting("span_id", "a" * 200)), 200, ["spans[1].span_id"]),
    Case("span_id a number", with_bad(setting("span_id", 12)), 200, ["spans[1].span_id"]),
    Case("missing trace_id", with_bad(setting("trace_id", _DELETE)), 200, ["spans[1].trace_id"]),
    Case("missing name", with_bad(setting("name", _DELETE)), 200, ["spans[1].name"]),
    Case("empty name", with_bad(setting("name", "")), 200, ["spans[1].name"]),
    Case("unknown kind", with_bad(setting("kind", "weird")), 200, ["spans[1].kind"]),
    Case("start_time a string", with_bad(setting("start_time", "yesterday")), 200, ["spans[1].start_time"]),
    Case("start_time negative", with_bad(setting("start_time", -5.0)), 200, ["spans[1].start_time"]),
    Case("start_time NaN", with_bad(setting("start_time", math.nan)), 200, ["spans[1].start_time"], fmt="msgpack"),
    Case("end_time infinite", with_bad(setting("end_time", math.inf)), 200, ["spans[1].end_time"], fmt="msgpack"),
    Case("ends before it starts", with_bad(setting("end_time", 1.0)), 200, ["spans[1].end_time"]),
    Case("own parent", with_bad(lambda kit, s: dict(s, parent_id=s["span_id"])), 200, ["spans[1].parent_id"]),
    Case("root with a foreign trace_id", with_bad(lambda kit, s: dict(s, parent_id=None)), 200, ["spans[1].trace_id"]),
    Case("child in another trace than its parent", with_bad(lambda kit, s: dict(s, trace_id=kit.new_id())), 200, ["spans[1].trace_id"]),
    Case("span not an object", with_bad(lambda kit, s: 42), 200, ["spans[1]"]),
    Case("duplicate span id in the batch", duplicate_in_batch, 200, ["spans[2].span_id"]),
    Case("parent cycle", cycle, 200, ["spans[1].parent_id", "spans[2].parent_id"]),
    Case("span over TRACECAR_MAX_SPAN_BYTES", with_bad(setting("inputs", {"blob": "x" * (80 * KiB)})), 200, ["spans[1]"]),
    Case("inputs nested 600 deep", with_bad(setting("inputs", nested(600))), 200, ["spans[1].inputs"], fmt="msgpack"),
    Case("output nested 300 deep", with_bad(setting("output", nested(300))), 200, ["spans[1].output"], fmt="msgpack"),
    Case("output nested 300 deep (JSON)", with_bad(setting("output", nested(300))), 200, ["spans[1].output"], fmt="json-stdlib"),
    Case("attributes nested 300 deep", with_bad(lambda kit, s: s["attributes"].update(extra=nested(300))), 200,
         ["spans[1].attributes"], fmt="msgpack"),
    Case("one inputs value nested 300 deep", with_bad(setting("inputs", {"ok": 1, "deep": nested(300)})), 200,
         ["spans[1].inputs"], fmt="msgpack"),
    # ---- stored with a recorded warning: the value is real signal ------------------------
    Case("NaN reward", stored_too(with_bad(setting("attributes.reward", math.nan))), 200, warnings=["attributes.reward"], fmt="msgpack"),
    Case("infinite output value", stored_too(with_bad(setting("output", {"score": -math.inf}))), 200, warnings=["output.score"], fmt="msgpack"),
    Case("token ids outside the vocabulary", stored_too(with_bad(setting("output", {"response_ids": [5, 7, 10**6, -3, 9, 11, 12, 13]}))), 200,
         warnings=["output.response_text"]),
    Case("token ids that are all floats", stored_too(with_bad(setting("output", {"response_ids": [1.5, 2.5]}))), 200,
         warnings=["output.response_text: output.response_ids: 2 not integers"]),
    Case("token ids: a float in the middle", stored_too(with_bad(setting("output", {"response_ids": [1, 2.5, 3]}))), 200,
         warnings=["output.response_text: output.response_ids: 1 not integers"]),
    Case("token ids that are strings", stored_too(with_bad(setting("output", {"token_ids": ["a", 5, "b"]}))), 200,
         warnings=["output.response_text: output.token_ids: 2 not integers"]),
    Case("token ids nested lists", stored_too(with_bad(setting("output", {"response_ids": [[1, 2], [3]]}))), 200,
         warnings=["output.response_text: output.response_ids: 2 not integers"]),
    Case("prompt ids with a None", stored_too(with_bad(setting("output", {"prompt_ids": [None, 4, 5]}))), 200,
         warnings=["output.prompt_text: output.prompt_ids: 1 not integers"]),
    Case("inputs prompt ids negative", stored_too(with_bad(lambda kit, s: dict(s, inputs={"prompt_ids": [-1, -2]}, output={}))), 200,
         warnings=["output.prompt_text: inputs.prompt_ids: 2 token id(s) outside the vocabulary"]),
    Case("token ids not a list", stored_too(with_bad(setting("output", {"response_ids": "1 2 3"}))), 200,
         warnings=["output.response_text: not decoded from output.response_ids: a str"]),
    Case("non-UTF-8 msgpack text", stored_too(with_bad(setting("name", "placeholder"))), 200, fmt="msgpack-bad-utf8"),
    Case("unknown msgpack ext type and bytes",
         stored_too(with_bad(setting("inputs", {"ext": msgpack.ExtType(5, b"\x00\x01"), "raw": b"\xff\xfe"}))), 200, fmt="msgpack"),
    Case("a child whose parent never arrives", orphan, 200),
    # one span's malformed value costs only that value, not the body (both were a 400 for the batch)
    Case("msgpack packed ids of odd length",
         stored_too(with_bad(setting("inputs", {"prompt_ids": msgpack.ExtType(1, b"\x01\x02\x03")}))), 200, fmt="msgpack"),
    Case("a JSON number past a double's range",
         with_literal(stored_too(with_bad(setting("output", {"score": "WIDE-NUMBER", "ok": 1}))), b"1e400"), 200),
    Case("a 401-digit JSON integer in per-token log-probabilities",
         with_literal(stored_too(with_bad(setting("output", {"response_ids": [1, 2], "response_logprobs": ["WIDE-NUMBER", -0.5]}))),
                      WIDE_INT), 200, warnings=["output.response_logprobs: not a list of numbers"]),
    Case("a 401-digit JSON integer as an annotation's advantage",
         with_literal(with_bad(annotation_with(advantage="WIDE-NUMBER")), WIDE_INT), 200, ["spans[1].attributes.advantage"]),
    Case("a 401-digit JSON integer as a reward (kept as its text)",
         with_literal(stored_too(with_bad(setting("attributes.reward", "WIDE-NUMBER"))), WIDE_INT), 200),
    # ---- body level: the request is refused, the field named ------------------------------
    Case("invalid JSON", raw(b'{"worker": "w", "spans": [}'), 400, ["body"]),
    Case("invalid msgpack", raw(b"\xc1\xc1\xc1", "application/msgpack"), 400, ["body"]),
    Case("non-UTF-8 JSON", raw(b'{"worker": "w\xff\xfe", "spans": []}'), 400, ["body"]),
    Case("lone surrogate in JSON", raw(b'{"worker": "\\ud800", "spans": []}'), 400, ["body"]),
    Case("JSON nested 5000 deep", raw(b"[" * 5000 + b"]" * 5000), 400, ["body"]),
    Case("msgpack nested 5000 deep", raw(b"\x91" * 5000 + b"\xc0", "application/msgpack"), 400, ["body"]),
    Case("msgpack map with a list key", raw(b"\x81\x91\x01\x01", "application/msgpack"), 400, ["body"]),
    Case("a JSON array, not an object", raw(b"[1, 2, 3]"), 400, ["body"]),
    Case("envelope without worker", envelope(worker=_DELETE), 400, ["worker"]),
    Case("worker not a string", envelope(worker=5), 400, ["worker"]),
    Case("spans not a list", envelope(spans={"a": 1}), 400, ["spans"]),
    # a size bound: the client splits on 413
    Case("more spans than TRACECAR_MAX_BATCH_SPANS", lambda kit: (kit.trajectory(children=60), {}, []), 413, ["spans"]),
    Case("unknown content type", raw(b"hello", "text/plain"), 415, ["Content-Type"]),
    Case("unknown content encoding", lambda kit: good_body(kit, lambda b: b, "br"), 415, ["Content-Encoding"]),
    Case("garbage gzip", raw(b"\x1f\x8bnot gzip at all", encoding="gzip"), 400, ["Content-Encoding"]),
    Case("truncated gzip", lambda kit: good_body(kit, lambda b: gzip.compress(b)[:-12], "gzip"), 400, ["Content-Encoding"]),
    Case("gzip body of 3 members", gzip_members, 200),
    Case("gzip members, then zero padding", lambda kit: gzip_members(kit, 2, b"\x00" * 64), 200),
    Case("gzip members, then garbage", lambda kit: gzip_members(kit, 2, b"garbage")[:2] + ([],), 400, ["Content-Encoding"]),
    Case("gzip body of 5000 empty members", raw(gzip.compress(b"") * 5000, encoding="gzip"), 400, ["Content-Encoding"]),
    Case("gzip bomb split over members", raw(gzip.compress(ZEROS[:30 * MiB], 9) + gzip.compress(ZEROS[30 * MiB:], 9), encoding="gzip"), 413, ["body"]),
    Case("gzip bomb", raw(gzip.compress(ZEROS, 9), encoding="gzip"), 413, ["body"]),
    Case("deflate bomb", raw(zlib.compress(ZEROS, 9), encoding="deflate"), 413, ["body"]),
    Case("zstd bomb", raw(zstandard.ZstdCompressor(level=19).compress(ZEROS), encoding="zstd"), 413, ["body"]),
    Case("body over TRACECAR_MAX_BODY_BYTES", raw(b" " * (300 * KiB)), 413, ["body"]),
]


def _send(kit: Any, url: str, case: Case, client: httpx.Client) -> tuple[httpx.Response, list[str]]:
    built, headers, good_ids = case.build(kit)
    if isinstance(built, bytes):
        body = built
    else:
        fmt = "msgpack" if case.fmt.startswith("msgpack") else case.fmt
        if fmt == "json-stdlib":  # orjson cannot write past 255 levels; the standard library can
            body, enc_headers = json.dumps({"v": 1, "worker": "w-fault", "spans": built}).encode(), {"Content-Type": "application/json"}
        else:
            body, enc_headers = kit.encode(built, fmt)
        if case.fmt == "msgpack-bad-utf8":  # the hostile span's name becomes invalid UTF-8 on the wire
            body = body.replace(msgpack.packb("placeholder"), msgpack.packb("placeholder")[:1] + b"pl\xff\xfeceholde")
        headers = {**enc_headers, **headers}
    return client.post(url + "/v1/spans", content=body, headers=headers, timeout=30), good_ids


@pytest.fixture
def hostile_collector(start_collector, small_bpe_path):
    return start_collector(token2text=True, tokenizer=small_bpe_path, **LIMITS)


def test_hostile_batches_get_a_4xx_naming_the_field_and_good_spans_survive(hostile_collector, kit):
    col = hostile_collector
    spool = col.collector.spool
    outcomes: list[str] = []
    with httpx.Client() as client:
        for case in CASES:
            r, good_ids = _send(kit, col.url, case, client)
            outcomes.append(f"{case.name}: {r.status_code}")
            assert r.status_code == case.status, (case.name, r.status_code, r.text[:500])
            payload = r.json()
            if case.status >= 400:  # body level: refused whole, the field named
                assert payload["error"]["field"] == case.fields[0], (case.name, payload)
                assert payload["error"]["reason"], case.name
            else:
                got = sorted(x["field"] for x in payload["rejected"])
                assert got == sorted(case.fields), (case.name, payload["rejected"])
                assert all(x["reason"] for x in payload["rejected"]), case.name
                assert "sk-ECHO" not in r.text, case.name  # a refused value is described, never echoed
                assert payload["accepted"] == len(good_ids), (case.name, payload)
                stored = {row["span_id"] for row in spool.query(
                    f"SELECT span_id FROM spans WHERE span_id IN ({','.join('?' * len(good_ids))})", good_ids)}
                assert stored == set(good_ids), case.name
                for prefix in case.warnings:
                    recorded = [w for ws in payload["warnings"].values() for w in ws]
                    assert any(w.startswith(prefix) for w in recorded), (case.name, recorded)
            # the collector keeps serving: a good batch right after each hostile one
            ok = kit.post(col.url, good(kit), client=client)
            assert ok.status_code == 200 and ok.json()["accepted"] == 2, case.name

    # whatever was accepted, every list of the trajectory index still answers
    for path in ("/v1/trajectories", "/ui/api/trajectories", "/v1/groups?step=1", "/ui/api/facets", "/v1/health?step=1"):
        listed = httpx.get(col.url + path, timeout=30)
        assert listed.status_code == 200, (path, listed.text[:300])
    metrics = httpx.get(col.url + "/metrics").text
    five_xx = sum(kit.metric(metrics, "tracecar_requests_total", status=str(s)) for s in range(500, 600))
    print(f"\nbad input: {len(CASES)} hostile cases, {len(CASES)} good follow-ups, 5xx={five_xx}; " + "; ".join(outcomes))
    assert five_xx == 0
    assert kit.metric(metrics, "tracecar_requests_total", status="200") >= 2 * len(CASES) - 30


def test_stored_warnings_and_orphans_are_visible_in_the_store(hostile_collector, kit):
    col = hostile_collector
    child, root = good(kit)
    lost_parent = kit.new_id()
    orphan_span = dict(child, span_id=kit.new_id(), parent_id=lost_parent)
    child["attributes"] = dict(child["attributes"], reward=math.nan)
    r = kit.post(col.url, [child, orphan_span, root], fmt="msgpack")
    assert r.status_code == 200 and r.json()["accepted"] == 3
    tree = httpx.get(f"{col.url}/v1/trajectories/{root['span_id']}").json()
    assert tree["span_count"] == 3
    by_id = {s["span_id"]: s for s in tree["root"]["children"]}
    assert by_id[orphan_span["span_id"]]["parent_missing"] is True  # attached to the root, flagged
    assert by_id[child["span_id"]]["attributes"]["reward"] == "nan"
    assert any(w.startswith("attributes.reward") for w in by_id[child["span_id"]]["warnings"])

    # a child naming a stored parent of another trace is refused by name; its batch-mates stored
    child, root = good(kit)
    assert kit.post(col.url, [child, root]).json()["accepted"] == 2
    other = kit.trajectory(children=1)
    stray = dict(other[0], span_id=kit.new_id(), parent_id=child["span_id"])  # parent stored, in root's trace
    r = kit.post(col.url, [stray, *other])
    assert r.status_code == 200 and r.json()["accepted"] == 2, r.text
    (rejection,) = r.json()["rejected"]
    assert rejection["field"] == "spans[0].trace_id" and child["span_id"] in rejection["reason"], rejection
    assert kit.metrics(col.url, "tracecar_spans_rejected_total", reason="trace_id") >= 1

    # token2text: a list with nothing decodable gets no text and says why; a partly bad one the rest
    child, root = good(kit)
    floats = dict(child, span_id=kit.new_id(), output={"response_ids": [1.5, 2.5]})
    mixed = dict(child, span_id=kit.new_id(), output={"response_ids": [5, 2.5, 7]})
    r = kit.post(col.url, [child, floats, mixed, root])
    assert r.status_code == 200 and r.json()["accepted"] == 4
    warned = r.json()["warnings"]
    assert any("none decodable, not decoded" in w for w in warned[floats["span_id"]]), warned
    assert any("left out of the text" in w for w in warned[mixed["span_id"]]), warned
    assert child["span_id"] not in warned
    by_id = {s["span_id"]: s for s in httpx.get(f"{col.url}/v1/trajectories/{root['span_id']}").json()["root"]["children"]}
    assert "response_text" not in by_id[floats["span_id"]]["output"]
    assert isinstance(by_id[mixed["span_id"]]["output"]["response_text"], str)
    assert isinstance(by_id[child["span_id"]]["output"]["response_text"], str)

    # invalid UTF-8 in msgpack text is stored with U+FFFD in place of the bad bytes
    child, root = good(kit)
    body, headers = kit.encode([dict(child, name="Agent.XXXX"), root], "msgpack")
    r = httpx.post(col.url + "/v1/spans", content=body.replace(b"Agent.XXXX", b"Agent.\xff\xfeXX"), headers=headers)
    assert r.status_code == 200 and r.json()["accepted"] == 2
    tree = httpx.get(f"{col.url}/v1/trajectories/{root['span_id']}").json()
    assert tree["root"]["children"][0]["name"] == "Agent.\ufffd\ufffdXX"

    # a lone surrogate escape reaches the standard parser (a number past a double sends the body
    # there; orjson refuses it): in the informational run id or client map it is ignored with a
    # warning, as any unusable run id is, and costs no span
    for name, value in (("wandb_run_id", b'"run\\ud800"'), ("client", b'{"version": "1\\ud800"}')):
        child, root = good(kit)
        batch = orjson.dumps({"v": 1, "worker": "w", "spans": [child, root], name: "SURROGATE"})
        body = batch.replace(b'"SURROGATE"', value).replace(b'{"v":1,', b'{"wide":1e400,"v":1,')
        r = httpx.post(col.url + "/v1/spans", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()["accepted"] == 2, (name, r.text)
        assert any(w.startswith(f"{name}: ignored") for w in r.json()["warnings"][child["span_id"]]), r.text


# ---- property-based fuzz ------------------------------------------------------------------
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**64), max_value=2**64), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40), st.binary(max_size=20),
)
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                       max_leaves=12)
_SPAN_KEYS = ["span_id", "trace_id", "parent_id", "name", "kind", "start_time", "end_time", "attributes", "inputs",
              "output", "exception"]
_ATTR_KEYS = ["step", "sample_index", "rollout_n", "validate", "experiment_name", "reward"]
_ENV_KEYS = ["v", "worker", "project", "entity", "tokenizer", "token2text", "spans"]


def _msgpack_safe(value: Any) -> Any:
    """msgpack cannot carry ints beyond 64 bits: clamp them (JSON keeps them as they are)."""
    if isinstance(value, bool) or not isinstance(value, (int, list, dict)):
        return value
    if isinstance(value, int):
        return max(-(2**63), min(value, 2**64 - 1))
    if isinstance(value, list):
        return [_msgpack_safe(v) for v in value]
    return {k: _msgpack_safe(v) for k, v in value.items()}


def _json_safe(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("latin-1")
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return max(-(2**63), min(value, 2**64 - 1))
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


_OUTPUT_KEYS = ["prompt_ids", "response_ids", "token_ids", "response_text", "metrics"]
_id_lists = st.lists(st.one_of(st.integers(-5, 2**40), st.floats(allow_nan=False), st.booleans(), st.none(), st.text(max_size=3)), max_size=6)
mutations = st.lists(
    st.tuples(st.sampled_from(["span", "attr", "envelope", "drop", "output", "link"]), st.integers(0, 3),
              st.sampled_from(_SPAN_KEYS + _ATTR_KEYS + _ENV_KEYS + _OUTPUT_KEYS),
              st.one_of(_values, _id_lists, st.sampled_from([120, 250, 252, 253, 300]).map(nested))),
    min_size=1, max_size=5,
)


def test_fuzzed_batches_never_get_a_5xx(hostile_collector, kit):
    col = hostile_collector
    client = httpx.Client()
    seen: dict[int, int] = {}
    reads: dict[int, int] = {}

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    @given(muts=mutations, fmt=st.sampled_from(["json", "msgpack"]), members=st.sampled_from([0, 0, 1, 3]))
    def mutated(muts: list[tuple[str, int, str, Any]], fmt: str, members: int) -> None:
        spans = kit.trajectory(children=3)
        batch: dict[str, Any] = {"v": 1, "worker": "w-fuzz", "spans": spans}
        for where, index, key, value in muts:
            span = spans[index % len(spans)]
            if where == "span" and key in _SPAN_KEYS:
                span[key] = value
            elif where == "attr" and isinstance(span.get("attributes"), dict):
                span["attributes"] = dict(span["attributes"], **{key: value})
            elif where == "envelope" and key in _ENV_KEYS:
                batch[key] = value
            elif where == "drop":
                span.pop(key, None)
            elif where == "output" and key in _OUTPUT_KEYS:  # token ids of any shape, with token2text on
                span["output"] = dict(span["output"] if isinstance(span.get("output"), dict) else {}, **{key: value})
            elif where == "link":  # parents and traces crossed between the spans of the batch
                other = spans[(index + 1) % len(spans)]
                span["parent_id" if key in _SPAN_KEYS[:3] else "trace_id"] = other.get("span_id")
        if fmt == "json":
            try:
                body, ctype = orjson.dumps(_json_safe(batch), option=orjson.OPT_NON_STR_KEYS), "application/json"
            except TypeError:  # nested past orjson's 255 levels: the standard library writes it
                body, ctype = json.dumps(_json_safe(batch), default=str).encode(), "application/json"
        else:
            body, ctype = msgpack.packb(_msgpack_safe(batch), use_bin_type=True), "application/msgpack"
        headers = {"Content-Type": ctype}
        if members:  # and as gzip, of one or several members
            cut = [len(body) * i // members for i in range(members + 1)]
            body = b"".join(gzip.compress(body[a:b]) for a, b in zip(cut, cut[1:]))
            headers["Content-Encoding"] = "gzip"
        r = client.post(col.url + "/v1/spans", content=body, headers=headers, timeout=30)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, r.text[:500]
        if r.status_code == 200 and r.json()["accepted"]:  # whatever was accepted reads back
            for span in spans:
                trace = span.get("trace_id") if isinstance(span, dict) else None
                if isinstance(trace, str) and trace.isascii() and trace.isprintable():
                    for path in ("/v1/trajectories/", "/ui/api/trajectories/"):
                        got = client.get(col.url + path + urllib.parse.quote(trace, safe=""), timeout=30)
                        assert got.status_code in (200, 404), (path, got.status_code, got.text[:300])
                        reads[got.status_code] = reads.get(got.status_code, 0) + 1

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    @given(body=st.binary(max_size=300), ctype=st.sampled_from(["application/json", "application/msgpack", "text/plain", ""]),
           encoding=st.sampled_from([None, "gzip", "deflate", "zstd", "identity", "br"]))
    def random_bodies(body: bytes, ctype: str, encoding: str | None) -> None:
        headers = {"Content-Type": ctype} if ctype else {}
        if encoding:
            headers["Content-Encoding"] = encoding
        r = client.post(col.url + "/v1/spans", content=body, headers=headers, timeout=30)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, r.text[:500]

    try:
        mutated()
        random_bodies()
        assert httpx.get(col.url + "/healthz").status_code == 200
        ok = kit.post(col.url, good(kit), client=client)
        assert ok.status_code == 200 and ok.json()["accepted"] == 2
    finally:
        client.close()
    print(f"\nfuzz: statuses {dict(sorted(seen.items()))}, read-backs {dict(sorted(reads.items()))}")
    assert sum(seen.values()) >= 300 and not any(s >= 500 for s in seen)
    assert reads.get(200, 0) >= 200  # accepted spans were read back, deep ones included


# ---- GET query parameters ------------------------------------------------------------------
_QUERY_KEYS = ["experiment", "step", "step_min", "step_max", "sample_index", "rollout_n", "validate", "worker",
               "has_error", "reward_min", "reward_max", "sort", "order", "limit", "offset", "kept_because", "split",
               "tree", "token", "path", "format", "diff", "token_ids", "name"]
_edge_ints = st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, -(2**64), 10**40])
_query_values = st.one_of(
    _edge_ints.map(str), st.integers().map(str), st.floats().map(repr), st.sampled_from(["", "true", "false", "nan", "inf",
    "-inf", "1e309", "0x10", "1_000", " 7 ", "9" * 5000, "start", "reward", "asc", "desc", "all", "validation"]),
    st.text(max_size=30),
)
_GET_PATHS = ["/v1/trajectories", "/v1/trajectories/{id}", "/v1/decisions", "/v1/dead-letters", "/ui/api/status",
              "/ui/api/facets", "/ui/api/overview", "/ui/api/trajectories", "/ui/api/trajectories/{id}", "/ui/",
              "/ui/static/{id}", "/healthz", "/readyz", "/metrics", "/openapi.json", "/v1/groups", "/ui/api/groups",
              "/v1/export", "/v1/tokenizers/check"]


def test_fuzzed_queries_never_get_a_5xx(hostile_collector, kit):
    """Every GET endpoint, any query (ints past int64 either way, floats, text, repeated keys): no 5xx."""
    col = hostile_collector
    known = []
    for step in (0, 1, 2**40):
        spans = kit.trajectory(children=2, step=step, sample_index=step % 5)
        spans[-1]["attributes"] = dict(spans[-1]["attributes"], reward=0.5 * step)
        assert kit.post(col.url, spans).status_code == 200
        known.append(spans[-1]["span_id"])
    client = httpx.Client(base_url=col.url, timeout=30)
    seen: dict[int, int] = {}

    @settings(max_examples=480, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    @given(path=st.sampled_from(_GET_PATHS),
           query=st.lists(st.tuples(st.one_of(st.sampled_from(_QUERY_KEYS), st.text(max_size=8)), _query_values), max_size=6),
           trace=st.one_of(st.sampled_from(known), st.text(min_size=1, max_size=40)))
    def queries(path: str, query: list[tuple[str, str]], trace: str) -> None:
        url = path.replace("{id}", urllib.parse.quote(trace, safe=""))
        try:
            r = client.get(url, params=query)
        except httpx.InvalidURL:
            return  # not a request a client can send
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (url, query, r.text[:500])
        if r.status_code == 422:
            assert r.json()["error"]["field"], r.text[:300]

    try:
        queries()
        assert client.get("/healthz").status_code == 200
    finally:
        client.close()
    print(f"\nquery fuzz: statuses {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= 300 and seen.get(200, 0) > 50 and seen.get(422, 0) > 20
