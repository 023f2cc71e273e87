"""Id lists kept as the bytes received (collector/receivers/raw_ids.py): whatever the body, what is
stored and what any stage reads is exactly what parsing it whole gives."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from tracecar.client.redact import RedactKeys
from tracecar.collector.processors.prompt_refs import PromptContexts, resolve_refs
from tracecar.collector.processors.span_work import serialize_spans
from tracecar.collector.receivers import receive
from tracecar.collector.receivers.raw_ids import POSITIONS, locate, parse_keeping_ids
from tracecar.collector.receivers.worker_pool import parse_batch
from tracecar.collector.spool.payload import pack_payload
from tracecar.collector.types import RawIds

KEYS = RedactKeys([])


def _span(i: int, **parts: Any) -> dict[str, Any]:
    return {"span_id": f"s{i}", "trace_id": "t1", "parent_id": "t1", "name": "generate", "start_time": 1.0,
            "end_time": 2.0, "attributes": {"step": 1}, **parts}


def _batch(*spans: dict[str, Any], root: bool = True, **envelope: Any) -> bytes:
    trajectory = {"span_id": "t1", "trace_id": "t1", "name": "agent_loop", "kind": "trajectory", "start_time": 0.0,
                  "end_time": 3.0}
    return orjson.dumps({"worker": "w1", "v": 2, "spans": [*spans, *([trajectory] if root else [])], **envelope})


def _both(body: bytes) -> tuple[Any, Any]:
    plain = parse_batch(body, "application/json", None, 1000, 64 << 20, KEYS, keep_ids=False)
    kept = parse_batch(body, "application/json", None, 1000, 64 << 20, KEYS, keep_ids=True)
    return plain, kept


def _raw_positions(value: Any, path: str = "") -> list[str]:
    """Where a RawIds sits in a parsed value."""
    if type(value) is RawIds:
        return [path]
    if type(value) is dict:
        return [p for k, v in value.items() for p in _raw_positions(v, f"{path}.{k}")]
    if type(value) is list:
        return [p for i, v in enumerate(value) for p in _raw_positions(v, f"{path}[{i}]")]
    return []


def _assert_same(body: bytes) -> Any:
    plain, kept = _both(body)
    assert [r.field for r in kept.rejected] == [r.field for r in plain.rejected]
    assert len(kept.spans) == len(plain.spans)
    allowed = {f".{part}.{key}" for part, keys in POSITIONS.items() for key in keys}
    for a, b in zip(plain.spans, kept.spans):
        assert set(_raw_positions(b)) <= allowed
        assert pack_payload(a) == pack_payload(b)  # the stored bytes, exactly
        assert orjson.loads(pack_payload(b)[0]) == orjson.loads(pack_payload(a)[0])
    return kept


def test_a_generate_calls_ids_stay_bytes_and_store_exactly_as_sent() -> None:
    prompt, response = list(range(1000, 2500)), [0, *range(7, 507)]
    kept = _assert_same(_batch(_span(1, inputs={"prompt_ids": prompt, "request_id": "r0"},
                                     output={"token_ids": response, "stop_reason": "stop"})))
    span = kept.spans[0]
    assert type(span["inputs"]["prompt_ids"]) is RawIds and len(span["inputs"]["prompt_ids"]) == 1500
    assert span["output"]["token_ids"].tolist() == response
    assert span["output"]["token_ids"] == response


@pytest.mark.parametrize("value", [
    "[01,2]", "[1,02]", "[-1,2]", "[1, 2]", "[1.0,2]", "[1e3]", "[]", "[1,,2]", "[,1]", "[1,]",
    "[9223372036854775807]", "[12345678901234567890]", "[99999999999999999999999]", '[1,"2"]', "[[1],[2]]",
    "[true]", "[null,1]", "[1]  ", "[0]", "[0,0,10,100]",
])
def test_every_shape_of_an_ids_array_parses_to_what_orjson_gives(value: str) -> None:
    body = _batch(_span(1, inputs={"request_id": "r"}, output={"stop_reason": "x"}))
    body = body.replace(b'"inputs":{', b'"inputs":{"prompt_ids":' + value.encode() + b",", 1)
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:  # invalid JSON: the same refusal, naming the same place
        with pytest.raises(receive.BodyError) as plain:
            receive.parse(body, "application/json", keep_ids=False)
        with pytest.raises(receive.BodyError) as kept:
            receive.parse(body, "application/json", keep_ids=True)
        assert kept.value.reason == plain.value.reason
        return
    _assert_same(body)


def test_only_a_spans_known_positions_keep_bytes_every_other_ids_list_is_a_list() -> None:
    ids = [5, 6, 7]
    kept = _assert_same(_batch(
        _span(1, attributes={"engine_ids": ids, "step": 1}, inputs={"messages": [{"tool_ids": ids}], "prompt_ids": ids},
              output={"nested": {"response_ids": ids}, "response_ids": ids}),
        _span(2, inputs={"prompt_ids": ids}, output=[{"token_ids": ids}]),  # an output that is a list
        _span(3, inputs={"prompt_ids": ids}, output="text"),
        other_ids=ids))
    first = kept.spans[0]
    assert first["attributes"]["engine_ids"] == ids and type(first["attributes"]["engine_ids"]) is list
    assert type(first["inputs"]["messages"][0]["tool_ids"]) is list
    assert type(first["output"]["nested"]["response_ids"]) is list
    assert type(first["output"]["response_ids"]) is RawIds
    assert type(kept.spans[1]["output"][0]["token_ids"]) is list


def test_a_string_that_mentions_an_ids_key_is_left_as_it_is() -> None:
    text = 'a log line: "prompt_ids":[1,2] and \\"x_ids\\":[3]'
    kept = _assert_same(_batch(_span(1, inputs={"prompt_ids": [1, 2], "note": text}, output={"token_ids": [3]})))
    assert kept.spans[0]["inputs"]["note"] == text


def test_a_body_holding_an_escaped_nul_is_parsed_as_it_came() -> None:
    """The placeholder's key starts with NUL: a client could otherwise write one."""
    body = _batch(_span(1, inputs={"prompt_ids": [1, 2], "\x00tracecar_ids": 0}, output={"token_ids": [3]}))
    assert b"\\u0000" in body and parse_keeping_ids(body) is None
    kept = _assert_same(body)
    assert type(kept.spans[0]["inputs"]["prompt_ids"]) is list


def test_a_batch_asking_for_token2text_gets_lists() -> None:
    _, kept = _both(_batch(_span(1, inputs={"prompt_ids": [1, 2]}, output={"token_ids": [3]}), token2text=True))
    assert type(kept.spans[0]["inputs"]["prompt_ids"]) is list and type(kept.spans[0]["output"]["token_ids"]) is list


def test_random_bodies_store_the_same_bytes() -> None:
    """Ids lists of every kind, at every depth, beside strings that mention them (bounded: 200 bodies)."""
    rng = random.Random(7)

    def ids() -> Any:
        kind = rng.randrange(6)
        if kind == 0:
            return []
        if kind == 1:
            return [rng.choice([0, 1, -1, 2**40, 2**63 - 1]) for _ in range(rng.randrange(1, 5))]
        if kind == 2:
            return [rng.random() for _ in range(3)]
        return [rng.randrange(0, 150_000) for _ in range(rng.randrange(1, 300))]

    def value(depth: int) -> Any:
        roll = rng.randrange(5)
        if depth > 3 or roll == 0:
            return rng.choice(['"x_ids":[1]', "plain", 3, None, 1.5])
        if roll == 1:
            return [value(depth + 1) for _ in range(rng.randrange(3))]
        return {rng.choice(["prompt_ids", "response_ids", "token_ids", "a_ids", "text", "add"]):
                (ids() if rng.random() < 0.6 else value(depth + 1)) for _ in range(rng.randrange(1, 4))}

    for _ in range(200):
        spans = [_span(i, inputs=value(0) if rng.random() < 0.3 else {"prompt_ids": ids(), "x": value(1)},
                       output=value(0) if rng.random() < 0.3 else {"token_ids": ids(), "response_ids": ids()})
                 for i in range(rng.randrange(1, 5))]
        for span in spans:
            if type(span["inputs"]) is not dict:
                span["inputs"] = {"v": span["inputs"]}
        _assert_same(_batch(*spans))


def test_a_later_turn_rebuilds_its_prompt_from_a_context_kept_as_bytes() -> None:
    """Prompt references (v2): the context a turn leaves is bytes; the next turn's rebuilt list and
    its stored reference are what they are with lists."""
    first = _batch(_span(1, inputs={"prompt_ids": [1, 2, 3]}, output={"response_ids": [4, 5], "response_mask": [1, 1]}),
                   root=False)
    second = orjson.dumps({"worker": "w1", "v": 2, "spans": [_span(
        2, inputs={"prompt_ids": {"$ref": "s1", "n": 5, "add": [6, 7]}}, output={"token_ids": [8]})]})
    stored = []
    for keep in (False, True):
        contexts = PromptContexts(1 << 20)
        out = []
        for body in (first, second):
            validated = parse_batch(body, "application/json", None, 1000, 64 << 20, KEYS, keep_ids=keep)
            resolve_refs(validated, contexts, max_ids=1 << 20)
            rows, too_big = serialize_spans(validated.spans, validated.warnings, validated.index_of, {},
                                            max_span_bytes=1 << 20, count_tokens=False, local_only=True)
            assert not too_big and not validated.rejected
            out.append([(r.payload, r.token_arrays) for r in rows])
        assert [s for s in validated.spans if s["span_id"] == "s2"][0]["inputs"]["prompt_ids"] == [1, 2, 3, 4, 5, 6, 7]
        stored.append(out)
    assert stored[0] == stored[1]  # payloads and the packed per-token arrays (ids from bytes) alike
    assert any(packed for batch in stored[1] for _, packed in batch)


def test_locate_finds_each_plain_array_under_a_known_key_once() -> None:
    body = (b'{"prompt_ids":[1,2],"token_ids":[1, 2],"c":"token_ids\\":[3]","response_ids":[4],"a_ids":[5],'
            b'"xprompt_ids":[6],"x":{"token_ids":[7,8,9]}}')
    assert [(body[s:e], n) for s, e, n in locate(body)] == [(b"[1,2]", 2), (b"[4]", 1), (b"[7,8,9]", 3)]


def _fragments() -> Any:
    from hypothesis import strategies as st

    item = st.one_of(st.integers(0, 2**70).map(str), st.sampled_from(["", "0", "00", "07", "-1", "1.5", " 1", "9" * 20, ";", "x"]))
    array = st.lists(item, max_size=6).map(lambda items: "[" + ",".join(items) + "]")
    key = st.sampled_from(['"prompt_ids":', '"token_ids":', '"response_ids":', '"a_ids":', '"ids":', '"token_ids" :', ""])
    return st.lists(st.tuples(key, array, st.sampled_from([",", "]", "}", ' "_ids\\":[1]', ""])), max_size=8)


def test_the_vectorised_locate_finds_what_the_reference_finds() -> None:
    """numpy's passes over all candidates at once against the byte-string checks, one array at a time."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tracecar.collector.receivers.raw_ids import _locate_np, locate_py

    @settings(max_examples=400, deadline=None)
    @given(_fragments(), st.integers(1, 64))
    def check(parts: list[tuple[str, str, str]], group_bytes: int) -> None:
        body = "".join(k + a + t for k, a, t in parts).encode()
        assert _locate_np(body) == locate_py(body) == _locate_np(body, group_bytes)  # checked at once or in groups

    check()


def test_without_numpy_the_same_bytes_are_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    from tracecar.collector.receivers import raw_ids

    monkeypatch.setattr(raw_ids, "_np", raw_ids._NO_NUMPY)  # as where numpy is not installed
    test_random_bodies_store_the_same_bytes()
    kept = _assert_same(_batch(_span(1, inputs={"prompt_ids": [1, 2]}, output={"token_ids": [3, 40]})))
    assert type(kept.spans[0]["output"]["token_ids"]) is RawIds


def test_a_gateway_stores_a_nodes_forwarded_ids_exactly_as_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forwarded batches (receivers/forwarded.py) keep ids as bytes too: the same payloads as parsed."""
    from tracecar.collector.receivers.forwarded import ForwardedRequest

    ids = list(range(100, 400))
    spans = [{**_span(i, inputs={"prompt_ids": ids}, output={"token_ids": ids[:50], "response_ids": [0, 1],
                                                                "response_mask": [1, 1], "nested": {"token_ids": [5]}}),
              "worker": "w1", "project": None, "entity": None, "token_ends": [1, 2]} for i in range(3)]
    body = orjson.dumps({"worker": "node-a", "v": 1, "spans": spans})
    request = ForwardedRequest("node-a", 64 << 20, 1000, KEYS)
    kept = request(body, "application/json", None)
    assert type(kept.spans[0]["inputs"]["prompt_ids"]) is RawIds and type(kept.spans[0]["output"]["nested"]["token_ids"]) is list
    real_parse = receive.parse
    monkeypatch.setattr(receive, "parse", lambda *a, **k: real_parse(*a, **{**k, "keep_ids": False}))
    plain = request(body, "application/json", None)
    assert type(plain.spans[0]["inputs"]["prompt_ids"]) is list
    for batch in (plain, kept):
        rows, too_big = serialize_spans(batch.spans, batch.warnings, batch.index_of, batch.carried_ends,
                                        max_span_bytes=1 << 20, count_tokens=True, local_only=True)
        assert not too_big
        batch.rows = [(r.payload, r.token_arrays, r.tokens) for r in rows]
    assert kept.rows == plain.rows and kept.rows[0][2] == 300 + 2  # token counts by length, as by ints


def test_without_numpy_the_byte_string_checks_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from tracecar.collector.receivers import raw_ids

    monkeypatch.setattr(raw_ids, "_np", raw_ids._NO_NUMPY)
    monkeypatch.setattr(raw_ids, "_locate_np", lambda body: pytest.fail("numpy used where it is absent"))
    assert locate(b'{"prompt_ids":[1,2]}') == [(14, 19, 2)]


def test_an_array_past_the_bound_and_candidates_full_of_text_are_parsed_as_they_are() -> None:
    """An array over MAX_ARRAY_BYTES (no context is that long) is left to the parser, as are
    ``"token_ids":[`` candidates holding objects and text (each refused once, not byte by byte)."""
    from tracecar.collector.receivers.raw_ids import MAX_ARRAY_BYTES

    long = list(range(10**5, 10**5 + MAX_ARRAY_BYTES // 7 + 10))  # 7 bytes an id with its comma
    kept = _assert_same(_batch(_span(1, inputs={"prompt_ids": long}, output={"token_ids": [1, 2]})))
    assert type(kept.spans[0]["inputs"]["prompt_ids"]) is list and type(kept.spans[0]["output"]["token_ids"]) is RawIds
    texts = [{"token_ids": [{"t": "x" * 300}], "response_ids": ["a", 1]} for _ in range(50)]
    kept = _assert_same(_batch(_span(2, inputs={"prompt_ids": [5]}, output={"token_ids": [6], "steps": texts})))
    assert locate(orjson.dumps(texts)) == []


def test_a_broken_numpy_costs_no_request(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """numpy installed but failing to import: one line, and the byte-string checks, same answer."""
    import builtins

    from tracecar.collector.receivers import raw_ids

    real_import = builtins.__import__

    def broken(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "numpy":
            raise RuntimeError("numpy.core.multiarray failed to import")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(raw_ids, "_np", None)
    monkeypatch.setattr(builtins, "__import__", broken)
    with caplog.at_level("WARNING", logger="tracecar.collector"):
        kept = _assert_same(_batch(_span(1, inputs={"prompt_ids": [1, 2]}, output={"token_ids": [3]})))
        _assert_same(_batch(_span(2, inputs={"prompt_ids": [4]}, output={"token_ids": [5]})))
    assert type(kept.spans[0]["inputs"]["prompt_ids"]) is RawIds
    assert [r.getMessage() for r in caplog.records].count(
        "numpy could not be imported (RuntimeError: numpy.core.multiarray failed to import); "
        "id arrays are checked without it, slower") == 1
