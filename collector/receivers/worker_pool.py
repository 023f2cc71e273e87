"""Worker processes for the per-span CPU work, so decoding and serialising use every core.

The ingest process keeps everything that must happen once and in one place: the HTTP server,
validation of what it acknowledges, sampling and budget decisions (tail sampling needs the whole
step), the single SQLite spool writer, prompt contexts and the metrics registry. What it hands a
worker is small and cheap to move: the request body as it came (bytes), the ids of the spans
sampling kept, and for wire-version-2 spans the ids rebuilt from references as packed int64
arrays plus the earlier texts to join onto. The worker parses and validates the body again
(the same deterministic code; parsing is C, and it runs on another core), decodes with its own
tokenizer (loaded once, in the initializer) and serialises the spool payloads
(:mod:`.span_work`); it sends back bytes. Pickling the spans themselves would cost the ingest
process more than serialising them (measured in docs/performance.md).

Processes are started with ``spawn`` (the collector has threads; a forked threaded process can
deadlock). A worker that dies breaks the pool: the batches in flight are redone in the ingest
process (nothing acknowledged is lost: a batch is acknowledged only after its rows are
committed), the pool is replaced, and the failure is logged (rate-limited) and counted. A worker
never outlives the collector, however the collector ends (:mod:`tracecar.client.lifeline`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from array import array
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from tracecar.client.lifeline import die_with_parent
from tracecar.client.redact import RedactKeys

from ..loudness import describe_error
from ..processors.validate import Rejection
from ..types import Span

log = logging.getLogger("tracecar.collector.workers")

@dataclass
class WorkerConfig:
    """Settings a worker needs, fixed for its life (sent once, to the initializer)."""

    policy: Any  # decoding.TokenizerPolicy
    redact_keys: list[str]
    max_batch_spans: int
    max_decompressed_bytes: int
    max_span_bytes: int
    local_only: bool


@dataclass
class WorkOrder:
    """One batch's decode + serialise, as sent to a worker (see the module for why this shape)."""

    body: bytes | bytearray
    content_type: str | None
    content_encoding: str | None
    span_ids: list[str]  # the spans sampling kept, in order
    warnings: dict[str, list[str]]
    index_of: dict[str, int]
    tokenizer: str | None  # None: serialise only
    v: int = 1
    worker: str = ""
    count_tokens: bool = False
    rebuilt: dict[str, list[tuple[str, str, bytes]]] = field(default_factory=dict)  # span -> (part, key, int64s)
    bases: dict[Any, Any] = field(default_factory=dict)  # prompt_refs.Base by span (v2)
    contexts: dict[str, Any] = field(default_factory=dict)  # span_id -> span_work.ContextView (v2)
    remembered: set[str] = field(default_factory=set)  # spans whose texts may update their contexts (v2)
    store_refs: dict[str, list[tuple[str, str, str, int, int]]] = field(default_factory=dict)  # stored as references (v2)


@dataclass
class RowOut:
    span_id: str
    payload: bytes
    inputs_at: int | None
    output_at: int | None
    token_arrays: bytes | None
    tokens: int
    warnings: list[str] | None
    refs: list[str] | None = None  # spans the payload refers to (processors.store_refs)


@dataclass
class WorkResult:
    rows: list[RowOut] = field(default_factory=list)
    too_big: list[Rejection] = field(default_factory=list)
    warnings: dict[str, list[str]] = field(default_factory=dict)
    tokens: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    texts: list[tuple[str, str | None, str | None]] = field(default_factory=list)  # for PromptContexts.set_texts
    redo: str | None = None  # why the ingest process must do this batch itself (tokenizer_failed, mismatch)
    span_ids: list[str] = field(default_factory=list)  # finished in phase one (prepare): the spans it did
    tokenizer: str | None = None  # finished in phase one: the tokenizer its texts were decoded with


def pack_ids(ids: Any) -> bytes | None:
    """A list of ints as packed int64 (little-endian); None if it holds anything else."""
    if type(ids) is not list:
        return None
    try:
        packed = array("q", ids)
    except (TypeError, OverflowError):
        return None
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    values = array("q")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


# ---- inside a worker process --------------------------------------------------------------
class _State:
    config: WorkerConfig
    tokenizers: Any
    redact: Any
    barrier: Any


_state = _State()


def _init(config: WorkerConfig, barrier: Any, parent_pid: int) -> None:
    """Runs once per worker: tied to the collector's life first, then one tokenizer registry, the
    default tokenizer loaded up front.

    A worker whose collector is gone (SIGKILL, the OOM killer) exits at once with ``os._exit``:
    it owns nothing (the spool is the ingest process's), and an orphan would hold its memory, and
    multiprocessing's resource tracker (which exits when every holder of its pipe has), for ever.
    """
    die_with_parent(parent_pid)
    _state.barrier = barrier
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one batch per process at a time: no thread pool inside
    from tracecar.client.redact import RedactKeys

    from ..processors.decoding import TokenizerNotFound, TokenizerRegistry

    _state.config = config
    _state.redact = RedactKeys(config.redact_keys)
    _state.tokenizers = TokenizerRegistry(config.policy)
    if config.policy.default:
        try:
            _state.tokenizers.get(config.policy.default)
        except TokenizerNotFound:
            pass  # the ingest process reports it, on the first batch that needs it
    from ..heap import tune_gc

    tune_gc()  # a worker parses bodies too: the same young-collection threshold as the ingest process


def _ready() -> int:
    """A warm-up task: held until every worker holds one, so each process has started and loaded."""
    _state.barrier.wait(timeout=120)
    return os.getpid()


@dataclass
class PrepareOrder:
    """Phase one of a batch in a worker: the body as it came; the ingest process has not parsed it.

    ``complete``: nothing this batch holds can be sampled out by the ingest process (no head
    budget configured; the worker also checks the batch sends none), so a batch without prompt
    references is decoded and serialised right away, in the same task (one parse in all).
    """

    body: bytes | bytearray
    content_type: str | None
    content_encoding: str | None
    complete: bool = False
    token2text: bool = False  # the collector's TRACECAR_TOKEN2TEXT (a batch may override it)
    tokenizer: str | None = None  # the collector's TRACECAR_TOKENIZER (a batch may name another)
    count_tokens: bool = False


def parse_batch(body: bytes | bytearray, content_type: str | None, content_encoding: str | None, max_batch_spans: int,
                max_decompressed_bytes: int, redact: Any, keep_ids: bool = False) -> Any:
    """decompress → parse → the span-count bound → validate_batch: the same code wherever it runs.

    ``keep_ids``: id lists stay as received (:mod:`.raw_ids`) unless the batch asks for token2text."""
    from ..processors.validate import validate_batch
    from . import receive

    plain = receive.decompress(body, content_encoding, max_decompressed_bytes)
    raw = receive.parse(plain, content_type, receive.max_containers(max_decompressed_bytes), keep_ids=keep_ids)
    spans = raw.get("spans") if isinstance(raw, dict) else None
    if isinstance(spans, list) and len(spans) > max_batch_spans:  # a size bound, like the body's: 413, so clients split
        raise receive.BodyError(413, "spans", f"{len(spans)} spans exceed TRACECAR_MAX_BATCH_SPANS={max_batch_spans}; split the batch")
    # redaction walks the spans only when the body holds a redact key at all
    validated = validate_batch(raw, max_batch_spans, redact, plain,
                               body_is_json=not (content_type or "").lower().split(";")[0].strip().endswith("msgpack"))
    if keep_ids and validated.batch.token2text:  # this batch decodes after all: the decoder reads ints
        from .raw_ids import materialize

        materialize(validated.spans)
    return validated


#: the output fields a prompt reference reads (tracecar.client.prompt_delta: OUTPUT_REF_KEYS, CONTEXT_RESPONSE_KEYS)
_SKELETON_OUTPUT_KEYS = ("prompt_ids", "response_ids", "token_ids")


@dataclass
class PackedIds:
    """A list of plain ints as little-endian int64 bytes: what a span head carries of its ids
    (unpickling a list of ints costs the ingest process twice what unpacking these does)."""

    data: bytes

    @classmethod
    def of(cls, value: Any) -> Any:
        """``value`` packed when it is a list of plain ints, else as it is (a reference, anything odd)."""
        if type(value) is not list or not all(type(x) is int for x in value):
            return value
        packed = pack_ids(value)
        return value if packed is None else cls(packed)


def unpack_heads(spans: list[Span]) -> None:
    """The id lists of v2 span heads back as lists, in place (before prompt references resolve)."""
    for span in spans:
        for part in ("inputs", "output"):
            holder = span.get(part)
            if type(holder) is dict:
                for key, value in holder.items():
                    if type(value) is PackedIds:
                        holder[key] = unpack_ids(value.data)


def head_of(span: Span, version: int) -> Span:
    """What the ingest process reads of a span: every field but ``inputs`` and ``output`` (ids, trace
    and parent, kind, name, worker, times, exception, attributes with step, sample index,
    rollout_n, reward...), and in v2 batches the id lists prompt references resolve against
    (``inputs.prompt_ids``; ``output.prompt_ids``/``response_ids``/``token_ids``; a list kept as
    received, raw_ids.RawIds, goes as its bytes). No text, no other inputs: those stay in the
    worker, which serialises them."""
    head: dict[str, Any] = {k: v for k, v in span.items() if k != "inputs" and k != "output"}
    if version >= 2:
        inputs, output = span.get("inputs"), span.get("output")
        head["inputs"] = ({"prompt_ids": PackedIds.of(inputs["prompt_ids"])} if type(inputs) is dict and "prompt_ids" in inputs
                          else None)
        head["output"] = ({k: PackedIds.of(output[k]) for k in _SKELETON_OUTPUT_KEYS if k in output} if type(output) is dict
                          else None)
    return head  # type: ignore[return-value]


def prepare(order: PrepareOrder) -> Any:
    """Parse and validate one batch (in a worker process): (the Validated with each span reduced
    to :func:`head_of`, the finished batch or None), or None where the body is refused (the
    ingest process then parses it itself, so its error answer is exactly the single-process one).

    The batch is finished here too (decoded, serialised: a :class:`WorkResult`) when
    ``order.complete`` and it holds no prompt reference and its tokenizer loads; else the ingest
    process resolves references, samples, and sends phase two (:func:`work`).
    """
    cfg = _state.config
    try:
        validated = parse_batch(order.body, order.content_type, order.content_encoding, cfg.max_batch_spans,
                                cfg.max_decompressed_bytes, _state.redact, keep_ids=not order.token2text)
    except Exception:  # noqa: BLE001 - a refused body: answered by the ingest process's own parse
        return None
    v = validated.batch.v
    heads = [head_of(s, v) for s in validated.spans]
    done = _finish(order, validated) if order.complete else None
    validated.spans = heads
    validated.batch.spans = []  # the raw items, read by validation only: never pickled back whole
    return validated, done


def _finish(order: PrepareOrder, validated: Any) -> WorkResult | None:
    """Decode and serialise a batch sampling cannot thin (see :func:`prepare`), or None."""
    from tracecar.client.prompt_delta import OUTPUT_REF_KEYS, as_ids

    from ..processors.decoding import TokenizerNotFound, decode_spans
    from ..processors.open_calls import OPEN_KIND
    from ..processors.prompt_refs import Context, is_ref
    from ..processors.sampling.head import MEMBERSHIP
    from ..processors.span_work import ContextView, decode_v2, serialize_spans

    batch = validated.batch
    if batch.max_samples_per_step_per_worker is not None:
        return None
    spans = [s for s in validated.spans if s["kind"] != MEMBERSHIP and s["kind"] != OPEN_KIND]
    for span in spans:  # a reference resolves against the ingest process's contexts: phase two
        inputs, output = span.get("inputs"), span.get("output")
        if type(inputs) is dict and is_ref(inputs.get("prompt_ids")):
            return None
        if type(output) is dict and any(is_ref(output.get(k)) for k in OUTPUT_REF_KEYS):
            return None
    token2text = order.token2text if batch.token2text is None else batch.token2text
    name = batch.tokenizer or order.tokenizer
    if token2text and spans and name is None:  # said and counted by the ingest process (phase two)
        return None
    warnings = {sid: list(notes) for sid, notes in validated.warnings.items()}
    ends: dict[str, list[int]] = {}
    result = WorkResult(warnings=warnings)
    if token2text and spans and name is not None:
        try:
            tokenizer = _state.tokenizers.get(name)
        except TokenizerNotFound:
            return None  # refused, counted and logged by the ingest process, as without workers
        if batch.v < 2:
            result.tokens = decode_spans(spans, tokenizer, warnings, pieces=ends)
        else:  # no references: each span's context is new; its texts go back for the next turns
            views: dict[str, ContextView] = {}
            for span in spans:
                inputs = span.get("inputs")
                ids = as_ids(inputs.get("prompt_ids")) if type(inputs) is dict else None
                if ids is not None:
                    views[span["span_id"]] = ContextView.of(Context.of(ids, span.get("output")))
            result.tokens = decode_v2(spans, batch.worker, {}, tokenizer, name, warnings, ends,
                                      lambda worker, span_id: views.get(span_id),
                                      lambda worker, span_id, text, response, tok: result.texts.append((span_id, text, response)),
                                      result.outcomes)
    rows, result.too_big = serialize_spans(spans, warnings, validated.index_of, ends, max_span_bytes=_state.config.max_span_bytes,
                                           count_tokens=order.count_tokens, local_only=_state.config.local_only)
    result.rows = [RowOut(r.span["span_id"], r.payload, r.inputs_at, r.output_at, r.token_arrays, r.tokens, r.warnings)
                   for r in rows]
    result.span_ids = [s["span_id"] for s in spans]
    result.tokenizer = name if token2text else None
    return result


def work(order: WorkOrder) -> WorkResult:
    """Parse, validate, decode and serialise one batch (in a worker process)."""
    from ..processors.decoding import TokenizerNotFound, decode_spans
    from ..processors.span_work import decode_v2, serialize_spans

    cfg = _state.config
    validated = parse_batch(order.body, order.content_type, order.content_encoding, cfg.max_batch_spans,
                            cfg.max_decompressed_bytes, _state.redact, keep_ids=order.tokenizer is None)
    by_id = {s["span_id"]: s for s in validated.spans}
    spans: list[Span] = []
    for sid in order.span_ids:
        span = by_id.get(sid)
        if span is None:
            return WorkResult(redo="mismatch")
        for part, key, packed in order.rebuilt.get(sid, ()):
            holder = span.get(part)
            if type(holder) is not dict:
                return WorkResult(redo="mismatch")
            holder[key] = unpack_ids(packed)
        spans.append(span)
    warnings = order.warnings
    ends: dict[str, list[int]] = {}
    result = WorkResult(warnings=warnings)
    if order.tokenizer is not None:
        try:
            tokenizer = _state.tokenizers.get(order.tokenizer)
        except TokenizerNotFound:
            return WorkResult(redo="tokenizer_failed")
        if order.v < 2:
            result.tokens = decode_spans(spans, tokenizer, warnings, pieces=ends)
        else:
            views = order.contexts

            def set_texts(worker: str, span_id: str, text: str | None, response: str | None, name: str) -> None:
                if span_id not in order.remembered:  # a resend: its context is the first copy's
                    return
                view = views.get(span_id)
                if view is not None:  # later rounds of this batch join onto it
                    view.text, view.response_text, view.tokenizer = text, response, name
                result.texts.append((span_id, text, response))

            result.tokens = decode_v2(spans, order.worker, order.bases, tokenizer, order.tokenizer, warnings, ends,
                                      lambda worker, span_id: views.get(span_id), set_texts, result.outcomes)
    views = order.contexts
    rows, result.too_big = serialize_spans(spans, warnings, order.index_of, ends, max_span_bytes=cfg.max_span_bytes,
                                           count_tokens=order.count_tokens, local_only=cfg.local_only,
                                           store_refs=order.store_refs, view=views.get)
    result.rows = [RowOut(r.span["span_id"], r.payload, r.inputs_at, r.output_at, r.token_arrays, r.tokens, r.warnings, r.refs)
                   for r in rows]
    return result


# ---- in the ingest process ------------------------------------------------------------------
class WorkerPool:
    """``processes`` spawned workers; started in the background, replaced when one dies.

    :meth:`run` answers None whenever the pool cannot do a batch (not started yet, warming up,
    broken): the caller then does it in-process, so the pool is only ever a speed-up.
    """

    LOG_EVERY_S = 60.0
    MAX_START_FAILURES = 3
    LIVENESS_CHECK_S = 1.0
    CLOSE_POLL_S = 0.2

    def __init__(self, processes: int, config: WorkerConfig, metrics: Any) -> None:
        self.processes = processes
        self.config = config
        self.metrics = metrics
        self._ctx = multiprocessing.get_context("spawn")
        self._pool: ProcessPoolExecutor | None = None
        self._ready = False
        self._closed = False
        self._lock = threading.RLock()  # a done callback may run inside _start_locked
        self._logged_at = 0.0
        self._unlogged = 0
        self._start_failures = 0
        self.pids: list[int] = []
        self._redact = RedactKeys(config.redact_keys)  # a worker's error may quote a span's value
        metrics.workers.set_function(lambda: len(set(self.pids)) if self.ready else 0)

    @property
    def ready(self) -> bool:
        return self._ready and not self._closed

    @property
    def usable(self) -> bool:
        """Worth building a work order for: warm, or not started yet (the order's batch starts it)."""
        return not self._closed and (self._ready or self._pool is None)

    def start(self) -> None:
        """Spawns the workers without waiting for them; batches go in-process until they are warm."""
        with self._lock:
            if self._pool is None and not self._closed:
                self._start_locked()

    def _start_locked(self) -> None:
        barrier = self._ctx.Barrier(self.processes)
        pool = ProcessPoolExecutor(self.processes, mp_context=self._ctx, initializer=_init,
                                   initargs=(self.config, barrier, os.getpid()))
        self._pool, self._ready, self.pids = pool, False, []
        warm = [pool.submit(_ready) for _ in range(self.processes)]
        pending = [len(warm)]
        failed = [False]

        def done(future: Future[int]) -> None:
            with self._lock:
                if self._pool is not pool:
                    return
                pending[0] -= 1
                if future.cancelled() or future.exception() is not None:
                    failed[0] = True
                else:
                    self.pids.append(future.result())
                if pending[0] == 0 and not failed[0]:
                    self._ready, self._start_failures = True, 0
                    return
                if pending[0] > 0:
                    return
            self._failed(pool, "start")  # outside the lock: it takes it

        for future in warm:
            future.add_done_callback(done)

    async def run(self, order: WorkOrder) -> WorkResult | None:
        """The batch done by a worker, or None: do it in-process (see the class)."""
        return await self.call(work, order)

    async def call(self, fn: Any, order: Any) -> Any:
        """``fn(order)`` in a worker, or None when the pool cannot (not warm, broken, a bug).

        While it waits it checks, every ``LIVENESS_CHECK_S``, that the pool's processes are alive:
        a worker killed while it wrote a result into the pipe (the OOM killer's usual moment: the
        result is the batch's payloads) leaves ``ProcessPoolExecutor`` reading the rest of that
        message for ever, so neither this batch nor any later one would ever finish or fail.
        """
        pool = self._pool
        if pool is None or not self.ready:
            return None
        try:
            waiting = asyncio.wrap_future(pool.submit(fn, order))
            while True:
                done, _ = await asyncio.wait((waiting,), timeout=self.LIVENESS_CHECK_S)
                if done:
                    return waiting.result()
                if self._pool is not pool:  # replaced meanwhile (another batch saw it die): redo in-process
                    waiting.cancel()
                    return None
                if _has_dead_process(pool):
                    waiting.cancel()  # abandoned: the batch is redone in-process
                    self._failed(pool, "died")
                    return None
        except BrokenProcessPool:
            self._failed(pool, "died")
        except Exception as exc:  # noqa: BLE001 - a bug in the worker must not cost the batch
            if self._closed or self._pool is not pool:  # submitted while it shut down or was replaced
                return None
            self.metrics.worker_failures.labels(kind="error").inc()
            self._log("a worker failed a batch; it is done in the ingest process", exc)
        return None

    def _failed(self, pool: ProcessPoolExecutor, kind: str) -> None:
        with self._lock:
            if self._pool is not pool or self._closed:
                return  # another batch on the same pool already replaced it
            self.metrics.worker_failures.labels(kind=kind).inc()
            self._ready = False
            handles = _PoolHandles(pool) if kind == "died" else None
            pool.shutdown(wait=False, cancel_futures=True)
            if handles is not None:
                handles.release()
            self._start_failures += kind == "start"
            if self._start_failures >= self.MAX_START_FAILURES:  # e.g. workers cannot even start here
                self._pool = None
                self._closed = True
                log.error("worker processes failed to start %d times in a row; decoding stays in the ingest process",
                          self._start_failures, extra={"event": "workers_disabled"})
                return
            self._start_locked()
        self._log("a worker process died; its batches are redone in the ingest process and the pool is restarted"
                  if kind == "died" else "the worker processes failed to start; the pool is restarted", None)

    def _log(self, message: str, exc: BaseException | None) -> None:
        now = time.monotonic()
        self._unlogged += 1
        if now - self._logged_at < self.LOG_EVERY_S:
            return
        count, self._unlogged, self._logged_at = self._unlogged, 0, now
        log.error(message, extra={"event": "worker_failed", "failures_since_last_log": count,
                                  "error": None if exc is None else describe_error(exc, 500, self._redact)})

    def close(self) -> None:
        """After the drain: waits for the batches in flight, then stops the workers."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            handles = _PoolHandles(pool)
            pool.shutdown(wait=False, cancel_futures=True)
            handles.wait_stopped(self.CLOSE_POLL_S)  # shutdown(wait=True), but not for ever (see _PoolHandles)


# ---- a pool whose worker died mid-write -------------------------------------------------------
class _PoolHandles:
    """A pool's processes, result pipe and executor thread, read before ``shutdown`` drops them.

    A worker killed while it writes a result (the OOM killer's likely moment: the result is the
    batch's payloads) leaves the executor's thread reading the rest of that message for ever, and
    another worker waiting for ever on the pipe's lock the dead one held. :meth:`release` ends
    that: the pool's other workers are killed and this process's end of the result pipe closed,
    so the read ends (EOF) and the executor fails what it still holds and cleans up.
    """

    def __init__(self, pool: ProcessPoolExecutor) -> None:
        self.processes = list((getattr(pool, "_processes", None) or {}).values())
        self.results = getattr(pool, "_result_queue", None)
        self.manager: threading.Thread | None = getattr(pool, "_executor_manager_thread", None)

    def any_dead(self) -> bool:
        """Whether a process has exited (its sentinel is readable: no reaping, no race with the executor)."""
        try:
            sentinels = [p.sentinel for p in self.processes]
        except (ValueError, AttributeError):  # a process object already closed: the executor handles it
            return False
        return bool(sentinels) and bool(multiprocessing.connection.wait(sentinels, timeout=0))

    def release(self) -> None:
        for process in self.processes:
            try:
                process.kill()
            except (OSError, ValueError, AttributeError):  # gone already
                pass
        writer = getattr(self.results, "_writer", None)
        if writer is not None:
            try:
                writer.close()
            except OSError:
                pass

    def wait_stopped(self, poll_s: float) -> None:
        """Waits for the executor's thread (after ``shutdown(wait=False)``), releasing it if a worker died."""
        manager = self.manager
        while manager is not None and manager.is_alive():
            manager.join(poll_s)
            if manager.is_alive() and self.any_dead():
                self.release()


def _has_dead_process(pool: ProcessPoolExecutor) -> bool:
    return _PoolHandles(pool).any_dead()
