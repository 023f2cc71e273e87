"""Engine spans that arrive before their trajectory: stored, but sent nowhere until its destination is known.

vLLM's ``llm_request`` span carries only the ids its ``traceparent`` gave it; the project (MLflow's
experiment, Phoenix's project) and the budget attributes come from its trajectory's own spans
(:mod:`.joins`). When the engine's exporter is quicker than the worker's client, the engine span
is the first of its trajectory to reach the collector; sent at once it would go to the default
experiment, and MLflow files the whole trace under the first experiment it sees. So such a span
is committed to the spool (acknowledged, durable) in the ``AWAITING`` state, which no exporter
reads, and settled when its trajectory shows up:

* its trajectory's spans arrive (``/v1/spans``, or an engine span that joined): the span takes
  the trajectory's worker, project and budget attributes (payload and index columns rewritten)
  and goes out with it: pending, or held when the trajectory is held for a tail-based decision;
  if a budget dropped the trajectory, the span is dropped with it;
* a root without a parent arrives over OTLP for the same trace: it is another producer's trace,
  whose destination is the default one, and the span is released as it is;
* neither within ``TRACECAR_OTLP_HOLD_MAX_AGE_S``, or more than ``TRACECAR_OTLP_HOLD_MAX_SPANS``
  are waiting: the oldest are released as they are (the default experiment, as before), logged
  and counted, so nothing acknowledged is ever kept from the backends for good.

A parentless engine span that names its request (``gen_ai.request.id``: VERL's ``enable_otel``
sends no parent context) waits the same way, under its own trace id, for the call that sent
that request (:class:`.joins.EngineRequests`); when that call arrives the span is re-keyed under
it (:func:`.joins.rekey`: its trace and parent) and joins its trajectory as above. It waits only
where such a join can come: its resource names an ``experiment_name`` (as VERL's does), or some
client has noted its engine requests since the collector started; other parentless spans are
other producers' traces and never wait. Those joins are also counted in
``tracecar_otlp_request_joins_total{outcome}``.

Every outcome is counted in ``tracecar_otlp_held_spans_total{outcome}``; the spans waiting now
in ``tracecar_otlp_held_spans``. Whether a span waits does not depend on the client's version:
old clients (``traceparent`` without ``tracestate``) are held the same way. All spool work runs on
the spool's writer thread, after each write, so a trajectory and its early engine span cannot
pass each other unseen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from ..loudness import RateLimited
from ..metrics import Metrics
from ..processors.span_work import pack_payload
from ..spool.store import HELD, PENDING, Spool
from ..types import Span
from .joins import ENGINE_REQUESTS, OTLP_WORKER_PREFIX, TrajectoryContexts, rekey, request_id_of

log = logging.getLogger("tracecar.collector.engine_hold")

OUTCOMES = ("held", "joined", "dropped", "foreign", "expired", "overflow")


class EngineHold:
    """The engine spans waiting for their trajectory, by trace id (rebuilt from the spool at start)."""

    def __init__(self, spool: Spool, contexts: TrajectoryContexts, metrics: Metrics, *, max_spans: int,
                 max_age_s: float) -> None:
        self.spool = spool
        self.contexts = contexts
        self.metrics = metrics
        self.max_spans = max_spans
        self.max_age_s = max_age_s
        self.enabled = max_spans > 0 and max_age_s > 0
        # by trace id only where a destination is at stake: in a local-only store a span with its trajectory's
        # trace id is in that trajectory already; one that names only its request must still wait to get there
        self.by_trace = self.enabled and not spool.local_only
        self._lock = threading.Lock()  # traces is read by receiver threads, written on the writer thread
        self.traces: dict[str, int] = spool.awaiting_traces() if self.enabled else {}
        # parentless engine spans waiting for the call that sent their request: request id -> their own
        # trace ids, and back
        self.requests: dict[str, set[str]] = {}
        self.request_of: dict[str, str] = {}
        if self.enabled:
            for trace_id, request_id in self._awaiting_requests():
                self._wait_for_request(trace_id, request_id)
        self._released = RateLimited(30.0)
        metrics.otlp_held_spans.set_function(lambda: spool.awaiting_count)
        contexts.requests.on_unmatched = lambda n: metrics.otlp_request_joins.labels(outcome="request_unmatched").inc(n)

    def _awaiting_requests(self) -> list[tuple[str, str]]:
        """(own trace id, request id) of the parentless engine spans stored waiting (after a restart)."""
        out = []
        for row in self.spool.query("SELECT trace_id, payload FROM spans WHERE state = 4 AND parent_id IS NULL"):
            try:
                request_id = request_id_of(orjson.loads(row["payload"]))
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
            if request_id is not None:
                out.append((row["trace_id"], request_id))
        return out

    def _wait_for_request(self, trace_id: str, request_id: str) -> None:
        with self._lock:
            self.requests.setdefault(request_id, set()).add(trace_id)
            self.request_of[trace_id] = request_id

    def should_hold_request(self, span: Span) -> bool:
        """A parentless engine span naming its request waits for the call that sent it where such a
        call can come: VERL's resource (``experiment_name``), or a client that notes its requests."""
        if not self.enabled or span.get("parent_id") is not None or request_id_of(span) is None:
            return False
        if self.contexts.requests.recorded_any:
            return True
        otel = span["attributes"].get("otel")
        resource = otel.get("resource") if isinstance(otel, dict) else None
        return isinstance(resource, dict) and isinstance(resource.get("experiment_name"), str)

    def should_hold(self, span: Span, found: bool, foreign_roots: set[str]) -> bool:
        """An OTLP span whose trajectory is not known (``found`` False) and that names a parent waits,
        unless its trace's own root came in the same request (another producer's trace)."""
        return self.by_trace and not found and span.get("parent_id") is not None and span["trace_id"] not in foreign_roots

    def waiting(self, trace_id: str) -> bool:
        with self._lock:
            return trace_id in self.traces

    # ---- on the spool's writer thread ------------------------------------------------------------
    def after_write(self, spans: Iterable[Span], held: Iterable[str], foreign_roots: Iterable[str] = (),
                    held_requests: Mapping[str, str] | None = None) -> int:
        """Settles what the batch just written decides; returns the spans released (to wake the forwarders).

        ``held``: trace ids of spans this batch stored AWAITING; ``foreign_roots``: traces whose
        parentless OTLP root this batch brought; ``held_requests``: own trace id -> request id of
        the parentless engine spans among ``held``, waiting for the call that sent their request."""
        if not self.enabled:
            return 0
        new = list(held)
        with self._lock:
            for trace_id in new:
                self.traces[trace_id] = self.traces.get(trace_id, 0) + 1
        for trace_id, request_id in (held_requests or {}).items():
            self._wait_for_request(trace_id, request_id)
        if new:
            self.metrics.otlp_held.labels(outcome="held").inc(len(new))
        released = 0
        for trace_id in set(foreign_roots):
            if self.waiting(trace_id) and trace_id not in self.request_of:
                released += self._settle(trace_id, "foreign", PENDING)
        seen: set[str] = set()
        for span in spans:
            trace_id = span["trace_id"]
            ids = span["attributes"].get(ENGINE_REQUESTS) if self.requests else None
            if type(ids) is list:  # a call that sent requests engine spans wait for
                for request_id in ids:
                    for waiting in self._waiting_for(request_id):
                        released += self.try_join_request(waiting)
            if trace_id in seen or not self.waiting(trace_id):
                continue
            seen.add(trace_id)
            released += self.try_join(trace_id)
        for trace_id in set(new) - seen:  # its trajectory (or call) may have been remembered after this span looked
            released += self.try_join_request(trace_id) if trace_id in self.request_of else self.try_join(trace_id)
        return released + self._bound()

    def _waiting_for(self, request_id: Any) -> list[str]:
        if type(request_id) is not str:
            return []
        with self._lock:
            found = set(self.requests.get(request_id, ()))
            for leg in ("_P", "_D"):  # VERL's prefill/decode legs of this request
                found |= self.requests.get(request_id + leg, set())
        return sorted(found)

    def try_join_request(self, trace_id: str) -> int:
        """Joins a waiting parentless engine span (its own ``trace_id``) to the call that sent its
        request, and so to that call's trajectory, if both are known and stored; 0 when not yet."""
        request_id = self.request_of.get(trace_id)
        call = self.contexts.requests.lookup(request_id) if request_id is not None else None
        if call is None:
            return 0
        context, _ = self.contexts.lookup(call.trace_id)
        if context is None:
            return 0
        state = self.spool.trajectory_state(call.trace_id, OTLP_WORKER_PREFIX)
        if state is None:
            if self._dropped(call.trace_id):
                self._settle(trace_id, "dropped", None)
            return 0

        def patch(span: Any) -> tuple[tuple[Any, ...], bytes, int, int]:
            rekey(span, call)
            return _columns(span, context)

        n = self._settle(trace_id, "joined", HELD if state == HELD else PENDING, patch)
        self.metrics.otlp_request_joins.labels(outcome="joined_late").inc(n)
        return n

    def try_join(self, trace_id: str) -> int:
        """Joins the trace's waiting spans to their trajectory if it is known and stored (or drops
        them with it); 0 when it is not yet."""
        context, _ = self.contexts.lookup(trace_id)
        if context is None:
            return 0
        state = self.spool.trajectory_state(trace_id, OTLP_WORKER_PREFIX)
        if state is None:  # remembered but not stored: dropped by a budget, or its batch not written yet
            if self._dropped(trace_id):
                self._settle(trace_id, "dropped", None)
            return 0

        def patch(span: Any) -> tuple[tuple[Any, ...], bytes, int, int]:
            return _columns(span, context)

        return self._settle(trace_id, "joined", HELD if state == HELD else PENDING, patch)

    def _dropped(self, trace_id: str) -> bool:
        """True when a budget decided this trajectory away (head or tail decision persisted)."""
        if self.spool.load_trace_decision(trace_id) is False:
            return True
        return self.spool.trace_verdict(trace_id) is False

    def expire(self, now: float | None = None) -> int:
        """Releases, as they are, the spans that waited longer than the age bound; returns how many."""
        if not self.enabled or not self.traces:
            return 0
        before = (time.time() if now is None else now) - self.max_age_s
        released = 0
        for trace_id in self.spool.oldest_awaiting(1000, before=before):
            released += self._settle(trace_id, "expired", PENDING)
        return released

    def _bound(self) -> int:
        released = 0
        while self.spool.awaiting_count > self.max_spans:
            oldest = self.spool.oldest_awaiting(max(1, min(1000, self.spool.awaiting_count - self.max_spans)))
            if not oldest:
                break
            for trace_id in oldest:
                released += self._settle(trace_id, "overflow", PENDING)
                if self.spool.awaiting_count <= self.max_spans:
                    break
        return released

    def _settle(self, trace_id: str, outcome: str, target: int | None, patch: Any = None) -> int:
        n = self.spool.settle_awaiting(trace_id, target, patch)
        with self._lock:
            self.traces.pop(trace_id, None)
            request_id = self.request_of.pop(trace_id, None)
            if request_id is not None:
                waiting = self.requests.get(request_id)
                if waiting is not None:
                    waiting.discard(trace_id)
                    if not waiting:
                        del self.requests[request_id]
        if n and request_id is not None and outcome in ("expired", "overflow"):
            self.metrics.otlp_request_joins.labels(outcome="engine_unmatched").inc(n)
        if n:
            self.metrics.otlp_held.labels(outcome=outcome).inc(n)
            if outcome in ("expired", "overflow") and (times := self._released.hit()) is not None:
                log.warning("engine spans released without their trajectory (%s, TRACECAR_OTLP_HOLD_MAX_%s): %d of "
                            "trace %s, %d such release(s) since the last line; they go to the default destination",
                            outcome, "AGE_S" if outcome == "expired" else "SPANS", n, trace_id, times,
                            extra={"event": "otlp_hold_released", "outcome": outcome, "trace_id": trace_id})
        return n if target is not None else 0


def _columns(span: Any, context: Any) -> tuple[tuple[Any, ...], bytes, int, int]:
    """A waiting span given its trajectory's context: (its index columns, payload, inputs_at, output_at)."""
    context.apply(span)
    a = span["attributes"]
    validate = a.get("validate")
    columns = (span["trace_id"], span.get("parent_id"), span["worker"], span.get("project"), span.get("entity"),
               _typed(a.get("experiment_name"), str), _typed(a.get("step"), int), _typed(a.get("sample_index"), (int, str)),
               _typed(a.get("rollout_n"), int), None if validate is None else int(bool(validate)))
    payload, inputs_at, output_at = pack_payload(span)
    return columns, payload, inputs_at, output_at


def _typed(value: Any, types: Any) -> Any:
    return value if isinstance(value, types) and not isinstance(value, bool) else None
