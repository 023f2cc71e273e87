"""Forward: move pending spans from the spool to the backend, oldest first, until done.

One batch is in flight at a time, so spans of a trace reach the backend in arrival order.
Transient failures (connection errors, 408/429/5xx) back off exponentially with full jitter up
to a cap, honouring Retry-After; the batch is retried as it was. Spans the backend rejects
permanently go to the dead-letter table with its reason and never block the rest. A span the
exporter itself cannot translate or serialise (its ``send`` raises a deterministic error for it)
is found by splitting the batch and dead-lettered alone, for that exporter only: an error that
would recur on every try never becomes a retry loop (:meth:`Forwarder._send_isolating`).

With several exporters there is one Forwarder each (fan-out): each reads its own delivery
cursor in the spool and has its own backoff, probe and metrics (label ``exporter``), so one
backend's outage never delays another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import orjson

from tracecar.client.tracing import MARK  # the client's place mark on a span's attributes

from ..loudness import RateLimited
from ..metrics import Metrics
from ..spool.store import Spool

log = logging.getLogger("tracecar.collector.forward")


@dataclass
class SendResult:
    """What a sink did with one batch: every span id lands in exactly one field."""

    delivered: list[str] = field(default_factory=list)
    retryable: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)  # span_id -> reason (dead-lettered)
    retry_after: float | None = None  # seconds, the largest Retry-After the backend sent
    retry_reason: str | None = None  # the last retryable failure, for logs (never holds secrets)
    refused: int = 0  # spans the backend said it refused without naming them (OTLP partial_success)
    refused_reason: str | None = None


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


def combined(a: SendResult, b: SendResult) -> SendResult:
    """Two partial results as one: ids joined, counts added, the largest Retry-After, the latest reason."""
    retry_after = b.retry_after if a.retry_after is None else a.retry_after if b.retry_after is None \
        else max(a.retry_after, b.retry_after)
    return SendResult(delivered=a.delivered + b.delivered, retryable=a.retryable + b.retryable,
                      rejected={**a.rejected, **b.rejected}, retry_after=retry_after,
                      retry_reason=b.retry_reason or a.retry_reason, refused=a.refused + b.refused,
                      refused_reason=b.refused_reason or a.refused_reason)


class TranslationError(Exception):
    """A sink's translation or serialisation of the spans it was given raised (see :func:`translating`):
    deterministic, the same spans would raise on every retry, so the forwarder isolates the span."""


MAX_REASON_CHARS = 300


@contextlib.contextmanager
def translating() -> Iterator[None]:
    """Wraps a sink's pure data work (spans to request bodies): anything raised there becomes a
    :class:`TranslationError`, which :meth:`Forwarder._send_isolating` narrows down to one span."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - pure data work: whatever it raises recurs on a retry
        raise TranslationError(f"{type(exc).__name__}: {exc}") from exc


def span_error_reason(exporter: str, exc: BaseException) -> str:
    """The dead letter's reason for a span the exporter could not translate (type and message, cut)."""
    return f"{exporter}: could not translate or serialise this span: {exc}"[:MAX_REASON_CHARS]


class SpoolTrajectories:
    """What a sink may ask the spool about trajectories (reads only, on the read connection)."""

    def __init__(self, spool: Spool, exporter: str | None = None) -> None:
        self.spool = spool
        self.exporter = exporter  # whose dead letters are not calls (with fan-out, others may have taken them)

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
                "AND kind != 'annotation' AND (parent_id IS NULL OR parent_id = ?) AND NOT EXISTS "
                "(SELECT 1 FROM dead_letters d WHERE d.span_id = spans.span_id AND d.exporter = ?) ORDER BY seq",
                (trace_id, trace_id, self.exporter or ""))
            root = next((r for r in rows if r["parent_id"] is None), None)
            if root is not None and root["kind"] != "trajectory":
                out[trace_id] = [root["span_id"]]
            else:
                out[trace_id] = [r["span_id"] for r in rows if r["parent_id"] is not None and r["kind"] == "op"]
        return out


    def marks(self, span_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The place marks (``attributes.tracecar``) of stored spans: where a joined engine span goes in Weave."""
        out: dict[str, dict[str, Any]] = {}
        for i in range(0, len(span_ids), 500):
            chunk = span_ids[i:i + 500]
            for r in self.spool.query(f"SELECT span_id, payload FROM spans WHERE span_id IN ({','.join('?' * len(chunk))})",
                                      chunk):
                try:
                    mark = (orjson.loads(r["payload"]).get("attributes") or {}).get(MARK)
                except (orjson.JSONDecodeError, AttributeError):
                    continue
                if isinstance(mark, dict):
                    out[r["span_id"]] = mark
        return out


class Sink(Protocol):
    name: str

    async def send(self, spans: Sequence[Mapping[str, Any]]) -> Any: ...

    async def aclose(self) -> None: ...


class Forwarder:
    """Background task draining the spool into a sink.

    Two rules keep delivery exact within one collector life: a batch the backend answered is
    never sent again (if recording the answer fails, e.g. on a full disk, the forwarder retries
    the record, not the send), and while ``urgent()`` holds (the spool is at its bound, ingest
    answers 503) a failing backend is probed with a one-span batch every ``probe_s`` instead
    of waiting out the backoff, so forwarding resumes within about ``probe_s`` of its return.
    """

    def __init__(self, spool: Spool, sink: Sink, metrics: Metrics, *, batch_spans: int,
                 retry_initial_s: float, retry_max_s: float, keep_forwarded: bool,
                 probe_s: float = 1.0, urgent: Callable[[], bool] | None = None) -> None:
        self.spool = spool
        self.sink = sink
        self.metrics = metrics
        self.batch_spans = batch_spans
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.keep_forwarded = keep_forwarded
        self.probe_s = probe_s
        self.urgent = urgent or (lambda: False)
        self.name: str = sink.name  # the exporter: its spool cursor and its metrics label
        self._refusals = RateLimited(30.0)
        self._span_errors = RateLimited(30.0)
        self._dead_letters = RateLimited(30.0)
        self._dead_since = 0  # spans dead-lettered since the last line about them
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self.backoff_s = 0.0
        self.last_error: str | None = None
        self.last_send_s = 0.0  # how long the last delivered batch took (drain planning)
        # answers the backend gave that the spool has not recorded yet: (kind, rows), retried
        # before anything else is sent, so a delivered batch is never sent again in this life
        self._unrecorded: list[tuple[str, Any]] = []
        self._probing = False

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
            if self._unrecorded and not await self._record_pending_answers():
                ok, retry_after = False, None
            else:
                limit = 1 if self._probing else self.batch_spans
                try:
                    rows = await asyncio.to_thread(self.spool.next_pending, limit, self.name)
                except Exception as exc:  # noqa: BLE001 - e.g. SQLite on a full disk: never end forwarding for good
                    log.warning("forward to %s: reading the spool failed (%s: %s); retrying after backoff",
                                self.name, type(exc).__name__, exc)
                    self.metrics.forward_failures.labels(exporter=self.name, kind="internal_error").inc()
                    self.last_error = f"reading the spool failed: {type(exc).__name__}"
                    rows, ok, retry_after = None, False, None
                if rows is not None and not rows:
                    if deadline is not None:
                        return
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                    except asyncio.TimeoutError:
                        pass
                    continue
                if rows is not None:
                    try:
                        ok, retry_after = await self._forward(rows)
                    except Exception as exc:  # noqa: BLE001 - one failing batch must not end forwarding for good
                        log.exception("forward: batch failed; retrying after backoff")
                        self.metrics.forward_failures.labels(exporter=self.name, kind="internal_error").inc()
                        self.last_error = f"internal error: {type(exc).__name__}"
                        ok, retry_after = False, None
            if ok:
                delay, self.backoff_s, self._probing = self.retry_initial_s, 0.0, False
                continue
            wait = retry_after if retry_after is not None else random.uniform(0, delay)
            if self._unrecorded:  # a local record to retry, not the backend: no backoff beyond the probe
                wait = min(wait, self.probe_s)
            self.backoff_s = wait = min(wait, self.retry_max_s)
            delay = min(delay * 2, self.retry_max_s)
            if deadline is None:
                await self._back_off(wait)
            else:
                await asyncio.sleep(max(0.0, min(wait, deadline - loop.time())))

    async def _back_off(self, wait: float) -> None:
        """Sleeps ``wait`` unless stopped; while urgent, cut to ``probe_s`` and probe with one span.

        Ingest never cuts a backoff short (only stop() or a full spool does).
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        end = started + wait
        while (left := end - loop.time()) > 0:
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=min(left, self.probe_s))
                return
            except asyncio.TimeoutError:
                pass
            if self.urgent() and loop.time() - started >= self.probe_s - 1e-3:
                if not self._probing:
                    log.info("forward to %s: spool at its bound and the backend failing; probing every %.1fs", self.name, self.probe_s)
                self._probing = True
                self.metrics.forward_probes.labels(exporter=self.name).inc()
                return

    async def _record_pending_answers(self) -> bool:
        """Records answers the spool could not take before; True when none is left."""
        while self._unrecorded:
            kind, rows = self._unrecorded[0]
            try:
                await self._write_answer(kind, rows)
            except Exception as exc:  # noqa: BLE001 - e.g. the disk is still full
                self.metrics.forward_failures.labels(exporter=self.name, kind="record_failed").inc()
                self.last_error = f"recording a delivered batch failed: {type(exc).__name__}: {exc}"
                return False
            self._unrecorded.pop(0)
        return True

    async def _write_answer(self, kind: str, rows: Any) -> None:
        if kind == "forwarded":
            await asyncio.to_thread(self.spool.mark_forwarded, rows, self.keep_forwarded, self.name)
        else:
            await asyncio.to_thread(self.spool.mark_dead, rows, self.name, self.keep_forwarded)

    async def _record(self, kind: str, rows: Any) -> None:
        try:
            await self._write_answer(kind, rows)
        except Exception as exc:  # noqa: BLE001 - the backend has them: record later, never resend
            log.warning("forward: the backend answered but recording it failed (%s); retrying the record, not the send",
                        type(exc).__name__)
            self.metrics.forward_failures.labels(exporter=self.name, kind="record_failed").inc()
            self._unrecorded.append((kind, rows))

    async def _forward(self, rows: list[tuple[int, bytes, int | None, int | None]]) -> tuple[bool, float | None]:
        spans = [span_from_row(payload, inputs_at, output_at) for _, payload, inputs_at, output_at in rows]
        seq_of = {span["span_id"]: row[0] for row, span in zip(rows, spans)}
        sent_at = asyncio.get_running_loop().time()
        try:
            result = await self._send_isolating(spans)
        except Exception as exc:  # noqa: BLE001 - a sink bug must not kill forwarding
            log.exception("forward: sink raised")
            self.metrics.forward_failures.labels(exporter=self.name, kind="sink_error").inc()
            self.last_error = f"sink error: {type(exc).__name__}"
            return False, None
        delivered = [seq_of[sid] for sid in result.delivered if sid in seq_of]
        if delivered:
            self.last_send_s = asyncio.get_running_loop().time() - sent_at
            self.metrics.forwarded.labels(backend=self.name, exporter=self.name).inc(len(delivered))
        if delivered:
            await self._record("forwarded", delivered)
        if result.rejected:
            by_id = {s["span_id"]: s for s in spans}
            # reasons arrive scrubbed: the collector wraps every sink in loudness.WatchedSink, which scrubs each
            # reason a backend gives before anything logs, stores or shows it
            dead = [
                (seq_of[sid], sid, by_id[sid].get("trace_id", ""), by_id[sid].get("name", ""), reason)
                for sid, reason in result.rejected.items() if sid in seq_of
            ]
            self.metrics.dead_lettered.labels(exporter=self.name).inc(len(dead))
            self._dead_since += len(dead)
            answers = self._dead_letters.hit() if dead else None
            if answers is not None:
                lettered, self._dead_since = self._dead_since, 0
                log.warning("forward to %s: %d span(s) dead-lettered in %d answer(s) since the last line (latest: %s); "
                            "`tracecar dead-letters` lists them, and this is logged at most once every %g s",
                            self.name, lettered, answers, dead[-1][4], self._dead_letters.interval_s,
                            extra={"event": "forward_dead_lettered", "exporter": self.name})
            await self._record("dead", dead)
        if result.refused:
            self._count_refused(result.refused, result.refused_reason)
        if self._unrecorded:
            return False, None
        if result.retryable:
            self.metrics.forward_failures.labels(exporter=self.name, kind="retryable").inc()
            self.last_error = result.retry_reason or "retryable failure"
            return False, result.retry_after
        self.last_error = None
        return True, None


    async def _send_isolating(self, spans: Sequence[Mapping[str, Any]]) -> SendResult:
        """``sink.send``, with a span whose translation raises isolated and dead-lettered alone.

        A :class:`TranslationError` (raised by the sink's pure data work) for a batch splits it in
        halves, sent in order, down to the span that raises: that one is rejected with the
        error as its reason, the others go as usual (a retryable half stops the rest, which is
        retried with it, so a trace still arrives in order). ``log2(batch)`` extra requests for
        one bad span, none when nothing raises.
        """
        try:
            return cast(SendResult, await self.sink.send(spans))
        except TranslationError as exc:  # deterministic: the same span would raise on every retry
            if len(spans) <= 1:
                if not spans:
                    return SendResult()
                reason = span_error_reason(self.name, exc)
                count = self._span_errors.hit()
                if count is not None:
                    log.warning("forward to %s: %d span(s) could not be translated and were dead-lettered (latest: %s)",
                                self.name, count, reason, extra={"event": "forward_span_error", "exporter": self.name})
                return SendResult(rejected={str(spans[0].get("span_id")): reason})
        mid = len(spans) // 2
        first = await self._send_isolating(spans[:mid])
        if first.retryable:  # the backend is struggling: the rest waits with the retried half, in order
            rest = SendResult(retryable=[str(s.get("span_id")) for s in spans[mid:]])
            return combined(first, rest)
        return combined(first, await self._send_isolating(spans[mid:]))

    def _count_refused(self, n: int, reason: str | None) -> None:
        """A backend that refused spans without naming them: counted, logged at most every 30 s."""
        self.metrics.partial_rejected.labels(exporter=self.name).inc(n)
        count = self._refusals.hit()
        if count is not None:
            log.warning("forward to %s: the backend refused spans in %d answer(s) (partial success; latest: %s); "
                        "further refusals are logged at most once every %g s", self.name, count, reason or "no reason given",
                        self._refusals.interval_s,
                        extra={"event": "forward_partial_rejected", "exporter": self.name, "rejected_spans": n})


class NullSink:
    """Local mode: spans are already in the store; nothing to forward."""

    name = "local"

    async def send(self, spans: Sequence[Mapping[str, Any]]) -> SendResult:
        return SendResult(delivered=[s["span_id"] for s in spans])

    async def aclose(self) -> None:
        return None
