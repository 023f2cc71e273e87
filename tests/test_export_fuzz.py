"""No exception escapes a span (issue 28, "Done when"): generated extreme values through every
exporter's translation and the export writers.

Hypothesis builds trajectories with extreme times (0, the latest accepted, past it, NaN),
numbers (past 64 bits, 1e308, NaN), nesting, id shapes, mixed-type id lists (``[1, "x", 3]``,
bools, ints past int64) and odd shapes where tracecar reads structure (``attributes.otel`` of
any type). Each batch goes the way a real one does: ``validate_batch`` (what it refuses never
reaches an exporter), the spool's serialisation into a real SQLite spool, then

* every exporter (``weave``, ``otlp``, ``mlflow``, real sinks on an in-memory HTTP transport)
  through the forwarder's shared path (``Forwarder._send_isolating``): every span ends
  delivered or rejected with a reason, and nothing raises out of the batch;
* the ``gateway`` sink (a node collector forwarding to its gateway), whose in-memory gateway
  answers what the real one does: each body goes through the gateway's own receive stage
  (``ForwardedRequest``: decompression, parsing, validation, the node's fields restored) and
  is answered with its rejections, so every span a node stored must also pass its gateway;
* the dataset export (``record`` → JSONL and Parquet writers): a whole, readable file, every
  trajectory a row or a named, counted skip.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tracecar.client.redact import DEFAULT
from tracecar.collector.exporters.forward import Forwarder, Sink, span_from_row
from tracecar.collector.exporters.gateway_sink import GatewaySink
from tracecar.collector.exporters.otlp_sink import MlflowSink, OtlpSink
from tracecar.collector.exporters.weave_sink import WeaveSink
from tracecar.collector.metrics import Metrics
from tracecar.collector.processors.span_work import serialize_spans
from tracecar.collector.processors.validate import MAX_TIME_S, EnvelopeError, validate_batch
from tracecar.collector.receivers.forwarded import ForwardedRequest
from tracecar.collector.receivers.receive import BodyError
from tracecar.collector.spool.query import get_trajectory
from tracecar.collector.spool.store import Spool
from tracecar.collector.viewer.export import jsonl_chunks, parquet_chunks, record

pytestmark = pytest.mark.timeout(600)

_EXAMPLES = itertools.count()
TIMES = st.one_of(st.sampled_from([0.0, 1.0, 1.7e9, MAX_TIME_S - 1, MAX_TIME_S, 1e11, 2**64 / 1e9, -1.0, float("nan")]),
                  st.floats(min_value=0, max_value=MAX_TIME_S - 1, allow_nan=False))
NUMBERS = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.sampled_from([2**63, 2**64 - 1, -(2**63) - 1]),
                    st.floats(allow_nan=True, allow_infinity=True), st.booleans())
SCALARS = st.one_of(st.none(), NUMBERS, st.text(max_size=20))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=25)
ID_LISTS = st.one_of(st.lists(st.integers(0, 200_000), max_size=30), st.lists(SCALARS, max_size=8),
                     st.sampled_from([[1, "x", 3], [1, True, 3], [1, 2**63, 3], [2**64], [], [None], [1.5, 2]]),
                     SCALARS)
IDS = st.from_regex(r"[A-Za-z0-9._:\-]{1,128}", fullmatch=True)
OTEL = st.one_of(st.none(), VALUES, st.fixed_dictionaries({}, optional={
    "status": VALUES, "events": st.one_of(VALUES, st.lists(st.fixed_dictionaries({"time": st.one_of(TIMES, VALUES),
                                                                                  "attributes": VALUES}), max_size=3)),
    "kind": VALUES, "resource": VALUES, "scope": VALUES, "span_id": VALUES, "trace_state": VALUES}))


@st.composite
def batches(draw: Any) -> dict[str, Any]:
    root = draw(st.one_of(IDS, st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)))
    spans: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 4))):
        start = draw(TIMES)
        # mostly what validation accepts (so the exporters see it), sometimes not
        attributes = draw(st.dictionaries(st.sampled_from(["note", "otel", "tracecar", "gen_ai.usage", "weave"]), VALUES,
                                          max_size=3))
        attributes.update(draw(st.fixed_dictionaries({}, optional={
            "step": st.integers(-(2**63), 2**63 - 1), "sample_index": st.one_of(st.integers(-5, 5), st.text(min_size=1, max_size=5)),
            "reward": st.one_of(st.floats(), st.integers(-(2**63), 2**63 - 1))})))
        if draw(st.integers(0, 3)):
            attributes["otel"] = draw(OTEL)
        spans.append({
            "span_id": draw(IDS), "trace_id": root, "parent_id": root, "name": draw(st.text(min_size=1, max_size=30)),
            "kind": "op", "start_time": start, "attributes": attributes,
            "end_time": draw(TIMES) if draw(st.integers(0, 4)) == 0 else None if draw(st.integers(0, 4)) == 0
            else start + draw(st.floats(0, 1e4)),
            "inputs": {"prompt_ids": draw(ID_LISTS), "x": draw(VALUES)},
            "output": draw(st.one_of(VALUES, st.fixed_dictionaries({"token_ids": ID_LISTS, "response_ids": ID_LISTS,
                                                                     "response_text": SCALARS, "prompt_text": SCALARS}))),
            "exception": draw(st.one_of(st.none(), st.text(max_size=40))),
        })
    spans.append({"span_id": root, "trace_id": root, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
                  "start_time": 1.7e9, "end_time": 1.7e9 + draw(st.floats(0, 1e4)),
                  "attributes": {"step": draw(st.integers(-5, 5)), "sample_index": 0,
                                 "reward": draw(st.one_of(st.floats(), st.integers(-(2**63), 2**63 - 1)))},
                  "inputs": {}, "output": None, "exception": None})
    return {"v": 1, "worker": "w-fuzz", "spans": spans}


def _ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={})


def _gateway(request: httpx.Request) -> httpx.Response:
    """A gateway's answer to a node's batch: its own receive stage, answered as service/app.py answers."""
    receive = ForwardedRequest(request.headers["x-tracecar-node"], 64 << 20, 100_000, DEFAULT)
    try:
        validated = receive(request.content, request.headers.get("content-type"), request.headers.get("content-encoding"))
    except BodyError as exc:
        return httpx.Response(exc.status, json={"error": {"field": exc.field, "reason": exc.reason}})
    except EnvelopeError as exc:
        return httpx.Response(400, json={"error": {"field": exc.field, "reason": exc.reason}})
    rejected = [r.as_dict() for r in validated.rejected]
    return httpx.Response(422 if rejected and not validated.spans else 200,
                          json={"accepted": len(validated.spans), "rejected_count": len(rejected), "rejected": rejected})


def _sinks() -> list[Sink]:
    transport = httpx.MockTransport(_ok)
    return [
        GatewaySink("http://gateway.invalid", node="node-fuzz", client=httpx.AsyncClient(
            transport=httpx.MockTransport(_gateway),
            headers={"Content-Type": "application/json", "Content-Encoding": "zstd", "X-Tracecar-Node": "node-fuzz"})),
        WeaveSink(api_key="k" * 40, entity="ent", project="proj", server_url="http://weave.invalid", publish_ops=False,
                  transport=transport),
        OtlpSink("http://otlp.invalid/v1/traces", content=True, client=httpx.AsyncClient(transport=transport)),
        MlflowSink("http://mlflow.invalid", "1", span_types="typed", client=httpx.AsyncClient(transport=transport)),
    ]


@pytest.fixture(scope="module")
def spool(tmp_path_factory: pytest.TempPathFactory) -> Spool:
    return Spool(Path(tmp_path_factory.mktemp("fuzz")) / "spool.db", local_only=False)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                    HealthCheck.function_scoped_fixture])
@given(batch=batches())
def test_no_exception_escapes_a_span_in_any_exporter_or_export_writer(spool: Spool, batch: dict[str, Any]) -> None:
    try:
        orjson.dumps(batch)
    except orjson.JSONEncodeError:  # a value no client can send as JSON (an int past 64 bits goes as text)
        batch = json.loads(json.dumps(batch, default=str).replace("NaN", "null").replace("Infinity", "1e308"))
    unique = f".{next(_EXAMPLES)}"  # ids of one example never collide with an earlier one's in the shared spool
    for span in batch["spans"]:
        for key in ("span_id", "trace_id", "parent_id"):
            if isinstance(span.get(key), str):
                span[key] = span[key][:100] + unique
    validated = validate_batch(batch, 8192)
    rows, _ = serialize_spans(validated.spans, validated.warnings, validated.index_of, {}, max_span_bytes=1 << 20,
                              count_tokens=False, local_only=False)
    spool.write(rows)
    ids = [r.span["span_id"] for r in rows]
    stored = spool.query(f"SELECT span_id, payload FROM spans WHERE span_id IN ({','.join('?' * len(ids))})", ids) if ids else []
    spans = [span_from_row(r["payload"], None, None) for r in stored]
    event(f"spans stored: {min(len(spans), 3)}+")

    async def through_every_exporter() -> None:
        for sink in _sinks():
            forwarder = Forwarder(spool, sink, Metrics(), batch_spans=100, retry_initial_s=0.01, retry_max_s=0.01,
                                  keep_forwarded=True)
            try:
                result = await forwarder._send_isolating(spans)  # raises only for what may pass (never here)
            finally:
                await sink.aclose()
            answered = set(result.delivered) | set(result.rejected)
            assert answered == {s["span_id"] for s in spans} and not result.retryable, (sink.name, result)
            assert all(isinstance(reason, str) and reason for reason in result.rejected.values())
            if sink.name == "gateway":  # what the node took and stored, its gateway takes too: nothing lost between them
                assert not result.rejected, result.rejected

    asyncio.run(through_every_exporter())

    trace_ids = {s["trace_id"] for s in spans}
    trees = [(t, get_trajectory(spool, t)) for t in trace_ids]
    summary = {"experiment": None, "step": 1, "sample_index": 0, "rollout_n": 0, "validate": False, "worker": "w-fuzz"}
    for token_ids in (False, True):
        skipped: list[str] = []
        made = []
        for trace_id, tree in trees:
            assert tree is not None
            try:
                made.append(record(tree, dict(summary, trace_id=trace_id), token_ids=token_ids))
            except Exception as exc:  # noqa: BLE001 - records() leaves such a trajectory out, named: count it so
                skipped.append(f"{trace_id}: {exc}")
        lines = b"".join(jsonl_chunks(iter(made), on_skip=lambda t, why: skipped.append(t))).splitlines()
        assert len(lines) + len(skipped) == len(trees)
        assert all(isinstance(json.loads(line), dict) for line in lines)
        skipped.clear()
        parquet = b"".join(parquet_chunks(iter(made), token_ids=token_ids, on_skip=lambda t, why: skipped.append(t)))
        table = pq.read_table(io.BytesIO(parquet))
        assert table.num_rows + len(skipped) == len(made)
