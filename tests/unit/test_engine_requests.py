"""Which call sent which engine request (receivers/joins.py EngineRequests): bounded, and its misses counted."""

from __future__ import annotations

from typing import Any

from tracecar.collector.receivers.joins import EngineRequest, EngineRequests, rekey


def _call(span_id: str, ids: list[str], mark: Any = None) -> dict[str, Any]:
    attrs: dict[str, Any] = {"engine_request_ids": ids}
    if mark is not None:
        attrs["tracecar"] = mark
    return {"span_id": span_id, "trace_id": "t" * 32, "parent_id": "r" * 32, "kind": "op", "attributes": attrs}


def test_requests_are_found_by_id_and_by_verls_prefill_and_decode_legs():
    index = EngineRequests(10)
    index.remember([_call("g" * 32, ["req-1"], {"top": True})])
    assert index.recorded_any
    assert index.lookup("req-1") == EngineRequest("t" * 32, "g" * 32, "g" * 32)
    assert index.lookup("req-1_P") == index.lookup("req-1_D") == index.lookup("req-1")
    assert index.lookup("req-2") is None and index.lookup("req-1_X") is None


def test_forgotten_requests_no_engine_span_named_are_counted_once_joins_happen_at_all():
    counted: list[int] = []
    index = EngineRequests(2, on_unmatched=counted.append)
    index.remember([_call("a" * 32, ["r1"]), _call("b" * 32, ["r2"]), _call("c" * 32, ["r3"])])
    assert counted == []  # nothing ever joined by request id: an engine that traces nothing is not a miss per request
    assert index.lookup("r3") is not None
    index.remember([_call("d" * 32, ["r4"]), _call("e" * 32, ["r5"])])  # evicts r2 (never named) and r3 (named)
    assert counted == [1]


def test_rekey_puts_a_span_under_its_call_with_the_place_tracestate_would_have_given():
    span: dict[str, Any] = {"span_id": "s" * 32, "trace_id": "o" * 32, "parent_id": None, "attributes": {"otel": {}}}
    rekey(span, EngineRequest("t" * 32, "g" * 32, "root1.turn1"))
    assert (span["trace_id"], span["parent_id"], span["span_id"]) == ("t" * 32, "g" * 32, "s" * 32)
    assert span["attributes"]["tracecar"] == {"root": "root1", "turn": "turn1"}
    assert span["attributes"]["otel"]["joined_by"] == "gen_ai.request.id"
