"""Metrics: one prometheus-client registry per app, so tests can run several collectors."""

from __future__ import annotations

import functools
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """Every counter the README's metrics table lists; names are the table's names."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("tracecar_requests", "Ingest requests by HTTP status.", ["status"], registry=r)
        self.spans_received = Counter("tracecar_spans_received", "Spans received in well-formed batches.", registry=r)
        self.memberships_received = Counter(
            "tracecar_memberships_received", "Step membership announcements (a step's sample indices) received; consumed by the head sampler, never stored.",
            registry=r)
        self.spans_accepted = Counter("tracecar_spans_accepted", "Spans committed to the spool (acknowledged).", registry=r)
        self.spans_rejected = Counter("tracecar_spans_rejected", "Spans refused, by reason.", ["reason"], registry=r)
        self.batches_rejected = Counter("tracecar_batches_rejected", "Whole requests refused (body, encoding, envelope), by reason.", ["reason"], registry=r)
        self.spans_duplicate = Counter("tracecar_spans_duplicate", "Spans already in the spool, or deleted from it after forwarding, eviction or sampling (client retries), dropped.", registry=r)
        self.spans_sampled_out = Counter("tracecar_spans_sampled_out", "Spans dropped by a sampling budget.", ["budget"], registry=r)
        self.span_warnings = Counter("tracecar_span_warnings", "Spans stored with a recorded warning, by kind.", ["kind"], registry=r)
        self.client_dropped = Counter("tracecar_client_dropped_spans", "Spans workers dropped before sending (as their batch headers report), by reason (queue_full, span_too_large, ...).", ["reason"], registry=r)
        self.client_reports_ignored = Counter("tracecar_client_reports_ignored", "Batch headers whose drop report was malformed and ignored (the spans were still taken).", registry=r)
        self.open_calls = Gauge("tracecar_open_calls", "Calls the workers said are running (open markers in memory, for the live view).", registry=r)
        self.open_calls_forgotten = Counter("tracecar_open_calls_forgotten", "Open markers forgotten at TRACECAR_LIVE_MAX_OPEN_CALLS (oldest first).", registry=r)
        self.decoded_tokens = Counter("tracecar_decoded_tokens", "Token ids decoded to text.", registry=r)
        self.prompt_refs = Counter("tracecar_prompt_refs", "Wire-version-2 spans carrying prompt references, by outcome: resolved (the full lists rebuilt), unresolved (span refused by name; the client resends it in full).", ["outcome"], registry=r)
        self.prompt_refs_evicted = Counter("tracecar_prompt_refs_evicted", "Prompt contexts forgotten under TRACECAR_PROMPT_REFS_MAX_BYTES (a later reference to one is refused and resent in full).", registry=r)
        self.prompt_refs_bytes = Gauge("tracecar_prompt_refs_bytes", "Bytes of prompt contexts kept for references (bounded by TRACECAR_PROMPT_REFS_MAX_BYTES).", registry=r)
        self.stored_prompt_refs_dangling = Gauge("tracecar_stored_prompt_refs_dangling", "Stored prompt references (TRACECAR_STORE_PROMPT_REFS) naming a span the store does not hold, by where they were found: write (stored anyway; its trajectory was evicted meanwhile) or read (shown as stored, with a warning on the span); counted since this process started, each logged rate-limited.", ["where"], registry=r)
        for where in ("write", "read"):
            self.stored_prompt_refs_dangling.labels(where=where).set_function(functools.partial(_dangling_count, where))
        self.prompt_text_joins = Counter("tracecar_prompt_text_joins", "Rebuilt prompts decoded as earlier text + the new ids (reused) or whole because the join was not safe (full).", ["outcome"], registry=r)
        self.workers = Gauge("tracecar_workers", "Worker processes decoding and serialising spans (TRACECAR_WORKERS), started and ready; 0 while they start (batches are then done in the ingest process) or with TRACECAR_WORKERS=1.", registry=r)
        self.worker_batches = Counter("tracecar_worker_batches", "Batches decoded and serialised, by where: worker (a worker process) or in_process (the ingest process: TRACECAR_WORKERS=1, nothing to decode, workers starting, or redone after a failure).", ["path"], registry=r)
        self.batches_parsed = Counter("tracecar_batches_parsed", "Request bodies of /v1/spans parsed and validated, by where: worker (a worker process; the ingest process read only span heads) or ingest (TRACECAR_WORKERS=1, workers starting, a refused body, or a batch redone after a failure).", ["where"], registry=r)
        self.worker_failures = Counter("tracecar_worker_failures", "Batches a worker process could not finish, redone in the ingest process (nothing acknowledged is lost), by kind: died (a worker process exited; the pool is restarted), error, tokenizer_failed, mismatch.", ["kind"], registry=r)
        self.decode_failures = Counter("tracecar_decode_failures", "Spans whose decoding failed (stored without text).", ["reason"], registry=r)
        # per exporter (label ``exporter``, the TRACECAR_EXPORTERS name; ``backend`` kept for existing dashboards)
        self.forwarded = Counter("tracecar_spans_forwarded", "Spans delivered, by exporter (backend: the same name, or local).", ["backend", "exporter"], registry=r)
        self.forward_failures = Counter("tracecar_forward_failures", "Failed forward attempts, by exporter and kind.", ["exporter", "kind"], registry=r)
        self.background_failures = Counter("tracecar_background_failures", "Failures of background work, retried (nothing acknowledged is lost), by task: engine_hold_settle, engine_hold_expire, selection, retention (logged: the first with its traceback, then at most once a minute).", ["task"], registry=r)
        self.dead_lettered = Counter("tracecar_spans_dead_lettered", "Spans an exporter's backend rejected permanently, by exporter.", ["exporter"], registry=r)
        self.partial_rejected = Counter("tracecar_otlp_partial_rejected_spans", "Spans an OTLP backend refused in a 2xx answer (ExportTraceServiceResponse.partial_success.rejected_spans), by exporter.", ["exporter"], registry=r)
        self.exporter_pending = Gauge("tracecar_exporter_pending", "Spans an exporter has still to deliver (its delivery cursor's backlog).", ["exporter"], registry=r)
        self.exporter_backoff = Gauge("tracecar_exporter_backoff_seconds", "The exporter's current retry backoff (0 while delivering).", ["exporter"], registry=r)
        self.auth_failures = Counter("tracecar_auth_failures", "Requests refused for a missing or wrong bearer token, by route.", ["route"], registry=r)
        self.backend_unreachable = Gauge("tracecar_backend_unreachable", "1 while forwarding to the exporter's backend fails (unreachable or refusing), else 0, by exporter.", ["exporter"], registry=r)
        self.forward_probes = Counter("tracecar_forward_probes", "One-span probes of a failing backend while the spool is at its bound, by exporter.", ["exporter"], registry=r)
        self.store_evicted_trajectories = Counter("tracecar_store_evicted_trajectories", "Forwarded trajectories evicted from the store, by reason (max_bytes, max_age, disk_full).", ["reason"], registry=r)
        self.store_evicted_spans = Counter("tracecar_store_evicted_spans", "Spans of evicted trajectories, by reason.", ["reason"], registry=r)
        self.store_archived_spans = Counter("tracecar_store_archived_spans", "Spans of evicted trajectories moved to the ClickHouse store's span archive (TRACECAR_STORE=clickhouse) instead of deleted; their readers find them there.", registry=r)
        self.store_archive_dropped_bytes = Counter("tracecar_store_archive_dropped_bytes", "Bytes of archived spans dropped above TRACECAR_STORE_ARCHIVE_MAX_BYTES (the oldest hours first; logged).", registry=r)
        self.store_archive_failures = Counter("tracecar_store_archive_failures", "Evictions the span archive refused (the trajectories stay in the spool, retried next tick; logged rate-limited).", registry=r)
        self.gateway_peer_failures = Counter("tracecar_gateway_peer_failures", "Requests of a merged read (TRACECAR_GATEWAY_PEERS) that a listed gateway did not answer, or answered 5xx, by gateway and reason (unreachable, or the status): its rows are missing from that answer (said in it; logged once a minute).", ["gateway", "reason"], registry=r)
        self.decisions_evicted = Counter("tracecar_decisions_evicted", "Oldest sampling-decision rows deleted above TRACECAR_DECISIONS_MAX_ROWS, by table.", ["table"], registry=r)
        self.http_closed = Counter("tracecar_http_closed", "Connections the collector closed on a client, by reason (header_timeout, body_timeout, idle_timeout, header_too_large).", ["reason"], registry=r)
        self.tokenizer_refused = Counter("tracecar_tokenizer_refused", "Tokenizer loads refused or failed, by reason (not_allowed, too_large, not_found, load_failed).", ["reason"], registry=r)
        self.backpressure = Counter("tracecar_backpressure", "Requests answered 503 because a bound was hit, by bound.", ["bound"], registry=r)
        self.store_errors = Counter("tracecar_store_errors", "Statements the read store's engine refused (TRACECAR_STORE=clickhouse: chDB; each read answered 503 naming the store, the error logged rate-limited), by store.", ["store"], registry=r)
        self.export_rows_skipped = Counter("tracecar_export_rows_skipped", "Trajectories left out of a dataset export (GET /v1/export) because a stored value did not fit the format (each logged with its trace id and why), by format.", ["format"], registry=r)
        self.otlp_spans = Counter("tracecar_otlp_spans", "Valid OTLP spans received, by what they joined: a tracecar trajectory found in memory or in the store, or none (a trace of their own).", ["joined"], registry=r)
        self.otlp_held = Counter("tracecar_otlp_held_spans", "OTLP engine spans that arrived before their trajectory, by outcome: held (stored, sent nowhere yet), then joined (took its project and left with it), dropped (with its trajectory, by a budget), foreign (another producer's root came: sent as it is), expired or overflow (TRACECAR_OTLP_HOLD_MAX_AGE_S / _MAX_SPANS: sent as it is).", ["outcome"], registry=r)
        self.otlp_request_joins = Counter("tracecar_otlp_request_joins", "Parentless OTLP engine spans joined to the call that sent their request by its id (gen_ai.request.id; VERL's enable_otel), by outcome: joined (the call was known on arrival), joined_late (after waiting for it), engine_unmatched (released without it: TRACECAR_OTLP_HOLD_MAX_AGE_S / _MAX_SPANS), request_unmatched (a call's request id forgotten before any engine span named it, counted once engine spans join by request id at all).", ["outcome"], registry=r)
        self.otlp_held_spans = Gauge("tracecar_otlp_held_spans_waiting", "OTLP engine spans waiting now for their trajectory (stored, sent to no exporter yet).", registry=r)
        self.ingest_seconds = Histogram(
            "tracecar_ingest_seconds", "Time from request read to acknowledgement.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r,
        )
        self.spool_depth = Gauge("tracecar_spool_depth", "Spans waiting to be forwarded.", registry=r)
        self.spool_pending_bytes = Gauge("tracecar_spool_pending_bytes", "Bytes of spans waiting to be forwarded.", registry=r)
        self.spool_file_bytes = Gauge("tracecar_spool_file_bytes", "Size of the spool/store file on disk.", registry=r)
        self.dead_letters = Gauge("tracecar_dead_letters", "Rows in the dead-letter table.", registry=r)
        self.ready = Gauge("tracecar_ready", "1 when accepting spans, 0 while starting or draining.", registry=r)
        # tail-based budgets (tracecar.collector.processors.sampling)
        self.trajectories_kept = Counter("tracecar_trajectories_kept", "Trajectories a tail-based decision kept, by the rule that kept them.", ["rule"], registry=r)
        self.trajectories_dropped = Counter("tracecar_trajectories_dropped", "Trajectories a tail-based decision dropped, by reason (the limit that stopped them, incomplete, ...).", ["reason"], registry=r)
        self.trajectories_truncated = Counter("tracecar_trajectories_truncated", "Kept trajectories cut under TRACECAR_MAX_TRAJECTORY_BYTES.", registry=r)
        self.node_candidates = Counter("tracecar_node_candidates", "Node with a gateway: trajectories of tail-budgeted steps it held, by whether it forwarded them as candidates (sent=false: not a candidate, kept in this node's store only).", ["sent"], registry=r)
        self.step_decisions = Counter("tracecar_step_decisions", "Step decisions (one per step and round), by what closed the step.", ["closed_by"], registry=r)
        self.held_spans = Gauge("tracecar_held_spans", "Spans held in the spool awaiting their step's decision.", registry=r)
        self.held_bytes = Gauge("tracecar_held_bytes", "Bytes of spans awaiting their step's decision.", registry=r)
        self.held_trajectories = Gauge("tracecar_held_trajectories", "Trajectories awaiting their step's decision (summaries in memory).", registry=r)
        self.open_steps = Gauge("tracecar_open_steps", "Steps (rounds) held open awaiting a decision.", registry=r)
        # the cluster tier (service/roles.py): what a gateway took from each node collector
        self.gateway_spans_received = Counter("tracecar_gateway_spans_received", "Gateway: valid spans node collectors forwarded, by node (TRACECAR_NODE_NAME; past 1,024 names, other).", ["node"], registry=r)
        # the list API (GET /v1/trajectories) over the viewer's trajectory index
        self.list_index_behind = Counter("tracecar_list_index_behind", "GET /v1/trajectories answers given before the trajectory index caught up (TRACECAR_LIST_CATCH_UP_S hit; index.caught_up=false).", registry=r)

    def bind_selection(self, held_spans: Callable[[], float], held_bytes: Callable[[], float],
                       held_trajectories: Callable[[], float], open_steps: Callable[[], float]) -> None:
        self.held_spans.set_function(held_spans)
        self.held_bytes.set_function(held_bytes)
        self.held_trajectories.set_function(held_trajectories)
        self.open_steps.set_function(open_steps)

    def bind_exporter(self, name: str, pending: Callable[[], float], backoff: Callable[[], float]) -> None:
        """Per-exporter series exist from the start (at 0), so a dashboard sees every configured one."""
        for counter in (self.dead_lettered, self.partial_rejected, self.forward_probes):
            counter.labels(exporter=name)
        self.forwarded.labels(backend=name, exporter=name)
        self.backend_unreachable.labels(exporter=name).set(0)
        self.exporter_pending.labels(exporter=name).set_function(pending)
        self.exporter_backoff.labels(exporter=name).set_function(backoff)

    def bind_spool(self, depth: Callable[[], float], pending_bytes: Callable[[], float], file_bytes: Callable[[], float], dead: Callable[[], float]) -> None:
        self.spool_depth.set_function(depth)
        self.spool_pending_bytes.set_function(pending_bytes)
        self.spool_file_bytes.set_function(file_bytes)
        self.dead_letters.set_function(dead)


def _dangling_count(where: str) -> float:
    from .loudness import DANGLING

    return float(DANGLING.counts.get(where, 0))
