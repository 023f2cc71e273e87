"""collector/exporters/forward.py: what the sink answers decides each span's fate, and nothing answered is resent."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from tracecar.collector.exporters.forward import Forwarder, SendResult, Sink, translating
from tracecar.collector.metrics import Metrics
from tracecar.collector.spool.store import Spool, SpoolRow

pytestmark = pytest.mark.timeout(60)


class ScriptedSink:
    """Answers each send with the next scripted function of the span ids (then: all delivered)."""

    name = "scripted"

    def __init__(self, *script: Any) -> None:
        self.script = deque(script)
        self.sent: list[list[str]] = []

    async def send(self, spans: Sequence[Mapping[str, Any]]) -> SendResult:
        ids = [s["span_id"] for s in spans]
        self.sent.append(ids)
        answer = self.script.popleft() if self.script else (lambda ids: SendResult(delivered=ids))
        return answer(ids)

    async def aclose(self) -> None:
        return None


def spool_with(tmp_path: Path, *span_ids: str) -> Spool:
    spool = Spool(tmp_path / "s.db", local_only=False)
    rows = []
    for sid in span_ids:
        span = {"span_id": sid, "trace_id": sid, "parent_id": None, "name": f"op-{sid}", "kind": "op", "start_time": 1.0,
                "end_time": 2.0, "attributes": {}, "inputs": {"q": sid}, "output": None, "exception": None,
                "worker": "w", "project": None, "entity": None}
        rows.append(SpoolRow(span, orjson.dumps(span), None))
    spool.write(rows)
    return spool


def drain(spool: Spool, sink: Sink, metrics: Metrics | None = None, seconds: float = 5.0, **options: Any) -> Forwarder:
    options = {"batch_spans": 10, "retry_initial_s": 0.01, "retry_max_s": 0.05, "keep_forwarded": True, **options}
    forwarder = Forwarder(spool, sink, metrics or Metrics(), **options)

    async def go() -> None:
        await forwarder.run(deadline=asyncio.get_running_loop().time() + seconds)

    asyncio.run(go())
    return forwarder


def states(spool: Spool) -> dict[str, int]:
    return {r["span_id"]: r["state"] for r in spool.query("SELECT span_id, state FROM spans")}


def test_delivered_rejected_and_retryable_each_go_their_way(tmp_path: Path) -> None:
    spool = spool_with(tmp_path, "a", "b", "c")
    sink = ScriptedSink(lambda ids: SendResult(delivered=["a"], rejected={"b": "422: bad call"}, retryable=["c"],
                                               retry_reason="503 from the backend"))
    metrics = Metrics()
    drain(spool, sink, metrics)
    assert sink.sent == [["a", "b", "c"], ["c"]]  # only the retryable span is sent again
    assert states(spool) == {"a": 1, "b": 2, "c": 1}
    assert [(r["span_id"], r["name"], r["reason"]) for r in spool.dead_letters()] == [("b", "op-b", "422: bad call")]
    assert spool.pending_count == 0


def test_a_sink_that_raises_loses_nothing_and_is_tried_again(tmp_path: Path) -> None:
    def boom(ids: list[str]) -> SendResult:
        raise RuntimeError("sink bug")

    spool = spool_with(tmp_path, "a", "b")
    sink = ScriptedSink(boom)
    forwarder = drain(spool, sink)
    assert sink.sent == [["a", "b"], ["a", "b"]] and states(spool) == {"a": 1, "b": 1}
    assert forwarder.last_error is None


def test_a_retry_after_sets_the_backoff_and_the_error_is_reported_until_it_clears(tmp_path: Path) -> None:
    spool = spool_with(tmp_path, "a")
    sink = ScriptedSink(lambda ids: SendResult(retryable=ids, retry_after=0.2, retry_reason="429 Too Many Requests"))
    forwarder = Forwarder(spool, sink, Metrics(), batch_spans=10, retry_initial_s=0.01, retry_max_s=5, keep_forwarded=True)

    async def go() -> tuple[float, str | None]:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(forwarder.run(deadline=loop.time() + 5))
        while not sink.sent:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        seen = (forwarder.backoff_s, forwarder.last_error)
        await task
        return seen

    backoff, error = asyncio.run(go())
    assert backoff == 0.2 and error == "429 Too Many Requests"
    assert len(sink.sent) == 2 and states(spool) == {"a": 1} and forwarder.last_error is None


def test_batches_respect_batch_spans_and_go_oldest_first(tmp_path: Path) -> None:
    ids = [f"s{i:02d}" for i in range(7)]
    spool = spool_with(tmp_path, *ids)
    sink = ScriptedSink()
    drain(spool, sink, batch_spans=3)
    assert sink.sent == [ids[0:3], ids[3:6], ids[6:]]


def test_keep_forwarded_false_deletes_what_the_backend_has(tmp_path: Path) -> None:
    spool = spool_with(tmp_path, "a", "b")
    drain(spool, ScriptedSink(), keep_forwarded=False)
    assert states(spool) == {} and spool.pending_count == 0


class TranslatingSink(ScriptedSink):
    """Its translation raises for any batch holding one of ``poison`` (as OtlpSink's encode does)."""

    def __init__(self, *poison: str) -> None:
        super().__init__()
        self.poison = set(poison)

    async def send(self, spans: Sequence[Mapping[str, Any]]) -> SendResult:
        ids = [s["span_id"] for s in spans]
        self.sent.append(ids)
        with translating():
            if self.poison & set(ids):
                raise OverflowError("int too big to convert")
        return SendResult(delivered=ids)


def test_a_span_the_translation_cannot_take_is_isolated_and_dead_lettered_and_never_retried(tmp_path: Path) -> None:
    ids = [f"s{i}" for i in range(8)]
    spool = spool_with(tmp_path, *ids)
    sink = TranslatingSink("s5")
    metrics = Metrics()
    forwarder = drain(spool, sink, metrics, seconds=2.0)
    assert states(spool) == {**{sid: 1 for sid in ids}, "s5": 2}
    [dead] = spool.dead_letters()
    assert dead["span_id"] == "s5" and "OverflowError: int too big to convert" in dead["reason"]
    assert dead["reason"].startswith("scripted: could not translate")
    # one pass: the batch, then halves in order down to the culprit; nothing is sent again after
    assert sink.sent == [ids, ids[:4], ids[4:], ["s4", "s5"], ["s4"], ["s5"], ["s6", "s7"]]
    assert metrics.dead_lettered.labels(exporter="scripted")._value.get() == 1
    assert forwarder.last_error is None and spool.pending_count == 0


def test_isolating_stops_at_a_retryable_half_so_a_trace_still_arrives_in_order(tmp_path: Path) -> None:
    spool = spool_with(tmp_path, "a", "b", "c", "d")

    class Sink(TranslatingSink):
        async def send(self, spans: Sequence[Mapping[str, Any]]) -> SendResult:
            ids = [s["span_id"] for s in spans]
            if ids == ["a", "b"] and not self.sent.count(["a", "b"]):
                self.sent.append(ids)
                return SendResult(retryable=ids, retry_reason="503")
            return await super().send(spans)

    sink = Sink("d")
    drain(spool, sink, seconds=2.0)
    assert sink.sent[:2] == [["a", "b", "c", "d"], ["a", "b"]]  # c, d wait with the retried half
    assert states(spool) == {"a": 1, "b": 1, "c": 1, "d": 2}


def test_dead_letters_are_logged_rate_limited_and_their_reasons_scrubbed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A backend that refuses every batch (and quotes the request's credential in its answer) gives one
    log line, not one per batch; neither the line nor the stored reason holds the credential (the sink
    wrapped as the collector wraps every sink: loudness.WatchedSink scrubs what it answers)."""
    from tracecar.collector.loudness import WatchedSink

    ids = [f"s{i}" for i in range(6)]
    spool = spool_with(tmp_path, *ids)
    answer = "HTTP 400: bad request (Authorization: Bearer sk-LEAK-0123456789; api_key='sk-LEAK-2')"
    sink = ScriptedSink(*[lambda batch: SendResult(rejected={sid: answer for sid in batch})] * 6)
    metrics = Metrics()
    watched = WatchedSink(sink, metrics.backend_unreachable.labels(exporter="scripted"))
    with caplog.at_level("WARNING", logger="tracecar.collector"):
        drain(spool, watched, metrics, batch_spans=1)
    assert len(sink.sent) == 6 and states(spool) == {sid: 2 for sid in ids}
    assert metrics.dead_lettered.labels(exporter="scripted")._value.get() == 6  # every one counted
    lines = [r.getMessage() for r in caplog.records if "dead-lettered" in r.getMessage()]
    assert len(lines) == 1, lines  # six answers, one line (at most one every 30 s)
    reasons = [r["reason"] for r in spool.dead_letters()]
    assert len(reasons) == 6 and all("HTTP 400: bad request" in r for r in reasons)
    assert "sk-LEAK" not in caplog.text and not any("sk-LEAK" in r for r in reasons)


def test_every_reason_a_backend_gives_is_scrubbed_before_logs_the_store_and_readyz(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Through the collector's WatchedSink: a dead letter's reason, a retryable failure's and a partial
    refusal's all quote the credential; none of them reaches a log line, the store or /readyz's details."""
    from tracecar.collector.loudness import WatchedSink

    leak = "Authorization: Bearer sk-LEAK-42"
    spool = spool_with(tmp_path, "a", "b", "c")
    sink = ScriptedSink(lambda ids: SendResult(rejected={"a": f"400 {leak}"}, retryable=["b", "c"], retry_reason=f"503 {leak}"),
                        lambda ids: SendResult(delivered=ids, refused=1, refused_reason=f"partial: {leak}"))
    metrics = Metrics()
    watched = WatchedSink(sink, metrics.backend_unreachable.labels(exporter="scripted"))
    with caplog.at_level("WARNING", logger="tracecar.collector"):
        drain(spool, watched, metrics)
    assert states(spool) == {"a": 2, "b": 1, "c": 1}
    [reason] = [r["reason"] for r in spool.dead_letters()]
    assert reason.startswith("400 Authorization") and "sk-LEAK" not in reason
    assert "sk-LEAK" not in caplog.text and "sk-LEAK" not in str(watched.details()) and "sk-LEAK" not in str(watched.last_rejection)
    assert any("503" in r.getMessage() for r in caplog.records) and any("partial" in r.getMessage() for r in caplog.records)
