"""Background sender: a bounded queue drained by one daemon thread that batches and posts.

The caller's path only appends to a deque (and counts a drop when it is full). Everything
else — argument binding, flattening, JSON packing, compression, HTTP, retries — happens here, on a
thread that the training process never waits for except in a bounded ``flush``.
"""

from __future__ import annotations

import gzip
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import orjson

from .config import ClientConfig, client_info, default_worker_id
from .env_check import warn_unknown_env
from .loud import FailureReporter
from .prompt_delta import UNRESOLVED_REASON, PromptDeltas
from .redact import RedactKeys, scrub_exception
from .retry_after import parse_retry_after
from .short_ids import PREFIX_KEY, WIRE_VERSION_IDS, expand, shorten_record, shorten_wire
from .spans import SpanRecord, ids, safe_str
from .wire import (
    JSON_CONTENT_TYPE,
    WIRE_VERSION,
    WIRE_VERSION_DELTA,
    WireEncoder,
    batch_body,
    batch_body_pieces,
    pack_span_legacy,
    pack_span_pieces,
    pieces_size,
)

log = logging.getLogger("tracecar.client")

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Packing holds the GIL; yielding after every span cost more CPU than the packing (bench/hot_path.py),
# so the sender yields once per millisecond of work: the caller never waits longer than that.
GIL_HANDOFF_S = 0.001


@dataclass
class SenderStats:
    """Counters a worker can read (``get_tracer().stats()``); every drop has a reason."""

    sent: int = 0
    batches_sent: int = 0
    rejected_by_collector: int = 0
    retries: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    open_markers_skipped: int = 0  # live-view markers not queued (queue full); no span is lost
    # prompt deltas: spans sent with a reference, ids not sent thanks to it, requests forgotten
    # under the memory bound, spans resent whole because the collector could not resolve one
    prompt_refs: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def as_dict(self) -> dict[str, Any]:
        return {
            "sent": self.sent, "batches_sent": self.batches_sent,
            "rejected_by_collector": self.rejected_by_collector, "retries": self.retries,
            "dropped": dict(self.dropped), "dropped_total": sum(self.dropped.values()),
            "open_markers_skipped": self.open_markers_skipped,
            "prompt_refs": dict(self.prompt_refs),
        }


#: attributes an open marker carries: enough to file it under its experiment, step and sample
OPEN_ATTRIBUTES = ("experiment_name", "step", "sample_index", "rollout_n", "validate")


def open_marker_wire(record: SpanRecord) -> dict[str, Any]:
    """A call that has started, as the collector's live view reads it (``kind: open``, never
    stored): sent only if the call is still running when the sender gets to it, so a call that
    hangs has a name. The caller queues the record itself; the marker is built here."""
    attrs = record.attributes or {}
    parent = record.parent
    return {"span_id": record.span_id + ".open", "trace_id": record.trace.span_id,
            "parent_id": parent.span_id if parent is not None else None, "name": record.name, "kind": "open",
            "start_time": record.start, "end_time": None,
            "attributes": {k: attrs[k] for k in OPEN_ATTRIBUTES if k in attrs}, "inputs": {}, "output": None,
            "exception": None}


def _pack_legacy(wire: dict[str, Any], encoder: WireEncoder, size_limit: int) -> list[bytes]:
    return [pack_span_legacy(wire, encoder, size_limit)]


class Sender:
    """Owns the queue and the thread. Safe to use from any thread and across ``fork``."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.encoder = WireEncoder(config.max_string_chars, config.max_depth, RedactKeys(config.redact_keys))
        # a span's packed bytes as pieces, joined once per body (wire.pack_span_pieces)
        self._pack: Callable[[dict[str, Any], WireEncoder, int], list[bytes]] = (
            _pack_legacy if config.packing == "legacy" else pack_span_pieces)
        self._init_state()
        os.register_at_fork(after_in_child=self._init_state)

    def _init_state(self) -> None:
        """Fresh queue, lock, thread and connection pool (also in a forked child)."""
        self.queue: deque[SpanRecord] = deque()
        self.opens: deque[SpanRecord] = deque(maxlen=self.config.queue_max_spans)  # live-view markers
        self.stats = SenderStats()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()  # the only thing that cuts a retry backoff short
        self._idle = threading.Event()
        self._idle.set()
        # set while a flush waits: the sender then sends every span queued, not only whole bodies
        self._flush_wanted = threading.Event()
        # the queue length that fills one body (batch_max_spans, or fewer by the last body's bytes per
        # span): the caller wakes the sender at it, and the sender posts on only while that much waits
        self._body_spans = self.config.batch_max_spans
        self._stopping = False
        self._bug_logged = False  # an unexpected error's traceback was logged (once a process)
        self._encode_error_logged = False  # a span that could not be encoded was logged (once a process)
        self._thread: threading.Thread | None = None
        self._http: httpx.Client | None = None
        self._pending_body: tuple[bytes, int] | None = None
        self._abandoned = 0
        cfg = self.config
        self.deltas = PromptDeltas(cfg.prompt_delta_max_requests if cfg.prompt_delta else 0, cfg.prompt_delta_max_ids)
        self.stats.prompt_refs = self.deltas.counts  # the sender thread's counters, read as they are
        self._ref_records: dict[str, SpanRecord] = {}  # spans of the pending body sent with a reference
        self._marker_ids: set[str] = set()  # open markers in the pending body (not spans: never counted)
        # False once an answer shows a collector older than open markers (it lists no wire version 2, the
        # release that added both): markers stop; a refused marker is never counted as a dropped span
        self._markers_ok: bool | None = None
        self._send_whole: set[str] = set()  # span ids to resend in full (their reference was not resolved)
        # True once an answer lists wire version 3 (short span ids, tracecar.client.short_ids); until
        # then, and for an older collector, ids go out in full
        self._short_ids: bool | None = None
        self._id_prefix = ids.prefix  # the prefix the pending body's short ids stand for
        self.worker_id = self.config.worker_id or default_worker_id()
        self.reporter = FailureReporter(self.config.url, self.config.retry_max_elapsed_s)  # rate-limited, sender thread

    # ---- caller's path -------------------------------------------------------------------
    def enqueue(self, record: SpanRecord) -> None:
        queue = self.queue
        if len(queue) >= self.config.queue_max_spans or self._stopping:
            with self._lock:
                self.stats.drop("queue_full" if not self._stopping else "after_shutdown")
            return
        queue.append(record)
        if self._thread is None:
            self._start()
        elif len(queue) == self._body_spans:
            self._wake.set()

    def opened(self, record: SpanRecord) -> None:
        """A call started (live view): one append to a queue of its own, so markers never take a
        span's place; at its bound (TRACECAR_QUEUE_MAX_SPANS) the oldest marker goes, counted."""
        opens = self.opens
        if len(opens) == opens.maxlen:
            self.stats.open_markers_skipped += 1  # not a span: no span is lost
        opens.append(record)
        if self._thread is None:
            self._start()

    # ---- lifecycle -----------------------------------------------------------------------
    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tracecar-sender", daemon=True)
                self._thread.start()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits (bounded) until everything queued so far was sent or dropped. True if drained."""
        deadline = time.monotonic() + (self.config.shutdown_timeout_s if timeout_s is None else timeout_s)
        try:
            while time.monotonic() < deadline:
                if not self.queue and self._idle.is_set() and self._pending_body is None:
                    return True
                self._flush_wanted.set()
                self._wake.set()
                time.sleep(0.005)
            return not self.queue and self._pending_body is None
        finally:
            self._flush_wanted.clear()

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """Flushes within the deadline, then stops; what is left is counted as dropped."""
        drained = self.flush(timeout_s)
        self._stopping = True
        self._stop.set()
        self._wake.set()
        if not drained:
            with self._lock:
                in_flight = self._pending_body[1] if self._pending_body else 0
                self.stats.drop("shutdown_timeout", len(self.queue) + in_flight)
                self._abandoned = in_flight  # a post still in flight may yet succeed
                self.queue.clear()
                self._pending_body = None
        self.reporter.at_shutdown(self.stats.as_dict())
        return drained

    # ---- sender thread -------------------------------------------------------------------
    def _run(self) -> None:
        warn_unknown_env()  # TRACECAR_* typos, said once: here, off the caller's path
        interval = self.config.flush_interval_s
        while not self._stopping:
            self._wake.wait(interval)
            self._wake.clear()
            try:
                self._drain()
            except Exception:  # noqa: BLE001 - the sender must outlive any bug in one batch
                if not self._bug_logged:  # a bug in tracecar: its traceback once; the drops are reported with the others
                    self._bug_logged = True
                    log.exception("tracecar sender: unexpected error, its batch is dropped; this is a tracecar bug, "
                                  "please report it with this traceback. Later ones are counted as internal_error drops.")
                # every span of the batch it was sending (open markers are no spans); a failure while
                # building one: that one, at least
                lost = self._pending_body[1] if self._pending_body is not None else 1
                if lost:
                    with self._lock:
                        self.stats.drop("internal_error", lost)
                self._pending_body = None
                self._idle.set()
            self.reporter.dropped(self.stats.as_dict())

    def _drain(self) -> None:
        while (self.queue or self.opens or self._pending_body is not None) and not self._stopping:
            self._idle.clear()
            if self._pending_body is None:
                self._pending_body = self._build_body()
            if self._pending_body is None:
                break
            body, n = self._pending_body
            if not self._post_with_retries(body, n):
                return  # keep the pending body; retried on the next wake
            self._pending_body = None
            self._ref_records = {}
            if len(self.queue) < self._body_spans and not self._flush_wanted.is_set():
                # the rest waits for a whole body or the next interval: a post costs most of a
                # millisecond of this process's CPU whatever its size (bench/sender_posts.py)
                break
        self._idle.set()

    def _build_body(self) -> tuple[bytes, int] | None:
        """Packs up to batch_max_spans / batch_max_bytes spans into one JSON body.

        The byte bound is checked before each span, so a batch ends with at most one span past
        it: a long-context span (a 128k-token prompt is ~0.8 MB of ids) still goes out whole.
        Only a span over ``max_span_bytes`` is dropped (and counted).
        """
        cfg, queue, size = self.config, self.queue, 0
        parts: list[list[bytes]] = []
        last_yield = time.perf_counter()
        # markers first: one checked here as still running has its span enqueued after this
        # point, so the collector always sees a call open before it sees it end
        opens, markers, marker_ids = self.opens, 0, set()
        while opens and markers < cfg.batch_max_spans and self._markers_ok is not False:
            started = opens.popleft()
            if started.end is None:  # ended already: its span says more
                wire = open_marker_wire(started)
                marker_ids.add(wire["span_id"])
                if self._short_ids is True and self._v2():  # by the strings: its span_id is the call's + ".open"
                    shorten_wire(wire, ids.prefix)
                parts.append(self._pack(wire, self.encoder, cfg.max_string_chars))
                size += pieces_size(parts[-1])
                markers += 1
        if self._markers_ok is False:
            opens.clear()  # an older collector: they would only be refused
        deltas, refs, whole = self.deltas, {}, self._send_whole
        short = self._short_ids is True and self._v2()
        prefix = self._id_prefix = ids.prefix
        while queue and len(parts) - markers < cfg.batch_max_spans and size < cfg.batch_max_bytes:
            record = queue.popleft()
            try:
                wire = self._wire(record)
                resend = bool(whole) and wire["span_id"] in whole
                if resend:
                    whole.discard(wire["span_id"])
                if deltas.apply(wire, full=resend):
                    refs[wire["span_id"]] = record
                if short:
                    shorten_record(wire, record, prefix)
                packed = self._pack(wire, self.encoder, cfg.max_string_chars)
            except Exception as exc:  # noqa: BLE001 - one unserialisable span must not cost the batch
                with self._lock:
                    self.stats.drop("encode_error")
                if not self._encode_error_logged:  # the rest are counted, and reported with the other drops (rate-limited)
                    self._encode_error_logged = True
                    scrub = self.encoder.redact.scrub_text  # the message may quote the value: never a secret in a log
                    log.warning("tracecar: span %s could not be encoded and is dropped (%s). Later ones are counted "
                                "as encode_error drops.", record.name, scrub(f"{type(exc).__name__}: {safe_str(exc)}"))
                continue
            packed_size = pieces_size(packed)
            if packed_size > cfg.max_span_bytes:
                with self._lock:
                    self.stats.drop("span_too_large")
                continue
            parts.append(packed)
            size += packed_size
            now = time.perf_counter()
            if now - last_yield >= GIL_HANDOFF_S:  # let the generation loop in: ~1 ms, not 5 ms
                time.sleep(0)
                last_yield = time.perf_counter()
        if not parts:
            return None
        # a body takes spans until it reaches batch_max_bytes: ceil(bytes / bytes per span) of them
        self._body_spans = max(1, min(cfg.batch_max_spans, -(-cfg.batch_max_bytes * len(parts) // max(1, size))))
        self._ref_records, self._marker_ids = refs, marker_ids
        return batch_body_pieces(self._header(), parts), len(parts) - markers  # markers are not spans: not counted

    def _wire(self, record: SpanRecord) -> dict[str, Any]:
        """The span's wire dict, exception text scrubbed (key-based redaction is in pack_span)."""
        wire = record.to_wire(self.config.max_traceback_frames)
        if wire["exception"] is not None:
            scrub_exception(wire, self.encoder.redact)  # its message, and each frame's line, file and function
        return wire

    def _v2(self) -> bool:
        cfg = self.config
        return cfg.prompt_delta and cfg.prompt_delta_max_requests > 0 and self.deltas.enabled is not False

    def _header(self) -> dict[str, Any]:
        cfg = self.config
        # v2 from the first batch on (the collector then remembers its contexts for later references), until
        # an answer shows a collector without it
        v2 = self._v2()
        v3 = v2 and self._short_ids is True
        header = {"v": WIRE_VERSION_IDS if v3 else WIRE_VERSION_DELTA if v2 else WIRE_VERSION, "worker": self.worker_id,
                  "project": cfg.project, "entity": cfg.entity, "tokenizer": cfg.tokenizer, "client": client_info()}
        if v3:
            header[PREFIX_KEY] = self._id_prefix
        if cfg.wandb_run_id is not None:
            header["wandb_run_id"] = cfg.wandb_run_id
        if cfg.token2text is not None:
            header["token2text"] = cfg.token2text
        if cfg.max_samples_per_step_per_worker is not None:
            header["max_samples_per_step_per_worker"] = cfg.max_samples_per_step_per_worker
        if self.stats.dropped:  # running totals: the collector counts the increase (tracecar_client_dropped_spans)
            with self._lock:
                header["dropped"] = dict(self.stats.dropped)
        return header

    def _client(self) -> httpx.Client:
        if self._http is None:
            headers = {"Content-Type": JSON_CONTENT_TYPE, "User-Agent": "tracecar-client/1"}
            if self.config.token:
                headers["Authorization"] = f"Bearer {self.config.token}"
            self._http = httpx.Client(
                timeout=self.config.http_timeout_s,
                headers=headers,
                limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            )
        return self._http

    def _post_with_retries(self, body: bytes, n: int) -> bool:
        """Posts one batch; retries transient failures with capped, jittered backoff.

        Returns False only when stopping mid-retry (the body stays pending). Permanent failures
        and exhausted retries drop the batch and count it.
        """
        cfg = self.config
        headers = {}
        if cfg.compression == "gzip" and len(body) >= cfg.compress_min_bytes:
            body = gzip.compress(body, compresslevel=1)
            headers["Content-Encoding"] = "gzip"
        assert cfg.url is not None  # a Sender is made only for a configured URL
        started, delay = time.monotonic(), cfg.retry_initial_s
        while True:
            retry_after: float | None = None
            unreachable = False
            try:
                response = self._client().post(cfg.url + "/v1/spans", content=body, headers=headers)
            except httpx.HTTPError as exc:
                reason = f"connection: {type(exc).__name__}"
                self.reporter.send_failed(reason, retrying=True)
                unreachable = isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))
            else:
                status = response.status_code
                if status < 300:
                    self._record_success(response, n)
                    return True
                if status == 413 and n > 1:
                    return self._split_and_resend(n)
                if status == 422 and self._ref_records:  # every span refused: some may only need a resend in full
                    n -= self._resend_unresolved(_rejections(response))
                    if n == 0:
                        return True
                if status not in RETRYABLE_STATUS:
                    self.reporter.send_failed(f"http_{status}", retrying=False)
                    with self._lock:
                        self.stats.drop(f"http_{status}", n)
                    return True
                reason = f"http_{status}"
                self.reporter.send_failed(reason, retrying=True)
                retry_after = parse_retry_after(response.headers.get("Retry-After"))
            if time.monotonic() - started > cfg.retry_max_elapsed_s:
                log.warning("tracecar: giving up on %d spans after retries (%s)", n, reason)
                with self._lock:
                    self.stats.drop("retries_exhausted", n)
                return True
            with self._lock:
                self.stats.retries += 1
            wait = retry_after if retry_after is not None else delay * (0.5 + random.random())
            delay = min(delay * 2, cfg.retry_max_s)
            if unreachable:  # collector down or restarting: probe often, resume soon after it returns
                wait = min(wait, cfg.retry_probe_s)
            if self._stopping:
                return False
            # not _wake: flush() and enqueue() set it every few ms, which would defeat Retry-After
            self._stop.wait(min(wait, cfg.retry_max_s))
            if self._stopping:
                return False

    def _resend_unresolved(self, rejections: Any) -> int:
        """Requeues, to be sent in full, the spans whose reference the collector could not resolve.

        (It lost the earlier span: restarted, evicted it under its bound, or never got it.)
        They go to the front of the queue; none is counted as sent or dropped yet.
        """
        again = []
        for rejection in rejections:
            if not isinstance(rejection, dict) or not str(rejection.get("reason", "")).startswith(UNRESOLVED_REASON):
                continue
            record = self._ref_records.pop(str(rejection.get("span_id")), None)
            if record is not None:
                again.append(record)
        for record in reversed(again):
            self._send_whole.add(record.span_id)
            self.queue.appendleft(record)
        self.deltas.counts["resent_full"] += len(again)
        return len(again)

    def _split_and_resend(self, n: int) -> bool:
        """The collector said 413: resend the same spans as two smaller batches, and shrink later ones."""
        body, _ = self._pending_body  # type: ignore[misc]
        parsed = orjson.loads(body)
        spans = parsed.pop("spans")
        prefix = parsed.get(PREFIX_KEY) or ""
        half = max(1, n // 2)
        self.config = replace(self.config, batch_max_spans=max(1, min(self.config.batch_max_spans, half)))
        for chunk in (spans[:half], spans[half:]):
            if chunk:
                # the body's own header: its short ids stand for its prefix, whatever later answers said
                smaller = batch_body({**self._header(), "v": parsed.get("v"), PREFIX_KEY: parsed.get(PREFIX_KEY)}
                                     if PREFIX_KEY in parsed else self._header(), [orjson.dumps(s) for s in chunk])
                counted = sum(1 for s in chunk if expand(s.get("span_id"), prefix) not in self._marker_ids)  # markers are not spans
                self._pending_body = (smaller, counted)
                if not self._post_with_retries(smaller, counted):
                    return False
        return True

    def _record_success(self, response: httpx.Response, n: int) -> None:
        rejected, resent = 0, 0
        try:
            answer = response.json()
            rejected = int(answer.get("rejected_count", 0))
            rejections = _rejections(response)
            resent = self._resend_unresolved(rejections)
            if self._marker_ids:  # a refused open marker is no lost span
                rejected -= sum(1 for r in rejections if isinstance(r, dict) and r.get("span_id") in self._marker_ids)
            knows_v2 = WIRE_VERSION_DELTA in (answer.get("wire_versions") or ())
            self.deltas.set_enabled(knows_v2)
            self._markers_ok = knows_v2
            self._short_ids = WIRE_VERSION_IDS in (answer.get("wire_versions") or ())
        except Exception:  # noqa: BLE001 - a success without a readable body still counts as sent
            pass
        rejected -= resent
        n -= resent
        with self._lock:
            if self._abandoned:  # shutdown counted this batch as dropped; it made it after all
                self.stats.drop("shutdown_timeout", -min(n, self._abandoned))
                self._abandoned = 0
            self.stats.sent += n - rejected
            self.stats.batches_sent += 1
            if rejected:
                self.stats.rejected_by_collector += rejected
                self.stats.drop("rejected_by_collector", rejected)


def _rejections(response: httpx.Response) -> list[Any]:
    """The ``rejected`` list of a collector's answer (empty if it has none or is unreadable)."""
    try:
        rejected = response.json().get("rejected")
    except Exception:  # noqa: BLE001
        return []
    return rejected if isinstance(rejected, list) else []
