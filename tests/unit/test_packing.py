"""client/wire.py's packing: numeric lists spliced in, the redaction search over the rest,
default-valued fields left out. What the collector parses and stores from it must be what it
stores from the previous packing (``pack_span_legacy``), and what the caller passed, minus
redaction; a secret never reaches the wire bytes; a span that cannot be packed is dropped and
counted, never raised into the caller.
"""

from __future__ import annotations

import collections
import copy
import logging
import math
import random
from typing import Any

import numpy as np
import orjson
import pytest

from tests.unit.test_sender import Collector
from tracecar.client import wire
from tracecar.client.config import ClientConfig
from tracecar.client.redact import REDACTED, RedactKeys
from tracecar.client.sender import Sender
from tracecar.client.spans import SpanRecord
from tracecar.client.wire import WireEncoder, batch_body, batch_body_pieces, pack_span, pack_span_legacy, pack_span_pieces
from tracecar.collector.processors.validate import validate_batch
from tracecar.collector.receivers.pipeline import pack_payload
from tracecar.collector.receivers.receive import parse

pytestmark = pytest.mark.timeout(120)

LIMIT = 1_000_000
ENCODER = WireEncoder(LIMIT, 32, RedactKeys(("token", "secret_field")))
HEADER = {"v": 2, "worker": "w-pack", "project": None, "entity": None, "tokenizer": None}


def stored(packed: bytes) -> bytes:
    """The bytes the collector's store keeps for the span in ``packed`` (parse, validate, redact, pack_payload)."""
    body = batch_body(HEADER, [packed])
    validated = validate_batch(parse(body, "application/json"), 100, ENCODER.redact, body=body)
    assert not validated.rejected, validated.rejected
    [span] = validated.spans
    return pack_payload(span)[0]


def canonical(value: Any) -> bytes:
    """Type-strict form: ``True == 1`` and ``1 == 1.0`` in Python, not here."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)


# ---- random spans --------------------------------------------------------------------------------


class Gen:
    """Seeded random span parts; ``walks`` notes what sends a span through the bounded walk."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.walks = False
        self.opaque = False  # holds a value the caller's form is not the wire's (numpy repr)

    def number_list(self) -> list[Any]:
        r, n = self.rng, self.rng.choice((0, 1, 5, 15, 16, 17, 64, 300))
        kind = r.choice(("int", "float", "mixed", "bool", "boolmid", "edge", "nonfinite", "bigint", "none"))
        if kind == "int":
            return [r.randrange(-5, 150_000) for _ in range(n)]
        if kind == "float":
            return [r.uniform(-10, 10) for _ in range(n)]
        if kind == "mixed":
            return [r.choice((r.randrange(100), r.random(), -0.0, 1e300)) for _ in range(n)]
        if kind == "bool":
            return [r.random() < 0.5 for _ in range(n)]
        if kind == "boolmid":  # ints at the ends, bools between: must stay bools
            return [1] + [r.random() < 0.5 for _ in range(n)] + [0]
        if kind == "edge":
            return [r.choice((2**63 - 1, -(2**63), 2**64 - 1, 0, -1)) for _ in range(n)] + [7]
        if kind == "nonfinite":  # inside a list orjson writes null, as the previous packing did
            return [1.5] + [r.choice((math.nan, math.inf, -math.inf, 2.0)) for _ in range(n)] + [3]
        if kind == "bigint":
            self.walks = True
            return [1, 2**64 + r.randrange(10), -(2**70)] + list(range(20))
        return [1] + [None] * n + [2]

    def value(self, depth: int) -> Any:
        r = self.rng
        choice = r.randrange(14 if depth < 3 else 6)
        if choice <= 2:
            return self.number_list()
        if choice == 3:
            return r.choice(("text", "123", "1e5", "-0", "[1,2]", "null", "true", "é🙂", "", '"quoted"', "\x00"))
        if choice == 4:
            return r.choice((0, -1, 2**40, 3.25, True, False, None))
        if choice == 5:
            return []
        if choice == 6:
            return tuple(r.randrange(1000) for _ in range(r.choice((3, 20))))
        if choice == 7:
            return [self.number_list() for _ in range(r.randrange(1, 4))]  # nested lists
        if choice == 8:
            return [{"ids": self.number_list(), "k": self.value(depth + 1)} for _ in range(r.randrange(1, 3))]
        if choice == 9:
            return [r.randrange(10), "a", 2.5] + list(range(20)) + [{"x": [1, 2]}, 9]  # ends numeric, not all numbers
        if choice == 10:
            self.opaque = True
            return np.arange(r.choice((3, 40)), dtype=r.choice(("int64", "float32")))
        return {f"k{i}": self.value(depth + 1) for i in range(r.randrange(0, 4))}

    def span(self, index: int) -> dict[str, Any]:
        r = self.rng
        self.walks = self.opaque = False
        inputs = {f"arg{i}": self.value(0) for i in range(r.randrange(0, 5))}
        if r.random() < 0.5:
            inputs["prompt_ids"] = r.choice((self.number_list(), np.arange(50, dtype="int32")))
            if isinstance(inputs["prompt_ids"], np.ndarray):
                inputs["prompt_ids"] = np.arange(50, dtype="int32")  # ID_KEYS: sent as a list
        if r.random() < 0.2:
            inputs["prompt_ids"] = {"$ref": "ff" * 8, "n": 40, "add": self.number_list()}  # a delta's shape
        output: Any = r.choice((None, "done", 3, {"token_ids": self.number_list(), "log_probs": self.number_list(),
                                                 "nested": {"mask": self.number_list(), "deeper": {"x": self.number_list()}}},
                                [self.value(1)]))
        attributes: dict[str, Any] = {"step": r.randrange(5), "sample_index": index}
        if r.random() < 0.3:
            attributes["reward"] = r.choice((0.5, 1, math.nan, math.inf))
            if isinstance(attributes["reward"], float) and not math.isfinite(attributes["reward"]):
                self.walks = True  # a top-level non-finite number: the walk writes it as a string
        if type(output) is dict and r.random() < 0.2:
            output["score"] = math.nan
            self.walks = True
        if r.random() < 0.15:
            inputs["params"] = {"token": "sk-live-XYZ", "ids": list(range(30))}  # a redact key: the walk
            self.walks = True
        parent = None if r.random() < 0.2 else "aa" * 8
        sid = f"{index:016x}"
        return {"span_id": sid, "trace_id": sid if parent is None else "bb" * 8, "parent_id": parent,
                "name": r.choice(("generate", "tool", "agent_loop")), "kind": r.choice(("op", "op", "trajectory")) if parent else "trajectory",
                "start_time": 1.0 + index, "end_time": r.choice((None, 2.0 + index)), "attributes": attributes,
                "inputs": inputs, "output": output, "exception": r.choice((None, None, "ValueError: bad"))}


def as_caller_sees_it(value: Any) -> Any:
    """The caller's value in the form the wire promises: tuples as lists, numpy ids as lists, a
    non-finite float inside a container as null (orjson's, and the previous packing's, rule)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if type(value) is dict:
        return {k: as_caller_sees_it(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return [None if type(v) is float and not math.isfinite(v) else as_caller_sees_it(v) for v in value]
    return value


def prepared(span: dict[str, Any]) -> dict[str, Any]:
    """What pack_span hands its paths: integer numpy ids under ID_KEYS as lists."""
    for part in ("inputs", "output"):
        if type(span.get(part)) is dict:
            span[part] = wire.ids_as_lists(span[part])
    return span


def test_random_spans_store_the_same_as_the_previous_packing_and_as_the_caller_passed() -> None:
    gen = Gen(seed=16)
    spliced_taken = walked = 0
    for index in range(400):
        span = gen.span(index)
        caller = copy.deepcopy(span)
        new, old = pack_span(copy.deepcopy(span), ENCODER, LIMIT), pack_span_legacy(copy.deepcopy(span), ENCODER, LIMIT)
        assert stored(new) == stored(old), (index, span)
        assert len(new) <= len(old)
        if gen.walks:
            walked += 1
            continue
        # the spliced path itself gave it (not the walk it falls back to), byte for byte one dump of the span
        pieces = wire._pack_spliced(prepared(copy.deepcopy(span)), ENCODER, LIMIT)
        assert pieces is not None and b"".join(pieces) == new, index
        assert wire.pieces_size(pieces) == len(new), index
        spliced_taken += 1
        if gen.opaque:
            continue
        got = orjson.loads(stored(new))
        for key in ("inputs", "output", "attributes", "parent_id", "end_time", "exception", "kind", "name", "start_time"):
            assert canonical(got[key]) == canonical(as_caller_sees_it(caller[key])), (index, key)
    assert spliced_taken > 100 and walked > 30  # both paths were exercised


@pytest.mark.parametrize("value", [
    [True, False] * 10, [1, 0] * 10, [1] + [True] * 20 + [0], [1.0] * 20, [1] * 20, [0.0, -0.0] * 10,
    [2**64 - 1] * 20, [-(2**63)] * 20, [], [[1, 2]] * 20, (1, 2, 3) * 10, [1, None, 2] * 10,
])
def test_each_numeric_shape_keeps_its_types(value: Any) -> None:
    span = {"span_id": "1" * 16, "trace_id": "1" * 16, "parent_id": None, "name": "op", "kind": "trajectory",
            "start_time": 1.0, "end_time": 2.0, "attributes": {}, "inputs": {"a": value, "b": {"c": value}},
            "output": {"d": value}, "exception": None}
    new = pack_span(copy.deepcopy(span), ENCODER, LIMIT)
    got = orjson.loads(stored(new))
    expected = as_caller_sees_it(value)
    assert canonical(got["inputs"]) == canonical({"a": expected, "b": {"c": expected}})
    assert canonical(got["output"]) == canonical({"d": expected})
    assert stored(new) == stored(pack_span_legacy(copy.deepcopy(span), ENCODER, LIMIT))


def test_ints_past_64_bits_take_the_walk_as_before() -> None:
    span = {"span_id": "1" * 16, "trace_id": "1" * 16, "parent_id": None, "name": "op", "kind": "trajectory",
            "start_time": 1.0, "attributes": {}, "inputs": {"ids": [1] + [2**64] * 20 + [2]}, "output": None, "exception": None}
    got = orjson.loads(stored(pack_span(copy.deepcopy(span), ENCODER, LIMIT)))
    assert got["inputs"]["ids"][1] == str(2**64)  # the walk's rule (the store keeps 64-bit ints)


# ---- redaction -----------------------------------------------------------------------------------

SECRET = "sk-SECRET-0123456789"
NUMERIC_SECRET = "98765432109876543210"  # a string that looks like a number


def secret_spans() -> list[tuple[str, dict[str, Any]]]:
    ids = list(range(100, 400))
    cases = {
        "key after a spliced list": {"inputs": {"prompt_ids": ids, "api_key": SECRET, "more": ids}},
        "key before a spliced list": {"inputs": {"api_key": SECRET, "prompt_ids": ids}},
        "a list as the secret": {"inputs": {"prompt_ids": ids, "Authorization": [31337] * 40}},
        "in a nested dict": {"inputs": {"cfg": {"deep": {"api_key": SECRET, "ids": ids}}, "ids": ids}},
        "in tool args": {"inputs": {"instance_id": "i", "parameters": {"code": "x", "auth_headers": {"X": SECRET}}}},
        "a number-like string": {"inputs": {"prompt_ids": ids, "token": NUMERIC_SECRET}},
        "a dict inside a numeric list": {"inputs": {"prompt_ids": [1] + [{"api_key": SECRET}] + ids}},
        "in a dict of a list of dicts": {"output": {"turns": [{"ids": ids, "meta": {"API_KEY": SECRET}}]}},
        "in the output beside ids": {"output": {"token_ids": ids, "api_key": SECRET, "log_probs": [0.5] * 50}},
        "in the delta's add sibling": {"inputs": {"prompt_ids": {"$ref": "ab" * 8, "n": 40, "add": ids, "api_key": SECRET}}},
        "in attributes": {"attributes": {"step": 1, "api_key": SECRET}, "inputs": {"ids": ids}},
        "an extra key from the config": {"inputs": {"ids": ids, "secret_field": SECRET}},
        "under a key with an escape": {"inputs": {"ids": ids, "api\u005fkey": SECRET}},
        "in a tuple": {"inputs": {"ids": ids, "pairs": ({"api_key": SECRET}, 1)}},
    }
    out = []
    for name, parts in cases.items():
        span = {"span_id": "c" * 16, "trace_id": "c" * 16, "parent_id": None, "name": "op", "kind": "trajectory",
                "start_time": 1.0, "end_time": 2.0, "attributes": {"step": 1}, "inputs": {}, "output": None, "exception": None}
        span.update(parts)
        out.append((name, span))
    return out


@pytest.mark.parametrize("name, span", secret_spans(), ids=[n for n, _ in secret_spans()])
def test_a_secret_in_any_place_never_reaches_the_wire_bytes(name: str, span: dict[str, Any]) -> None:
    packed = pack_span(copy.deepcopy(span), ENCODER, LIMIT)
    body = batch_body(HEADER, [packed])
    for needle in (SECRET, NUMERIC_SECRET, "31337,31337"):
        assert needle.encode() not in body, name
    assert REDACTED.encode() in body
    assert stored(packed) == stored(pack_span_legacy(copy.deepcopy(span), ENCODER, LIMIT))


def test_the_ids_beside_a_secret_still_arrive_whole() -> None:
    ids = list(range(1000))
    span = dict(secret_spans()[0][1], inputs={"prompt_ids": ids, "api_key": SECRET})
    got = orjson.loads(stored(pack_span(span, ENCODER, LIMIT)))
    assert got["inputs"] == {"prompt_ids": ids, "api_key": REDACTED}


# ---- default-valued fields -----------------------------------------------------------------------


def test_default_valued_fields_are_left_out_and_the_collector_fills_them_in() -> None:
    span = {"span_id": "d" * 16, "trace_id": "e" * 16, "parent_id": "e" * 16, "name": "op", "kind": "op",
            "start_time": 1.0, "end_time": None, "attributes": {}, "inputs": {"ids": list(range(50))}, "output": None,
            "exception": None}
    new = pack_span(copy.deepcopy(span), ENCODER, LIMIT)
    sent = orjson.loads(new)
    assert not {"end_time", "output", "exception", "kind"} & set(sent)
    assert stored(new) == stored(pack_span_legacy(copy.deepcopy(span), ENCODER, LIMIT))
    got = orjson.loads(stored(new))
    assert (got["kind"], got["end_time"], got["output"], got["exception"]) == ("op", None, None, None)


def test_both_packings_store_the_same_trajectory_at_a_real_collector(start_collector: Any, kit: Any) -> None:
    """Legacy bodies (every field sent) are still read, and a trajectory stores the same from both, and
    from the sender's body of pieces (the same bytes as the spliced packing's)."""
    import httpx

    gen = Gen(seed=7)
    root = "7" * 16
    spans = [{"span_id": root, "trace_id": root, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
              "start_time": 1.0, "end_time": 9.0, "attributes": {"step": 1, "sample_index": 0}, "inputs": {}, "output": None,
              "exception": None}]
    for i in range(12):
        child = gen.span(i + 1)
        child.update(trace_id=root, parent_id=root, kind="op", end_time=3.0 + i, start_time=2.0 + i)
        if type(child["inputs"].get("prompt_ids")) is dict:  # a delta of a span this collector never saw: refused
            child["inputs"]["prompt_ids"] = list(range(64))
        child["attributes"].update(step=1, sample_index=0)
        child["attributes"].pop("reward", None)
        spans.append(child)
    trees = []
    bodies = {packer: batch_body(HEADER, [packer(copy.deepcopy(s), ENCODER, LIMIT) for s in spans])
              for packer in (pack_span_legacy, pack_span)}
    # the sender's assembly: spans as pieces (ids not joined into their span first), one join a body
    pieces = batch_body_pieces(HEADER, [pack_span_pieces(copy.deepcopy(s), ENCODER, LIMIT) for s in spans])
    assert pieces == bodies[pack_span]
    for body in (bodies[pack_span_legacy], bodies[pack_span], pieces):
        col = start_collector()
        answer = httpx.post(col.url + "/v1/spans", content=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert answer.status_code == 200 and answer.json()["accepted"] == len(spans), answer.text
        tree = kit.wait_for(lambda: (r := httpx.get(f"{col.url}/v1/trajectories/{root}", timeout=10)).status_code == 200
                            and len(r.json()["root"]["children"]) == 12 and r.json())
        assert tree, "trajectory not stored"
        trees.append(tree)
    assert canonical(trees[0]) == canonical(trees[1]) == canonical(trees[2])


# ---- a span that cannot be packed ----------------------------------------------------------------


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no str")

    __repr__ = __str__

    def __hash__(self) -> int:
        return 1


def test_a_span_that_fails_to_pack_is_dropped_and_counted_not_raised() -> None:
    with pytest.raises(RuntimeError):  # the packer itself cannot write a key that has no str
        pack_span({"span_id": "1" * 16, "inputs": {Unprintable(): 1}}, ENCODER, LIMIT)
    collector = Collector()
    s = Sender(ClientConfig(url=collector.url, worker_id="w-unit", flush_interval_s=0.01))
    bad = SpanRecord("bad", "op", 1.0, None, {"step": 1}, kwargs={"x": {Unprintable(): [1] * 40}})
    bad.end = 2.0
    good = SpanRecord("good", "op", 1.0, None, {"step": 1}, kwargs={"ids": list(range(40))})
    good.end = 2.0
    s.enqueue(bad)
    s.enqueue(good)
    try:
        assert s.shutdown(10)
        assert collector.sent_names() == ["good"]
        assert s.stats.dropped == {"encode_error": 1} and s.stats.sent == 1
    finally:
        collector.server.shutdown()
        collector.server.server_close()


class SecretError:
    """A value whose conversion raises with a secret in the message (a to_dict that validates a key)."""

    @property
    def to_dict(self) -> Any:
        raise ValueError("bad config: api_key='sk-live-123456'")


def test_an_error_whose_message_cannot_be_made_costs_only_its_own_span(caplog: pytest.LogCaptureFixture) -> None:
    collector = Collector()
    s = Sender(ClientConfig(url=collector.url, worker_id="w-unit", flush_interval_s=0.01))
    for name, kwargs in (("good0", {"ids": list(range(40))}), ("unprintable", {"x": RaisesUnprintable()}),
                         ("good", {"ids": list(range(40))})):
        span = SpanRecord(name, "op", 1.0, None, {"step": 1}, kwargs=kwargs)
        span.end = 2.0
        s.enqueue(span)
    try:
        with caplog.at_level(logging.WARNING, logger="tracecar.client"):
            assert s.shutdown(10)
        assert collector.sent_names() == ["good0", "good"]  # the batch around it is whole: no internal_error
        assert s.stats.dropped == {"encode_error": 1} and s.stats.sent == 2
        [line] = [r.getMessage() for r in caplog.records if "could not be encoded" in r.getMessage()]
        assert "unprintable UnprintableError" in line
    finally:
        collector.server.shutdown()
        collector.server.server_close()


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str")


class RaisesUnprintable:
    @property
    def to_dict(self) -> Any:
        raise UnprintableError()


def test_spans_that_fail_to_encode_are_logged_once_scrubbed_and_every_one_counted(caplog: pytest.LogCaptureFixture) -> None:
    collector = Collector()
    s = Sender(ClientConfig(url=collector.url, worker_id="w-unit", flush_interval_s=0.01))

    def record(name: str, **kwargs: Any) -> SpanRecord:
        span = SpanRecord(name, "op", 1.0, None, {"step": 1}, kwargs=kwargs)
        span.end = 2.0
        return span

    s.enqueue(record("good0", ids=list(range(40))))
    for i in range(6):
        s.enqueue(record(f"bad{i}", x=SecretError()))
    s.enqueue(record("unprintable", x=RaisesUnprintable()))
    s.enqueue(record("good", ids=list(range(40))))
    try:
        with caplog.at_level(logging.WARNING, logger="tracecar.client"):
            assert s.shutdown(10)
        assert collector.sent_names() == ["good0", "good"]
        assert s.stats.dropped == {"encode_error": 7} and s.stats.sent == 2
        encode_lines = [r.getMessage() for r in caplog.records if "could not be encoded" in r.getMessage()]
        assert len(encode_lines) == 1, encode_lines  # once a process, not once a span
        assert "ValueError" in encode_lines[0] and "sk-live-123456" not in encode_lines[0]
        assert "sk-live-123456" not in caplog.text
        assert any("encode_error 7" in r.getMessage() for r in caplog.records)  # the shutdown line counts them all
    finally:
        collector.server.shutdown()
        collector.server.server_close()


# ---- the fast path's one-pass scan (issue 32: the sender's CPU) -------------------------------
def _three_walks(span: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """What the fast path did before its scans were made one pass: the attributes' dates, then per
    part ids_as_lists and _plain_enums, then the non-finite check over output, attributes, inputs."""
    import datetime
    import enum as enum_mod

    span = copy.copy(span)
    attributes = span.get("attributes")
    dates = (datetime.date, datetime.time)
    if type(attributes) is dict and any(isinstance(v, dates) for v in attributes.values()):
        span["attributes"] = {k: wire._attribute_text(v) if isinstance(v, dates) else v for k, v in attributes.items()}
    for part in ("output", "inputs"):
        value = span.get(part)
        if type(value) is dict:
            span[part] = wire._plain_enums(wire.ids_as_lists(value), wire.ENUM_SCAN_DEPTH, ENCODER.stringify)
        elif isinstance(value, enum_mod.Enum) or type(value) in (list, tuple):
            span[part] = wire._plain_enums({"": value}, wire.ENUM_SCAN_DEPTH, ENCODER.stringify)[""]

    def non_finite(values: Any) -> bool:
        return isinstance(values, dict) and any(isinstance(v, float) and not math.isfinite(v) for v in values.values())

    return span, not (non_finite(span.get("output")) or non_finite(span.get("attributes")) or non_finite(span.get("inputs")))


def test_the_fast_paths_one_pass_scan_is_the_three_walks_it_replaced() -> None:
    import datetime
    import enum as enum_mod

    class Color(enum_mod.Enum):
        RED = "red"

    class Level(enum_mod.IntEnum):
        HIGH = 3

    class Ratio(float, enum_mod.Enum):
        HALF = 0.5
        BAD = math.nan

    when = datetime.datetime(2026, 12, 5, 7, 0, tzinfo=datetime.timezone.utc)
    values = [1, "x", None, True, 0.5, math.nan, -math.inf, np.float64(math.nan), np.float64(2.0), Color.RED, Level.HIGH,
              Ratio.HALF, Ratio.BAD, [1, 2, 3], [Color.RED, 1], [1, Color.RED, 2], (Color.RED,), [], {"a": Color.RED},
              {"a": {"b": {"c": Color.RED}}}, {"a": {"b": {"c": {"d": Color.RED}}}}, np.arange(4), np.arange(4.0), when,
              datetime.date(2026, 12, 5), {"t": when}]
    rng = random.Random(32)
    for _ in range(400):
        span: dict[str, Any] = {"span_id": "s", "name": "n"}
        for part in ("inputs", "output", "attributes"):
            roll = rng.random()
            if roll < 0.1:
                span[part] = rng.choice(values)
            elif roll < 0.15:
                span[part] = None
            elif roll < 0.2:
                span[part] = collections.OrderedDict(reward=rng.choice(values))
            else:
                keys = rng.sample(["prompt_ids", "response_ids", "token_ids", "reward", "a", "b", "c"], rng.randint(0, 5))
                span[part] = {k: rng.choice(values) for k in keys}
        expected, fits = _three_walks(span)
        got = copy.copy(span)
        assert wire._fast_path_fits(got, ENCODER.stringify) is fits, span
        assert repr(got) == repr(expected), span
