"""The ingest pipeline: receive → validate → sample → decode → spool. Forwarding runs apart.

CPU stages run in worker threads so the event loop keeps answering health checks; the sampling
step runs on the loop itself (pure dict work) so decisions never race. A request is answered
only after its spans are committed to the spool. Under a tail-based budget the spans it claims
are routed (held / pass / drop) on the spool's writer thread, where its step decisions also run
(tracecar.collector.processors.sampling); with no budget none of that is built.
"""

from __future__ import annotations

import asyncio
import base64
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
from typing import Any

import msgpack
import orjson

from tracecar.client.redact import RedactKeys

from ..loudness import TokenizerFailures
from ..metrics import Metrics
from ..processors.decoding import (
    KnownPrefix,
    KnownSuffix,
    TokenizerNotFound,
    TokenizerPolicy,
    TokenizerRegistry,
    collect_jobs,
    decode_spans,
)
from ..processors.open_calls import OPEN_KIND, OpenCalls
from ..processors.prompt_refs import PromptContexts, resolve_refs
from ..processors.sampling import Policies, TailSelector
from ..processors.sampling.head import MEMBERSHIP, StepBudgetSampler
from ..processors.token_arrays import extract as extract_token_arrays
from ..processors.token_arrays import strip_from_payload as strip_token_arrays
from ..processors.validate import Rejection, Validated, parents_to_look_up, reject_foreign_children, validate_batch
from ..settings import CollectorSettings
from ..spool.store import Spool, SpoolFull, SpoolRow
from ..types import Span
from . import receive
from .client_drops import ClientDrops, parse_dropped
from .joins import TrajectoryContexts

#: the batch versions /v1/spans reads; a client sends prompt references only when 2 is listed, short ids when 3 is
WIRE_VERSIONS = (1, 2, 3)
_DUMP_OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
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


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes_b64__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, msgpack.ExtType):
        return {"__ext__": value.code, "data_b64": base64.b64encode(value.data).decode()}
    return repr(value)


_INPUTS_KEY, _OUTPUT_KEY = b'"inputs":', b',"output":'


class PayloadError(ValueError):
    """A span part that cannot be serialised; ``field`` names it (``attributes``, ``inputs``, ``output``, ...)."""

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


def _dumps_part(value: Any, field_name: str) -> bytes:
    try:
        return orjson.dumps(value, default=_json_default, option=_DUMP_OPTS)
    except orjson.JSONEncodeError as exc:
        hint = " (nested deeper than the 254 levels a stored value may have)" if "Recursion" in str(exc) else ""
        raise PayloadError(field_name, f"cannot be stored: {exc}{hint}") from None


def _dumps_head(head: dict[str, Any]) -> bytes:
    """The span's fields other than inputs/output; on failure, the field at fault is named."""
    try:
        return orjson.dumps(head, default=_json_default, option=_DUMP_OPTS)
    except orjson.JSONEncodeError:
        for key, value in head.items():  # only on failure: find which field it was
            _dumps_part({key: value}, str(key))
        raise


def pack_payload(span: Span) -> tuple[bytes, int, int]:
    """The span as one JSON object, with the byte offsets of its inputs and output values.

    The object is ``{...every other field..., "inputs": I, "output": O}``: any reader can
    parse it whole, and the forwarder can parse just the small head and splice ``I`` and ``O``
    into the backend request as they are (they hold the token ids and decoded text: most of the
    bytes, and most of the parsing time).
    """
    head = _dumps_head({k: v for k, v in span.items() if k != "inputs" and k != "output"})
    inputs = _dumps_part(span["inputs"], "inputs")
    output = _dumps_part(span["output"], "output")
    prefix = head[:-1] + b"," + _INPUTS_KEY
    inputs_at = len(prefix)
    output_at = inputs_at + len(inputs) + len(_OUTPUT_KEY)
    return prefix + inputs + _OUTPUT_KEY + output + b"}", inputs_at, output_at


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
        self.prompt_contexts = PromptContexts(settings.prompt_refs_max_bytes, on_evict=metrics.prompt_refs_evicted.inc)
        metrics.prompt_refs_bytes.set_function(lambda: self.prompt_contexts.bytes)
        self.tokenizer_failures = TokenizerFailures()  # each unloadable name logged once
        self.redact_keys = RedactKeys(settings.redact_keys)
        self.policies = Policies(settings)
        self.selection: TailSelector | None = None
        if self.policies.any_tail:
            self.selection = TailSelector(settings, spool, metrics, policies=self.policies)
            metrics.bind_selection(lambda: spool.held_count, lambda: spool.held_bytes,
                                   lambda: self.selection.held_trajectories if self.selection else 0,
                                   lambda: len(self.selection.open) if self.selection else 0)
        if self.selection is None and not settings.budgets and settings.validation_budget is None:
            self.sampler = StepBudgetSampler(settings.max_samples_per_step_per_worker, spool.load_decisions,
                                             seed=settings.sampling_seed)
        else:  # per-experiment overrides: the head sampler applies only where the mode is head
            def head_limit(experiment: Any, validate: Any) -> int | None:
                budget = self.policies.get(experiment, validate)
                return budget.max_samples_per_step_per_worker if budget.mode == "head" else None

            self.sampler = StepBudgetSampler(None, spool.load_decisions, limit_for=head_limit, seed=settings.sampling_seed,
                                             seed_for=lambda e, v: self.policies.get(e, v).sampling_seed)
        self.cpu = ThreadPoolExecutor(max_workers=settings.decode_threads, thread_name_prefix="tracecar-cpu")
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracecar-spool")
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

    async def ingest(self, body: bytes | bytearray, content_type: str | None, content_encoding: str | None,
                     receiver: Receiver | None = None) -> IngestResult:
        """Processes one body; the caller holds a :meth:`permit` (taken before reading it).

        ``receiver`` turns the body into validated spans (default: tracecar's wire format).
        """
        self.check_capacity()
        loop = asyncio.get_running_loop()
        validated = await loop.run_in_executor(self.cpu, receiver or self._receive_and_validate, body, content_type, content_encoding)
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
        rows, tokens, too_big = await loop.run_in_executor(self.cpu, self._decode_and_serialize, validated, spans)
        for rejection in too_big:  # over the size bound ("spans[i]"), or a part that cannot be stored
            m.spans_rejected.labels(reason="span_too_large" if "." not in rejection.field else _reason_label(rejection)).inc()
        m.decoded_tokens.inc(tokens)
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
    def _receive_and_validate(self, body: bytes | bytearray, content_type: str | None, content_encoding: str | None) -> Validated:
        plain = receive.decompress(body, content_encoding, self.settings.max_decompressed_bytes)
        raw = receive.parse(plain, content_type)
        limit = self.settings.max_batch_spans
        spans = raw.get("spans") if isinstance(raw, dict) else None
        if isinstance(spans, list) and len(spans) > limit:  # a size bound, like the body's: 413, so clients split
            raise receive.BodyError(413, "spans", f"{len(spans)} spans exceed TRACECAR_MAX_BATCH_SPANS={limit}; split the batch")
        # redaction walks the spans only when the body holds a redact key at all
        validated = validate_batch(raw, limit, self.redact_keys, plain,
                                   body_is_json=not (content_type or "").lower().split(";")[0].strip().endswith("msgpack"))
        reject_foreign_children(validated, self._stored_traces(parents_to_look_up(validated)))
        if validated.batch.v >= 2:  # prompt references: rebuilt before sampling, so every stage sees full lists
            before = len(validated.rejected)
            validated.prompt_bases, resolved = resolve_refs(validated, self.prompt_contexts,
                                                            max_ids=self.settings.max_decompressed_bytes // 2)
            self.metrics.prompt_refs.labels(outcome="resolved").inc(resolved)
            self.metrics.prompt_refs.labels(outcome="unresolved").inc(len(validated.rejected) - before)
        self.contexts.remember(validated.spans)  # for engine spans that join these trajectories over OTLP
        return validated

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
        ends: dict[str, list[int]] = {}  # span id -> each response token's end offset (token view)
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
        rows, too_big = self._serialize(validated, spans, ends)
        return rows, tokens, too_big

    def _decode(self, validated: Validated, spans: list[Span], tokenizer: Any, name: str,
                ends: dict[str, list[int]]) -> int:
        """decode_spans, reusing the text of referenced prompts decoded with this tokenizer, and
        keeping each decoded prompt's text for the next turn (v2 batches only).

        A turn whose earlier turn is in this batch too waits for a later round (one
        ``decode_batch`` each), so its earlier text is known when it is decoded.
        """
        if validated.batch.v < 2:
            return decode_spans(spans, tokenizer, validated.warnings, pieces=ends)
        worker, bases, tokens = validated.batch.worker, validated.prompt_bases, 0
        pending = spans
        while pending:
            waiting = {s["span_id"] for s in pending}
            now: list[Span] = []
            later: list[Span] = []
            for span in pending:
                sid = span["span_id"]
                refs = [b.ref for b in (bases.get(sid), bases.get((sid, "output"))) if b is not None and b.ref != sid]
                (later if any(ref in waiting for ref in refs) else now).append(span)
            if not now:  # cannot happen (a reference names an earlier span); never loop on it
                now, later = later, []
            known: dict[Any, Any] = {}
            for span in now:
                sid = span["span_id"]
                base = bases.get(sid)
                entry = self.prompt_contexts.get(worker, base.ref) if base is not None else None
                if (entry is not None and base is not None and entry.text is not None and entry.tokenizer == name
                        and entry.prompt_len == base.prompt_len):
                    then = entry.response_text is not None and base.with_response
                    known[sid] = KnownPrefix(base.prompt_len, entry.text, len(entry.ids) - entry.prompt_len if then else 0,
                                             entry.response_text if then else None)
                base = bases.get((sid, "output"))
                entry = self.prompt_contexts.get(worker, base.ref) if base is not None else None
                if (entry is not None and base is not None and entry.text is not None and entry.response_text is not None
                        and entry.tokenizer == name):
                    context = KnownPrefix(entry.prompt_len, entry.text, len(entry.ids) - entry.prompt_len, entry.response_text)
                    known[(sid, "output.response_ids")] = KnownSuffix(context, base.start)
            texts: dict[tuple[str, str], str] = {}
            outcomes: dict[str, int] = {}
            tokens += decode_spans(now, tokenizer, validated.warnings, known=known, texts_out=texts, outcomes=outcomes,
                                   pieces=ends)
            for outcome, n in outcomes.items():
                self.metrics.prompt_text_joins.labels(outcome=outcome).inc(n)
            for span in now:
                span_id = span["span_id"]
                entry = self.prompt_contexts.get(worker, span_id)
                if entry is not None:
                    response = texts.get((span_id, entry.response_source)) if entry.response_source else None
                    self.prompt_contexts.set_texts(worker, span_id, texts.get((span_id, "inputs.prompt_ids")), response, name)
            pending = later
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
                   ends: dict[str, list[int]] | None = None) -> tuple[list[SpoolRow], list[Rejection]]:
        rows, too_big = [], []
        limit = self.settings.max_span_bytes
        count_tokens = self.selection is not None
        for span in spans:
            packed = self._pack_token_arrays(validated, span, (ends or {}).get(span["span_id"]))
            warnings = validated.warnings.get(span["span_id"])
            if warnings:
                span["warnings"] = warnings
            try:
                payload, inputs_at, output_at = pack_payload(span)
            except PayloadError as exc:  # e.g. nested past orjson's depth: the part at fault is named
                index = validated.index_of[span["span_id"]]
                too_big.append(Rejection(index, span["span_id"], f"spans[{index}].{exc.field}", exc.reason))
                continue
            except orjson.JSONEncodeError as exc:
                index = validated.index_of[span["span_id"]]
                too_big.append(Rejection(index, span["span_id"], f"spans[{index}]", f"cannot be stored: {exc}"))
                continue
            if len(payload) > limit:
                index = validated.index_of[span["span_id"]]
                too_big.append(Rejection(index, span["span_id"], f"spans[{index}]",
                                         f"{len(payload)} bytes exceed TRACECAR_MAX_SPAN_BYTES={limit}"))
                continue
            row = SpoolRow(span, payload, warnings, inputs_at=inputs_at, output_at=output_at, token_arrays=packed)
            if count_tokens:  # for max_tokens_per_step: token ids the span carries
                row.tokens = sum(len(job.ids) for job in collect_jobs(span))
            rows.append(row)
        return rows, too_big

    def _pack_token_arrays(self, validated: Validated, span: Span, ends: list[int] | None) -> bytes | None:
        """The span's per-token arrays packed for the spool (see token_arrays); in local mode they
        also leave the payload. Problems are warnings on the span, never a lost span."""
        if not isinstance(span.get("output"), dict):
            return None
        notes: list[str] = []
        arrays = extract_token_arrays(span, notes)
        if notes:
            validated.warnings.setdefault(span["span_id"], []).extend(notes)
        if arrays is None:
            return None
        arrays.ends = ends if ends is not None and len(ends) == len(arrays.ids) else None
        if self.spool.local_only:
            strip_token_arrays(span, arrays)
        return arrays.pack()

    # ---- tail-based decisions -------------------------------------------------------------
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
                log.exception("selection: deciding failed; held spans stay held")
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
            return {"rows": rows, "open": open_rounds, "head": self._head_decisions(experiment, step, validate)}

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
            "head": head,
        }

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

