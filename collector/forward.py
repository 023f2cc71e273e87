"""Forward: move pending spans from the spool to the backend, oldest first, until done.

One batch is in flight at a time, so spans of a trace reach the backend in arrival order.
Transient failures (connection errors, 408/429/5xx) back off exponentially with full jitter up
to a cap, honouring Retry-After; the batch is retried as it was. Spans the backend rejects
permanently go to the dead-letter table with its reason and never block the rest.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from .metrics import Metrics
from .spool import Spool

log = logging.getLogger("tracecar.collector.forward")


@dataclass
class SendResult:
    """What a sink did with one batch: every span id lands in exactly one field."""

    delivered: list[str] = field(default_factory=list)
    retryable: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)  # span_id -> reason (dead-lettered)
    retry_after: float | None = None  # seconds, the largest Retry-After the backend sent
    retry_reason: str | None = None  # the last retryable failure, for logs (never holds secrets)


class RawJSON(bytes):
    """A JSON value serialised at ingest, handed to the sink as bytes to splice, never re-parsed."""

    def parse(self) -> Any:
        return orjson.loads(bytes(self))


def span_from_row(payload: bytes, inputs_at: int | None, output_at: int | None) -> dict[str, Any]:
    """A spooled span for the sink: its small head parsed, inputs/output kept as raw JSON.

    Payloads without offsets (rewritten by a tail-based decision, or from an older spool) are
    parsed whole.
    """
    if inputs_at is None or output_at is None:
        return orjson.loads(payload)
    view = memoryview(payload)
    head_end = inputs_at - len(b',"inputs":')
    span = orjson.loads(bytes(view[:head_end]) + b"}")
    span["inputs"] = RawJSON(view[inputs_at:output_at - len(b',"output":')])
    span["output"] = RawJSON(view[output_at:-1])
    return span


class SpoolTrajectories:
    """What a sink may ask the spool about trajectories (reads only, on the read connection)."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool

    def kept_because(self, trace_ids: list[str]) -> dict[str, str]:
        """The rule that kept each tail-decided trajectory (its ``trajectory_decisions`` row)."""
        out: dict[str, str] = {}
        for i in range(0, len(trace_ids), 500):
            chunk = trace_ids[i:i + 500]
            rows = self.spool.query(
                f"SELECT trace_id, rule FROM trajectory_decisions WHERE keep = 1 AND rule IS NOT NULL "
                f"AND trace_id IN ({','.join('?' * len(chunk))})", chunk)
            out.update((r["trace_id"], r["rule"]) for r in rows)
        return out

    def top_calls(self, trace_ids: list[str]) -> dict[str, list[str]]:
        """Span ids of each trace's top-level calls: the children of a trajectory root, or an
        op root itself. Dead-lettered spans are not calls in the backend, so they are left out."""
        out: dict[str, list[str]] = {}
        for trace_id in trace_ids:
            rows = self.spool.query(
                "SELECT span_id, parent_id, kind FROM spans WHERE trace_id = ? AND state != 2 "
                "AND kind != 'annotation' AND (parent_id IS NULL OR parent_id = ?) ORDER BY seq", (trace_id, trace_id))
            root = next((r for r in rows if r["parent_id"] is None), None)
            if root is not None and root["kind"] != "trajectory":
                out[trace_id] = [root["span_id"]]
            else:
                out[trace_id] = [r["span_id"] for r in rows if r["parent_id"] is not None and r["kind"] == "op"]
        return out


class Sink(Protocol):
    name: str

    async def send(self, spans: Sequence[Mapping[str, Any]]) -> Any: ...

    async def aclose(self) -> None: ...


class Forwarder:
    """Background task draining the spool into a sink."""

    def __init__(self, spool: Spool, sink: Sink, metrics: Metrics, *, batch_spans: int,
                 retry_initial_s: float, retry_max_s: float, keep_forwarded: bool) -> None:
        self.spool = spool
        self.sink = sink
        self.metrics = metrics
        self.batch_spans = batch_spans
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.keep_forwarded = keep_forwarded
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self.backoff_s = 0.0
        self.last_error: str | None = None
        self.last_send_s = 0.0  # how long the last delivered batch took (drain planning)

    def notify(self) -> None:
        """Called after each committed ingest so new spans go out without polling delay."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    async def run(self, deadline: float | None = None) -> None:
        """Forwards until stopped (or, with ``deadline``, until drained or the loop time passes it)."""
        loop = asyncio.get_running_loop()
        delay = self.retry_initial_s
        while not self._stop.is_set() or deadline is not None:
            # draining: start no batch that would likely be cut at the deadline (and sent twice)
            if deadline is not None and loop.time() + self.last_send_s >= deadline:
                return
            rows = await asyncio.to_thread(self.spool.next_pending, self.batch_spans)
            if not rows:
                if deadline is not None:
                    return
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                ok, retry_after = await self._forward(rows)
            except Exception as exc:  # noqa: BLE001 - one failing batch must not end forwarding for good
                log.exception("forward: batch failed; retrying after backoff")
                self.metrics.forward_failures.labels(kind="internal_error").inc()
                self.last_error = f"internal error: {type(exc).__name__}"
                ok, retry_after = False, None
            if ok:
                delay, self.backoff_s = self.retry_initial_s, 0.0
                continue
            wait = retry_after if retry_after is not None else random.uniform(0, delay)
            self.backoff_s = wait = min(wait, self.retry_max_s)
            delay = min(delay * 2, self.retry_max_s)
            if deadline is None:
                try:  # ingest must not cut a backoff short; only stop() does
                    await asyncio.wait_for(self._stop.wait(), timeout=wait)
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(max(0.0, min(wait, deadline - loop.time())))

    async def _forward(self, rows: list[tuple[int, bytes, int | None, int | None]]) -> tuple[bool, float | None]:
        spans = [span_from_row(payload, inputs_at, output_at) for _, payload, inputs_at, output_at in rows]
        seq_of = {span["span_id"]: row[0] for row, span in zip(rows, spans)}
        sent_at = asyncio.get_running_loop().time()
        try:
            result = await self.sink.send(spans)
        except Exception as exc:  # noqa: BLE001 - a sink bug must not kill forwarding
            log.exception("forward: sink raised")
            self.metrics.forward_failures.labels(kind="sink_error").inc()
            self.last_error = f"sink error: {type(exc).__name__}"
            return False, None
        delivered = [seq_of[sid] for sid in result.delivered if sid in seq_of]
        if delivered:
            self.last_send_s = asyncio.get_running_loop().time() - sent_at
            await asyncio.to_thread(self.spool.mark_forwarded, delivered, self.keep_forwarded)
            self.metrics.forwarded.labels(backend=self.sink.name).inc(len(delivered))
        if result.rejected:
            by_id = {s["span_id"]: s for s in spans}
            dead = [
                (seq_of[sid], sid, by_id[sid].get("trace_id", ""), by_id[sid].get("name", ""), reason)
                for sid, reason in result.rejected.items() if sid in seq_of
            ]
            await asyncio.to_thread(self.spool.mark_dead, dead)
            self.metrics.dead_lettered.inc(len(dead))
            log.warning("forward: %d spans dead-lettered: %s", len(dead), next(iter(result.rejected.values())))
        if result.retryable:
            self.metrics.forward_failures.labels(kind="retryable").inc()
            self.last_error = result.retry_reason or "retryable failure"
            return False, result.retry_after
        self.last_error = None
        return True, None


class NullSink:
    """Local mode: spans are already in the store; nothing to forward."""

    name = "local"

    async def send(self, spans: Sequence[Mapping[str, Any]]) -> SendResult:
        return SendResult(delivered=[s["span_id"] for s in spans])

    async def aclose(self) -> None:
        return None
