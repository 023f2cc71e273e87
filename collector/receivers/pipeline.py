"""The ingest pipeline: receive → validate → sample → decode → spool. Forwarding runs apart.

CPU stages run in worker threads so the event loop keeps answering health checks; the sampling
step runs on the loop itself (pure dict work) so decisions never race. A request is answered
only after its spans are committed to the spool. Under a tail-based budget the spans it claims
are routed (held / pass / drop) on the spool's writer thread, where its step decisions also run
(tracecar.collector.processors.sampling); with no budget none of that is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from tracecar.client.redact import RedactKeys

from ..heap import HEAP
from ..loudness import BackgroundFailures, TokenizerFailures
from ..metrics import Metrics
from ..processors.decoding import TokenizerNotFound, TokenizerPolicy, TokenizerRegistry, decode_spans
from ..processors.open_calls import OPEN_KIND, OpenCalls
from ..processors.prompt_refs import PromptContexts, max_rebuilt_ids, resolve_refs
from ..processors.sampling import Policies, TailSelector
from ..processors.sampling.candidates import LEARNED_FILE, load_learned, save_learned
from ..processors.sampling.head import MEMBERSHIP, StepBudgetSampler
from ..processors.span_work import ContextView, PayloadError, decode_v2, pack_payload, serialize_spans
from ..processors.store_refs import StoreRefs, referenced, refs_stored
from ..processors.validate import Rejection, Validated, parents_to_look_up, reject_foreign_children
from ..settings import CollectorSettings
from ..spool.store import Spool, SpoolFull, SpoolRow
from ..types import Span
from .client_drops import ClientDrops, parse_dropped
from .engine_hold import EngineHold
from .forwarded import ForwardedBatch
from .joins import TrajectoryContexts, request_id_of
from .worker_pool import (
    PrepareOrder,
    WorkerConfig,
    WorkerPool,
    WorkOrder,
    WorkResult,
    pack_ids,
    parse_batch,
    prepare,
    unpack_heads,
)

#: the batch versions /v1/spans reads; a client sends prompt references only when 2 is listed, short ids when 3 is
WIRE_VERSIONS = (1, 2, 3)
__all__ = ["Backpressure", "IngestPipeline", "IngestResult", "PayloadError", "WIRE_VERSIONS", "pack_payload"]
log = logging.getLogger("tracecar.collector.pipeline")


# body, Content-Type, Content-Encoding -> validated spans; runs in a worker thread
Receiver = Callable[[bytes | bytearray, str | None, str | None], Validated]


class Backpressure(Exception):
    """A bound is hit: answer 503 with Retry-After; nothing of the request is stored."""

    def __init__(self, bound: str, message: str) -> None:
        super().__init__(message)
        self.bound = bound


@dataclass
class IngestResult:
    accepted: int = 0
    duplicates: int = 0
    sampled_out: int = 0
    rejected: list[Rejection] = field(default_factory=list)
    warnings: dict[str, list[str]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted, "duplicates": self.duplicates, "sampled_out": self.sampled_out,
            "rejected_count": len(self.rejected), "rejected": [r.as_dict() for r in self.rejected],
            "warnings": self.warnings,
            "wire_versions": list(WIRE_VERSIONS),
        }


class IngestPipeline:
    def __init__(self, settings: CollectorSettings, spool: Spool, metrics: Metrics) -> None:
        self.settings = settings
        self.spool = spool
        self.metrics = metrics
        self.tokenizers = TokenizerRegistry(
            TokenizerPolicy.from_settings(settings),
            on_failure=self._tokenizer_failed,
        )
        self.contexts = TrajectoryContexts(spool, settings.otlp_join_traces)
        self.hold = EngineHold(spool, self.contexts, metrics, max_spans=settings.otlp_hold_max_spans,
                               max_age_s=settings.otlp_hold_max_age_s)
        self.prompt_contexts = PromptContexts(settings.prompt_refs_max_bytes, on_evict=metrics.prompt_refs_evicted.inc)
        metrics.prompt_refs_bytes.set_function(lambda: self.prompt_contexts.bytes)
        self.tokenizer_failures = TokenizerFailures()  # each unloadable name logged once
        self.background = BackgroundFailures(metrics.background_failures)  # the hold's and selection's loops
        self.redact_keys = RedactKeys(settings.redact_keys)
        self.policies = Policies(settings)
        self.selection: TailSelector | None = None
        # a node sending its gateway candidates only (processors/sampling/candidates.py) holds steps too, under the
        # budgets it learns from the gateway (they survive its restarts in DATA_DIR/gateway-budgets.json)
        node_candidates = settings.role == "node" and bool(settings.gateway_url) and settings.node_candidates
        if self.policies.any_tail or node_candidates:
            self.selection = TailSelector(settings, spool, metrics, policies=self.policies)
            if node_candidates:
                self.selection.node_candidates = True
                self.learn_budgets(load_learned(settings.data_dir / LEARNED_FILE), save=False)
            metrics.bind_selection(lambda: spool.held_count, lambda: spool.held_bytes,
                                   lambda: self.selection.held_trajectories if self.selection else 0,
                                   lambda: len(self.selection.open) if self.selection else 0)
        # stored prompt references (processors.store_refs): only where a referenced span stays as long as
        # its trajectory (no per-span deletion after forwarding) and no tail budget rewrites held spans (a node
        # sending candidates only: while none of the gateway's budgets it learned has it hold anything)
        self._store_refs = (settings.store_prompt_refs and (spool.local_only or settings.keep_forwarded)
                            and (self.selection is None or node_candidates))
        if not self._store_refs and (rewritten := spool.expand_stored_refs()):
            # a spool written with references, reopened where a referenced span may be deleted first
            log.warning("stored prompt references are off in this run (TRACECAR_STORE_PROMPT_REFS, KEEP_FORWARDED, "
                        "tail budgets): %d spans stored as references were rewritten whole at start", rewritten)
        if self.selection is None and not settings.budgets and settings.validation_budget is None:
            self.sampler = StepBudgetSampler(settings.max_samples_per_step_per_worker, spool.load_decisions,
                                             seed=settings.sampling_seed, load_trace=spool.load_trace_decision)
        else:  # per-experiment overrides: the head sampler applies only where the mode is head
            def head_limit(experiment: Any, validate: Any) -> int | None:
                budget = self.policies.get(experiment, validate)
                return budget.max_samples_per_step_per_worker if budget.mode == "head" else None

            self.sampler = StepBudgetSampler(None, spool.load_decisions, limit_for=head_limit, seed=settings.sampling_seed,
                                             seed_for=lambda e, v: self.policies.get(e, v).sampling_seed,
                                             load_trace=spool.load_trace_decision)
        self.cpu = ThreadPoolExecutor(max_workers=settings.decode_threads, thread_name_prefix="tracecar-cpu")
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracecar-spool")
        # TRACECAR_WORKERS > 1: decoding and serialising in worker processes (started by the first
        # batch that decodes, or at start when token2text is on); 1: in the CPU threads above
        workers = settings.effective_workers
        self.pool: WorkerPool | None = None
        if workers > 1:
            self.pool = WorkerPool(workers, WorkerConfig(
                policy=TokenizerPolicy.from_settings(settings), redact_keys=list(settings.redact_keys),
                max_batch_spans=settings.max_batch_spans, max_decompressed_bytes=settings.max_decompressed_bytes,
                max_span_bytes=settings.max_span_bytes, local_only=spool.local_only), metrics)
        self.inflight = asyncio.Semaphore(settings.max_inflight_requests)
        self._lookup = threading.local()  # per CPU thread: a read-only connection for parent look-ups
        self._lookup_conns: list[sqlite3.Connection] = []
        self._lookup_lock = threading.Lock()
        self.on_committed: list[Any] = []
        self.client_drops = ClientDrops(metrics.client_dropped)  # what workers lost before sending
        self.open_calls = OpenCalls(settings.live_max_open_calls, metrics.open_calls_forgotten)
        metrics.open_calls.set_function(lambda: len(self.open_calls))
        # set by the collector: evicts forwarded trajectories after a full-disk refusal
        self.make_room: Callable[[int], bool] = lambda need: False
        self.disk_short: Callable[[], bool] = lambda: False  # True while the disk reserve is released

    def spool_used(self) -> int:
        """Bytes counted against TRACECAR_SPOOL_MAX_BYTES (local mode: everything stored)."""
        return self.spool.pending_bytes + self.spool.held_bytes if not self.spool.local_only else self.spool.stored_bytes

    def at_capacity(self) -> bool:
        return self.spool_used() >= self.settings.spool_max_bytes

    def check_capacity(self) -> None:
        """Refuses new work while the spool (or, in local mode, the store) is at its bound."""
        if self.disk_short():
            raise Backpressure("disk_full", "spool disk is full: evicting forwarded trajectories to make room")
        limit = self.settings.spool_max_bytes
        used = self.spool_used()
        if used >= limit:
            raise Backpressure("spool_bytes", f"spool holds {used} bytes, at TRACECAR_SPOOL_MAX_BYTES={limit}")

    @contextlib.asynccontextmanager
    async def permit(self) -> AsyncIterator[None]:
        """One of TRACECAR_MAX_INFLIGHT_REQUESTS slots, taken before the body is read, or 503 at once.

        Holding it across the body read is what bounds memory: a request without a slot is
        answered before uvicorn buffers more than its flow-control window of the body.
        """
        if self.inflight.locked():
            raise Backpressure("inflight_requests",
                               f"{self.settings.max_inflight_requests} requests already in flight (TRACECAR_MAX_INFLIGHT_REQUESTS)")
        await self.inflight.acquire()
        try:
            yield
        finally:
            self.inflight.release()
            HEAP.release_retained()  # a burst of large bodies leaves the heap no fuller than its bound (heap.py)

    async def ingest(self, body: bytes | bytearray, content_type: str | None, content_encoding: str | None,
                     receiver: Receiver | None = None) -> IngestResult:
        """Processes one body; the caller holds a :meth:`permit` (taken before reading it).

        ``receiver`` turns the body into validated spans (default: tracecar's wire format).
        """
        self.check_capacity()
        loop = asyncio.get_running_loop()
        validated, heads, done = await self._receive_somewhere(body, content_type, content_encoding, receiver)
        m = self.metrics
        if validated.batch.dropped is not None:  # the sender's own drop totals
            totals = parse_dropped(validated.batch.dropped)
            if totals is None:
                m.client_reports_ignored.inc()
            else:
                self.client_drops.observe(validated.batch.worker, totals)
        memberships = [s for s in validated.spans if s["kind"] == MEMBERSHIP]
        if memberships:  # a step's sample indices: consumed by the head sampler, never stored
            validated.spans = [s for s in validated.spans if s["kind"] != MEMBERSHIP]
            m.memberships_received.inc(len(memberships))
        opened = [s for s in validated.spans if s["kind"] == OPEN_KIND]
        if opened:  # calls still running: the live view's, never stored
            validated.spans = [s for s in validated.spans if s["kind"] != OPEN_KIND]
            self.open_calls.opened(opened, time.time())
        self.open_calls.closed(validated.spans)
        m.spans_received.inc(len(validated.spans) + len(validated.rejected))
        for rejection in validated.rejected:
            m.spans_rejected.labels(reason=_reason_label(rejection)).inc()
        selection = self.selection
        job_limit = validated.batch.max_samples_per_step_per_worker
        announced = self.sampler.announce(memberships, job_limit) if memberships else []
        if selection is None:
            sampled = self.sampler.sample(validated.spans, job_limit)
            spans = sampled.kept
        else:  # spans the tail selector claims skip the head sampler, in arrival order
            sampled = self.sampler.sample([s for s in validated.spans if not selection.claims(s)], job_limit)
            gone = {id(s) for s in sampled.dropped}
            spans = [s for s in validated.spans if id(s) not in gone]
        sampled.new_decisions[:0] = announced
        if sampled.dropped:
            m.spans_sampled_out.labels(budget="max_samples_per_step_per_worker").inc(len(sampled.dropped))
        rows, tokens, too_big = await self._decode_and_serialize_somewhere(validated, spans, body, content_type,
                                                                           content_encoding, receiver, heads, done)
        if self.prompt_contexts.ended:  # decoded in a worker process: this batch's finished trajectories go now
            await loop.run_in_executor(self.cpu, self.prompt_contexts.release_ended)
        for rejection in too_big:  # over the size bound ("spans[i]"), or a part that cannot be stored
            m.spans_rejected.labels(reason="span_too_large" if "." not in rejection.field else _reason_label(rejection)).inc()
        m.decoded_tokens.inc(tokens)
        if validated.awaiting:  # engine spans whose trajectory is not known yet: stored, owed to no exporter
            for row in rows:
                row.awaiting = row.span["span_id"] in validated.awaiting
        if isinstance(validated, ForwardedBatch) and validated.node:  # a gateway keeps which node forwarded each span
            for row in rows:
                row.node = validated.node
        tail_dropped = 0
        try:
            try:
                written, tail_dropped = await loop.run_in_executor(self.writer, self._write, rows, sampled, selection)
            except SpoolFull:  # a full disk: evict forwarded trajectories (when forwarding), then one more try
                need = 2 * sum(r.size for r in rows)
                # the tail selector's routing is not idempotent: there, the client's retry is the next try
                if not await loop.run_in_executor(self.writer, self.make_room, need) or selection is not None:
                    raise
                written, tail_dropped = await loop.run_in_executor(self.writer, self._write, rows, sampled, selection)
        except SpoolFull as exc:
            self.sampler.forget(sampled.new_decisions)
            raise Backpressure("disk_full", f"spool disk is full: {exc}") from None
        except BaseException:
            self.sampler.forget(sampled.new_decisions)
            raise
        if self.hold.enabled and (validated.awaiting or validated.foreign_roots or self.hold.traces):
            await loop.run_in_executor(self.writer, self._settle_held, validated, rows, written.duplicate_ids)
        m.spans_accepted.inc(written.inserted)
        m.spans_duplicate.inc(written.duplicates)
        for warnings in validated.warnings.values():
            for w in warnings:
                m.span_warnings.labels(kind=_warning_kind(w)).inc()
        for callback in self.on_committed:
            callback()
        return IngestResult(
            accepted=written.inserted, duplicates=written.duplicates, sampled_out=len(sampled.dropped) + tail_dropped,
            rejected=validated.rejected + too_big,
            warnings={k: v for k, v in validated.warnings.items()},
        )

    def _settle_held(self, validated: Validated, rows: list[SpoolRow], duplicates: list[str]) -> None:
        """After a write, on the writer thread: engine spans waiting for a trajectory this batch
        brought are joined to it (or released, :mod:`.engine_hold`). The batch is committed
        already: a failure here leaves them waiting (the age bound still applies)."""
        again = set(duplicates)
        held = [r.span["trace_id"] for r in rows if r.awaiting and r.span["span_id"] not in again]
        # parentless ones wait for the call that sent their request (VERL's enable_otel), by its id
        by_request = {r.span["trace_id"]: rid for r in rows if r.awaiting and r.span["span_id"] not in again
                      and r.span.get("parent_id") is None and (rid := request_id_of(r.span)) is not None}
        try:
            self.hold.after_write(validated.spans, held, validated.foreign_roots, by_request)
        except Exception:  # noqa: BLE001 - never fails an acknowledged batch
            self.background.failed("engine_hold_settle", "engine hold: settling waiting engine spans failed; they keep waiting")

    async def run_hold(self) -> None:
        """Releases engine spans that waited past TRACECAR_OTLP_HOLD_MAX_AGE_S, until cancelled."""
        if not self.hold.enabled:
            return
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.settings.otlp_hold_max_age_s / 4))
            try:
                released = await loop.run_in_executor(self.writer, self.hold.expire)
            except Exception:  # noqa: BLE001 - e.g. a full disk: retried next tick
                self.background.failed("engine_hold_expire", "engine hold: releasing expired engine spans failed; retrying")
                continue
            if released:
                for callback in self.on_committed:
                    callback()

    def _write(self, rows: list[SpoolRow], sampled: Any, selection: TailSelector | None) -> tuple[Any, int]:
        if selection is None:
            return self.spool.write(rows, sampled.new_decisions), 0
        return selection.write(rows, sampled.new_decisions, [s["trace_id"] for s in sampled.dropped])

    def _tokenizer_failed(self, reason: str, name: str, message: str) -> None:
        """Counted on every failed load attempt (at most one per name per TRACECAR_TOKENIZER_RETRY_S).

        The log line is :class:`TokenizerFailures`' (once per name, with what was tried).
        """
        self.metrics.tokenizer_refused.labels(reason=reason).inc()

    # ---- stages (worker threads) ---------------------------------------------------------
    def _parse(self, body: bytes | bytearray, content_type: str | None, content_encoding: str | None,
               keep_ids: bool = False) -> Validated:
        return cast(Validated, parse_batch(body, content_type, content_encoding, self.settings.max_batch_spans,
                                           self.settings.max_decompressed_bytes, self.redact_keys, keep_ids))

    def _keeps_ids(self) -> bool:
        """Whether a batch parsed here may keep its id lists as received (receivers/raw_ids.py): when
        nothing decodes them (a batch that asks for token2text itself gets lists back: parse_batch)."""
        return not self.settings.token2text

    def _receive_and_validate(self, body: bytes | bytearray, content_type: str | None, content_encoding: str | None) -> Validated:
        validated = self._parse(body, content_type, content_encoding, self._keeps_ids())
        self._after_validate(validated)
        return validated

    def _after_validate(self, validated: Validated) -> None:
        """What validation needs of this process's state: the store (a parent's trace), prompt
        contexts (v2 references), the OTLP joins. Reads span heads only (worker_pool.head_of)."""
        v2 = validated.batch.v >= 2
        # one lookup: the parents' traces, and (v2) which of the batch's spans are stored already
        batch_ids = [s["span_id"] for s in validated.spans] if v2 else []
        stored = self._stored_traces(sorted(set(parents_to_look_up(validated)) | set(batch_ids)))
        reject_foreign_children(validated, stored)
        if v2:  # prompt references: rebuilt before sampling, so every stage sees full lists
            before = len(validated.rejected)
            validated.prompt_bases, resolved = resolve_refs(validated, self.prompt_contexts,
                                                            max_ids=max_rebuilt_ids(self.settings.max_decompressed_bytes),
                                                            stored={sid for sid in batch_ids if sid in stored})
            # what a worker process is sent rebuilt (it re-parses the body): each kept span's resolved references
            validated.rebuilt = {sid: [(part, key) for part, key, *_ in items] for sid, items in validated.store_refs.items()}
            self.metrics.prompt_refs.labels(outcome="resolved").inc(resolved)
            self.metrics.prompt_refs.labels(outcome="unresolved").inc(len(validated.rejected) - before)
        self.contexts.remember(validated.spans)  # for engine spans that join these trajectories over OTLP

    async def _receive_somewhere(self, body: bytes | bytearray, content_type: str | None, content_encoding: str | None,
                                 receiver: Receiver | None) -> tuple[Validated, bool, WorkResult | None]:
        """The batch validated, whether its spans are heads only (parsed by a worker process), and
        the batch finished by that worker when sampling cannot thin it (worker_pool.prepare).

        With a warm pool the body is parsed and validated in a worker, which sends back each
        span's head (worker_pool.head_of): this process never parses it. A body the worker
        refuses, or a pool that cannot take it, is parsed here (so a refusal's answer is exactly
        the single-process one, and nothing is lost to a dead worker).
        """
        loop = asyncio.get_running_loop()
        pool = self.pool
        if pool is not None and receiver is None and pool.ready:
            settings = self.settings
            complete = self.sampler.limit is None and self.sampler._limit_for is None  # no head budget can drop
            prepared = await pool.call(prepare, PrepareOrder(body, content_type, content_encoding, complete=complete,
                                                             token2text=settings.token2text, tokenizer=settings.tokenizer,
                                                             count_tokens=self.selection is not None and self.selection.holds_any))
            if prepared is not None:
                validated, done = cast("tuple[Validated, WorkResult | None]", prepared)
                self.metrics.batches_parsed.labels(where="worker").inc()
                if validated.batch.v >= 2:
                    await loop.run_in_executor(self.cpu, unpack_heads, validated.spans)
                rejected = len(validated.rejected)
                await loop.run_in_executor(self.cpu, self._after_validate, validated)
                if len(validated.rejected) != rejected:  # a foreign child, an unresolved reference: phase two
                    done = None
                return validated, True, done
        if receiver is None:
            self.metrics.batches_parsed.labels(where="ingest").inc()
        return await loop.run_in_executor(self.cpu, receiver or self._receive_and_validate, body, content_type,
                                          content_encoding), False, None

    def _stored_traces(self, span_ids: list[str]) -> dict[str, str]:
        """trace_id of each of these spans that the store holds (one indexed lookup per 500 ids).

        Read on a connection of this CPU thread's own (WAL readers never wait for the writer),
        not the spool's shared read connection, which a long viewer query may hold.
        """
        if not span_ids:
            return {}
        conn = getattr(self._lookup, "conn", None)
        if conn is None:
            uri = "file:" + urllib.parse.quote(str(Path(self.spool.path).resolve())) + "?mode=ro"
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=30)
            self._lookup.conn = conn
            with self._lookup_lock:
                self._lookup_conns.append(conn)
        found: dict[str, str] = {}
        for start in range(0, len(span_ids), 500):
            chunk = span_ids[start:start + 500]
            rows = conn.execute(f"SELECT span_id, trace_id FROM spans WHERE span_id IN ({','.join('?' * len(chunk))})", chunk)
            found.update(rows.fetchall())
        return found

    def _decode_and_serialize(self, validated: Validated, spans: list[Span]) -> tuple[list[SpoolRow], int, list[Rejection]]:
        batch = validated.batch
        tokens = 0
        # span id -> each response token's end offset (token view); a node's, when it forwarded the batch (receivers/forwarded.py)
        ends: dict[str, list[int]] = dict(getattr(validated, "carried_ends", None) or {})
        token2text = self.settings.token2text if batch.token2text is None else batch.token2text
        name = batch.tokenizer or self.settings.tokenizer
        if token2text and spans:
            if name is None:
                self.metrics.decode_failures.labels(reason="no_tokenizer").inc()
                for span in spans:
                    validated.warnings.setdefault(span["span_id"], []).append(
                        "tokenizer: token2text is on but no tokenizer is configured (TRACECAR_TOKENIZER)")
            else:
                try:
                    tokens = self._decode(validated, spans, self.tokenizers.get(name), name, ends)
                except TokenizerNotFound as exc:
                    self.metrics.decode_failures.labels(reason=f"tokenizer_{exc.reason}").inc()
                    self.tokenizer_failures.failed(name, exc, configured=batch.tokenizer is None, worker=batch.worker)
                    tokens = self._decode_with_default(validated, spans, name, exc, ends)
        rows, too_big = self._serialize(validated, spans, ends, self._store_plan(validated, spans))
        self.prompt_contexts.release_ended()  # this batch's finished trajectories: decoded, no later turn reads them
        return rows, tokens, too_big

    def _decode(self, validated: Validated, spans: list[Span], tokenizer: Any, name: str,
                ends: dict[str, list[int]]) -> int:
        """decode_spans; in v2 batches reusing the text of referenced prompts (span_work.decode_v2)."""
        if validated.batch.v < 2:
            return decode_spans(spans, tokenizer, validated.warnings, pieces=ends)
        outcomes: dict[str, int] = {}
        remembered, set_texts = validated.remembered, self.prompt_contexts.set_texts

        def own_texts(worker: str, span_id: str, text: str | None, response: str | None, tokenizer_name: str) -> None:
            if span_id in remembered:  # a resend's texts are not those of the context the first copy left
                set_texts(worker, span_id, text, response, tokenizer_name)

        tokens = decode_v2(spans, validated.batch.worker, validated.prompt_bases, tokenizer, name, validated.warnings, ends,
                           self.prompt_contexts.get, own_texts, outcomes)
        for outcome, n in outcomes.items():
            self.metrics.prompt_text_joins.labels(outcome=outcome).inc(n)
        return tokens

    def _decode_with_default(self, validated: Validated, spans: list[Span], name: str, exc: Exception,
                             ends: dict[str, list[int]]) -> int:
        """A worker's tokenizer the collector cannot (or may not) load: the operator's
        ``TRACECAR_TOKENIZER`` decodes instead, said on every span, as the docs promise (VERL's
        adapter always names the model's ``tokenizer_path``, which the sidecar may not see)."""
        default = self.settings.tokenizer
        note = f"tokenizer: {exc}"
        if default and default != name:
            try:
                tokenizer = self.tokenizers.get(default)
            except TokenizerNotFound:
                tokenizer = None
            if tokenizer is not None:
                note += f"; decoded with TRACECAR_TOKENIZER ({default}) instead"
                for span in spans:
                    validated.warnings.setdefault(span["span_id"], []).append(note)
                return decode_spans(spans, tokenizer, validated.warnings, pieces=ends)
        for span in spans:
            validated.warnings.setdefault(span["span_id"], []).append(note)
        return 0

    def _serialize(self, validated: Validated, spans: list[Span],
                   ends: dict[str, list[int]] | None = None, plan: StoreRefs | None = None) -> tuple[list[SpoolRow], list[Rejection]]:
        worker, contexts = validated.batch.worker, self.prompt_contexts
        return serialize_spans(spans, validated.warnings, validated.index_of, ends or {}, max_span_bytes=self.settings.max_span_bytes,
                               count_tokens=self.selection is not None and self.selection.holds_any, local_only=self.spool.local_only,
                               store_refs=plan, view=lambda ref: contexts.get(worker, ref))

    def _store_plan(self, validated: Validated, spans: list[Span]) -> StoreRefs | None:
        """The lists to store as references (processors.store_refs): those whose referenced span is
        kept in this batch or stored in the same trajectory (one indexed lookup)."""
        if not self.store_refs or not validated.store_refs:
            return None
        refs = {s["span_id"]: validated.store_refs[s["span_id"]] for s in spans if s["span_id"] in validated.store_refs}
        if not refs:
            return None
        batch_ids = {s["span_id"] for s in spans}
        stored = self._stored_traces(sorted(referenced(refs) - batch_ids))
        return refs_stored(refs, {s["span_id"]: s["trace_id"] for s in spans}, batch_ids, stored)

    # ---- the same work in a worker process (receivers/worker_pool.py) --------------------------
    async def _decode_and_serialize_somewhere(self, validated: Validated, spans: list[Span], body: bytes | bytearray,
                                              content_type: str | None, content_encoding: str | None,
                                              receiver: Receiver | None,
                                              heads: bool = False,
                                              done: WorkResult | None = None) -> tuple[list[SpoolRow], int, list[Rejection]]:
        """In a worker process when the pool is warm and the batch decodes, else in a CPU thread.

        Whatever the pool cannot do (warming up, a worker died, a tokenizer it cannot load) is
        done here, in-process, from the spans as validated: they are never changed by the pool.
        ``heads``: the spans are heads (a worker parsed the body): every batch goes to a worker,
        and what the pool cannot do is done here from the body parsed again (:meth:`_full_spans`).
        """
        pool = self.pool
        loop = asyncio.get_running_loop()
        if done is not None and done.span_ids == [s["span_id"] for s in spans]:  # finished in phase one
            self.metrics.worker_batches.labels(path="worker").inc()
            return self._apply(validated, spans, validated.batch.worker, done.tokenizer, done)
        if heads and pool is not None:
            return await self._decode_heads(validated, spans, body, content_type, content_encoding, pool)
        order = None
        if pool is not None and receiver is None and pool.usable:
            order = await loop.run_in_executor(self.cpu, self._work_order, validated, spans, body, content_type, content_encoding)
        if pool is not None and order is not None:
            pool.start()  # no-op once started
            done_there = await self._in_worker(pool, order, validated, spans)
            if done_there is not None:
                return done_there
        self.metrics.worker_batches.labels(path="in_process").inc()
        return await loop.run_in_executor(self.cpu, self._decode_and_serialize, validated, spans)

    async def _in_worker(self, pool: WorkerPool, order: WorkOrder, validated: Validated,
                         spans: list[Span]) -> tuple[list[SpoolRow], int, list[Rejection]] | None:
        """The batch done by a worker, or None (counted) when it must be done in the ingest process."""
        result = await pool.run(order)
        if result is not None and result.redo is None:
            self.metrics.worker_batches.labels(path="worker").inc()
            return self._apply(validated, spans, order.worker, order.tokenizer, result)
        if result is not None:
            self.metrics.worker_failures.labels(kind=result.redo or "redo").inc()
        return None

    async def _decode_heads(self, validated: Validated, spans: list[Span], body: bytes | bytearray, content_type: str | None,
                            content_encoding: str | None, pool: WorkerPool) -> tuple[list[SpoolRow], int, list[Rejection]]:
        """Phase two of a worker-parsed batch: decode + serialise the kept spans in a worker."""
        loop = asyncio.get_running_loop()
        before = {sid: list(notes) for sid, notes in validated.warnings.items()}  # restored for a redo here
        order = await loop.run_in_executor(self.cpu, self._work_order, validated, spans, body, content_type,
                                           content_encoding, True)
        if order is not None:
            done_there = await self._in_worker(pool, order, validated, spans)
            if done_there is not None:
                return done_there
        validated.warnings.clear()
        validated.warnings.update(before)
        self.metrics.worker_batches.labels(path="in_process").inc()
        return await loop.run_in_executor(self.cpu, self._redo_here, validated, spans, body, content_type, content_encoding)

    def _redo_here(self, validated: Validated, spans: list[Span], body: bytes | bytearray, content_type: str | None,
                   content_encoding: str | None) -> tuple[list[SpoolRow], int, list[Rejection]]:
        """A worker-parsed batch the pool could not finish: parsed here again, then done as without
        workers. The rows carry the head dicts (what sampling decided on, and the spool indexes)."""
        self.metrics.batches_parsed.labels(where="ingest").inc()
        full = self._full_spans(validated, spans, body, content_type, content_encoding)
        rows, tokens, too_big = self._decode_and_serialize(validated, full)
        by_id = {s["span_id"]: s for s in spans}
        for row in rows:
            row.span = by_id[row.span["span_id"]]
        return rows, tokens, too_big

    def _full_spans(self, validated: Validated, heads: list[Span], body: bytes | bytearray, content_type: str | None,
                    content_encoding: str | None) -> list[Span]:
        """The kept spans whole (the same deterministic parse and validation as the worker's), with
        the lists rebuilt from prompt references taken from the heads (resolved here already)."""
        by_id = {s["span_id"]: s for s in self._parse(body, content_type, content_encoding).spans}
        out: list[Span] = []
        for head in heads:
            sid = head["span_id"]
            span = by_id[sid]
            for part, key in validated.rebuilt.get(sid, ()):
                cast("dict[str, Any]", span[part])[key] = cast("dict[str, Any]", head)[part][key]  # type: ignore[literal-required]
            out.append(span)
        return out

    def _work_order(self, validated: Validated, spans: list[Span], body: bytes | bytearray, content_type: str | None,
                    content_encoding: str | None, heads: bool = False) -> WorkOrder | None:
        """What a worker needs for this batch, or None where the work stays here (nothing to decode:
        serialising alone costs less than shipping; a tokenizer this process cannot load; ids that
        are not plain ints). Runs in a CPU thread (a first tokenizer load takes a while)."""
        batch = validated.batch
        token2text = self.settings.token2text if batch.token2text is None else batch.token2text
        name = batch.tokenizer or self.settings.tokenizer
        if heads and spans and (not token2text or name is None):  # serialise only, in the worker
            if token2text:  # as _decode_and_serialize says it
                self.metrics.decode_failures.labels(reason="no_tokenizer").inc()
                for span in spans:
                    validated.warnings.setdefault(span["span_id"], []).append(
                        "tokenizer: token2text is on but no tokenizer is configured (TRACECAR_TOKENIZER)")
            name = None
        elif not spans or not token2text or name is None:
            return None
        try:  # this process's registry decides (and counts, logs) refusals and retries, as without workers
            if name is not None:
                self.tokenizers.get(name)
        except TokenizerNotFound:
            return None
        ids = [s["span_id"] for s in spans]
        order = WorkOrder(body, content_type, content_encoding, ids,
                          {sid: list(validated.warnings[sid]) for sid in ids if sid in validated.warnings},
                          {sid: validated.index_of[sid] for sid in ids}, name, v=batch.v, worker=batch.worker,
                          count_tokens=self.selection is not None and self.selection.holds_any)
        if batch.v >= 2:
            order.remembered = {sid for sid in ids if sid in validated.remembered}
            order.store_refs = self._store_plan(validated, spans) or {}
            for span in spans:
                sid = span["span_id"]
                for part, key in validated.rebuilt.get(sid, ()):
                    packed = pack_ids(cast("dict[str, Any]", span)[part][key])
                    if packed is None:
                        return None
                    order.rebuilt.setdefault(sid, []).append((part, key, packed))
            bases = {k: b for k, b in validated.prompt_bases.items() if (k if isinstance(k, str) else k[0]) in order.index_of}
            order.bases = bases
            wanted = [*ids, *(b.ref for b in bases.values()), *referenced(order.store_refs)]
            for key, base in bases.items():  # an output repeating an earlier prompt: the turns it was built on
                entry = self.prompt_contexts.get(batch.worker, base.ref) if not isinstance(key, str) else None
                wanted += [sid for n, sid in entry.marks if n == base.start] if entry is not None else []
            for sid in wanted:
                entry = self.prompt_contexts.get(batch.worker, sid)
                if entry is not None:
                    order.contexts[sid] = ContextView.of(entry)
        return order

    def _apply(self, validated: Validated, spans: list[Span], worker: str, tokenizer: str | None,
               result: WorkResult) -> tuple[list[SpoolRow], int, list[Rejection]]:
        """A worker's result as the in-process path leaves it: rows (with our own span dicts, whose
        index fields are what the spool reads), warnings, prompt texts for the next turns, counts."""
        by_id = {s["span_id"]: s for s in spans}
        validated.warnings.update(result.warnings)
        for sid, text, response in result.texts:
            if sid in validated.remembered:  # only the contexts this batch's copies left (not a resend's)
                self.prompt_contexts.set_texts(worker, sid, text, response, tokenizer or "")
        for outcome, n in result.outcomes.items():
            self.metrics.prompt_text_joins.labels(outcome=outcome).inc(n)
        rows = [SpoolRow(by_id[r.span_id], r.payload, r.warnings, tokens=r.tokens, inputs_at=r.inputs_at, output_at=r.output_at,
                         token_arrays=r.token_arrays, refs=r.refs) for r in result.rows]
        return rows, result.tokens, result.too_big

    # ---- tail-based decisions -------------------------------------------------------------
    @property
    def store_refs(self) -> bool:
        return self._store_refs and (self.selection is None or not self.selection.holds_any)

    def learn_budgets(self, description: Any, save: bool = True) -> None:
        """A node sending candidates only: its gateway's budgets (a heartbeat answer), kept across restarts."""
        if description is None or self.selection is None or not self.selection.node_candidates:
            return
        if self.selection.learn(description) and save:
            save_learned(self.settings.data_dir / LEARNED_FILE, description)
            log.info("gateway budgets learned", extra={"event": "gateway_budgets_learned"})

    async def run_selection(self) -> None:
        """Decides ready steps every tick until cancelled; wakes the forwarder when spans are released."""
        selection = self.selection
        if selection is None:
            return
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(selection.tick_s)
            try:
                released = await loop.run_in_executor(self.writer, selection.tick)
            except Exception:  # noqa: BLE001 - e.g. disk full: the step stays held, retried next tick
                self.background.failed("selection", "selection: deciding failed; held spans stay held")
                continue
            if released:
                for callback in self.on_committed:
                    callback()

    async def finish_selection(self) -> None:
        """On shutdown: decides the steps whose trajectories are all complete; the rest stay held."""
        if self.selection is None:
            return
        try:
            released = await asyncio.get_running_loop().run_in_executor(self.writer, self.selection.tick, True)
        except Exception:  # noqa: BLE001
            log.exception("selection: shutdown decision failed; held spans stay held")
            return
        if released:
            for callback in self.on_committed:
                callback()

    async def decisions(self, experiment: str | None, step: int, validate: bool | None) -> dict[str, Any]:
        """The decisions of one step and its open rounds (read on the writer thread: consistent)."""
        def read() -> dict[str, Any]:
            rows = self.spool.step_decisions(experiment, validate, step)
            open_rounds = self.selection.describe(experiment, step, validate) if self.selection else []
            return {"rows": rows, "open": open_rounds, "head": self._head_decisions(experiment, step, validate),
                    "experiments": self._experiments_at_step(step, validate)}

        got = await asyncio.get_running_loop().run_in_executor(self.writer, read)
        rows = got["rows"]
        by_rule: dict[str, int] = {}
        by_reason: dict[str, int] = {}
        for row in rows:
            row["keep"] = bool(row["keep"])
            row["validate"] = bool(row["validate"])
            row["has_error"] = bool(row["has_error"])
            row["truncated"] = bool(row["truncated"])
            if row["keep"]:
                by_rule[row["rule"]] = by_rule.get(row["rule"], 0) + 1
            else:
                by_reason[row["reason"]] = by_reason.get(row["reason"], 0) + 1
        budget = self.policies.get(experiment, bool(validate))
        head = got["head"]
        mode = budget.mode
        if head and mode == "pass":  # no budget of the collector's: the job's own (the batch's) applied
            mode = "head"
        return {
            "experiment": experiment, "step": step, "validate": validate, "mode": mode,
            "budget": budget.limits(), "kept": sum(by_rule.values()), "dropped": sum(by_reason.values()),
            "kept_by_rule": by_rule, "dropped_by_reason": by_reason, "open": got["open"], "decisions": rows,
            "head": head, "experiments_at_step": got["experiments"],
        }

    def _experiments_at_step(self, step: int, validate: bool | None) -> list[str | None]:
        """The experiments with decisions (tail or head) at this step, the most recently decided first:
        what `tracecar decisions --step N` without --experiment offers."""
        sql = "SELECT experiment, MAX(decided_at) AS at FROM trajectory_decisions WHERE step = ?"
        params: list[Any] = [step]
        if validate is not None:
            sql += " AND validate = ?"
            params.append(int(validate))
        found: dict[str | None, float] = {r["experiment"]: r["at"] for r in self.spool.query(sql + " GROUP BY experiment", params)}
        marker = f"\x1f{step}\x1f"
        head = self.spool.query("SELECT budget_key, MAX(rowid) AS at FROM sample_decisions WHERE instr(budget_key, ?) > 0"
                                " GROUP BY budget_key", [marker])
        for row in sorted(head, key=lambda r: r["at"]):
            name = row["budget_key"].split(marker, 1)[0]
            found.setdefault(None if name == "None" else name, float("inf"))  # head decisions: the newest (no time kept)
        return sorted(found, key=lambda name: -found[name])

    def _head_decisions(self, experiment: str | None, step: int, validate: bool | None) -> list[dict[str, Any]]:
        """The head budget's per-sample decisions of one step, per worker (and policy version), from the spool."""
        prefix = f"{experiment}\x1f{step}\x1f"
        out: dict[str, dict[str, Any]] = {}
        for row in self.spool.query("SELECT budget_key, sample_index, keep FROM sample_decisions"
                                    " WHERE substr(budget_key, 1, ?) = ? ORDER BY rowid", [len(prefix), prefix]):
            parts = row["budget_key"][len(prefix):].split("\x1f")
            worker, is_validation = parts[0], len(parts) > 1 and parts[1] == "1"
            if validate is not None and is_validation != bool(validate):
                continue
            version = parts[2][1:] if len(parts) > 2 else None
            entry = out.setdefault(row["budget_key"], {"worker": worker, "validate": is_validation, "policy_version": version,
                                                       "kept": [], "dropped": []})
            entry["kept" if row["keep"] else "dropped"].append(row["sample_index"])
        return list(out.values())

    def close(self) -> None:
        if self.pool is not None:  # after the drain: no batch is in flight any more
            self.pool.close()
        self.cpu.shutdown(wait=True, cancel_futures=True)
        self.writer.shutdown(wait=True)
        with self._lookup_lock:
            for conn in self._lookup_conns:
                conn.close()
            self._lookup_conns.clear()


def _reason_label(rejection: Rejection) -> str:
    field_name = rejection.field.split(".", 1)[1] if "." in rejection.field else rejection.field
    return field_name.split(".")[0].split("[")[0] or "span"


_TEXT_TARGETS = frozenset({"output.prompt_text", "output.response_text"})


def _warning_kind(warning: str) -> str:
    """The metric label of a warning: a span field (or a decoded text), never a client's own key."""
    head = warning.split(":", 1)[0]
    return head.split(".", 1)[1] if head in _TEXT_TARGETS else head.split(".", 1)[0][:32]

