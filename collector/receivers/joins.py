"""What an engine span needs from its trajectory: worker, project and budget attributes.

An ``llm_request`` span from vLLM carries only the ids its ``traceparent`` gave it. To be
sampled with its trajectory (the same budget key, so the same keep/drop decision, including a
trajectory the head sampler already dropped and therefore never stored) and exported to the
same project, it takes these from the trajectory's tracecar spans: first from a bounded memory
of recently received trajectories (every batch of ``/v1/spans`` is remembered as it is
validated, kept or not), then from the store (after a restart).

An engine span sent without any parent context (VERL's ``enable_otel``) names only its request:
``gen_ai.request.id``. The client notes on each call the request ids it handed an engine
(``tracecar.client.engine_request``: the ``engine_request_ids`` attribute), and
:class:`EngineRequests` remembers, per request id, the call that sent it, so such a span is
re-keyed under that call (:func:`rekey`) and then joins the trajectory as any other.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from tracecar.client.tracing import ENGINE_REQUESTS, MARK  # ids a call handed an engine; a span's place (Weave)

from ..spool.store import Spool
from ..types import Span

OTLP_WORKER_PREFIX = "otlp:"  # the worker of OTLP spans that join no trajectory: otlp:<service.name>
REQUEST_ID = "gen_ai.request.id"  # vLLM's (and SGLang's) request id on its per-request span
_PD_LEGS = ("_P", "_D")  # VERL's prefill/decode legs of one request: "<id>_P", "<id>_D" (PD disaggregation)
_MAX_REQUEST_ID = 256


class TrajectoryContext(NamedTuple):
    worker: str  # every span has its batch's worker (validate_batch)
    project: str | None
    entity: str | None
    experiment: Any
    step: int | None
    sample_index: int | str | None
    rollout_n: int | None
    validate: bool | None

    def apply(self, span: Span) -> None:
        """Gives ``span`` this trajectory's worker and project, and its budget attributes where unset."""
        span["worker"], span["project"], span["entity"] = self.worker, self.project, self.entity
        attrs = span["attributes"]
        for key, value in (("experiment_name", self.experiment), ("step", self.step), ("sample_index", self.sample_index),
                           ("rollout_n", self.rollout_n), ("validate", self.validate)):
            if value is not None:
                attrs.setdefault(key, value)


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _index(value: Any) -> int | str | None:
    """VERL's sample index: an int or a string (``extra_info.index``)."""
    return value if type(value) is int or type(value) is str else None


class TrajectoryContexts:
    """Bounded LRU of trace id → :class:`TrajectoryContext`; thread-safe (ingest threads write, OTLP reads)."""

    def __init__(self, spool: Spool, max_traces: int) -> None:
        self.spool = spool
        self.max_traces = max_traces
        self._items: OrderedDict[str, TrajectoryContext] = OrderedDict()
        self._lock = threading.Lock()
        # the engine requests each call sent (as many as trajectories: a few per trajectory, small entries)
        self.requests = EngineRequests(4 * max_traces)

    def remember(self, spans: Iterable[Span]) -> None:
        """Notes the trajectories of a validated ``/v1/spans`` batch (one entry per trace), and the
        engine requests its calls sent."""
        if self.max_traces <= 0:
            return
        spans = spans if isinstance(spans, list) else list(spans)
        self.requests.remember(spans)
        last = None
        fresh: list[tuple[str, TrajectoryContext]] = []
        for span in spans:
            trace_id = span["trace_id"]
            if trace_id == last or span["kind"] == "annotation":
                continue
            last = trace_id
            a = span["attributes"]
            validate = a.get("validate")
            fresh.append((trace_id, TrajectoryContext(
                span.get("worker"), span.get("project"), span.get("entity"), a.get("experiment_name"),
                _int(a.get("step")), _index(a.get("sample_index")), _int(a.get("rollout_n")),
                validate if type(validate) is bool else None)))
        if not fresh:
            return
        with self._lock:
            items = self._items
            for trace_id, context in fresh:
                items[trace_id] = context
                items.move_to_end(trace_id)
            while len(items) > self.max_traces:
                items.popitem(last=False)

    def lookup(self, trace_id: str) -> tuple[TrajectoryContext | None, str]:
        """The trajectory's context and where it was found: ``memory``, ``store``, or (None, ``none``)."""
        with self._lock:
            found = self._items.get(trace_id)
        if found is not None:
            return found, "memory"
        rows = self.spool.query(
            "SELECT worker, project, entity, experiment, step, sample_index, rollout_n, validate FROM spans"
            " WHERE trace_id = ? AND kind != 'annotation' ORDER BY worker LIKE ?, step IS NULL, seq LIMIT 1",
            [trace_id, OTLP_WORKER_PREFIX + "%"])
        if not rows or str(rows[0]["worker"] or "").startswith(OTLP_WORKER_PREFIX):
            return None, "none"
        row = rows[0]
        return TrajectoryContext(row["worker"], row["project"], row["entity"], row["experiment"], row["step"],
                                 row["sample_index"], row["rollout_n"],
                                 None if row["validate"] is None else bool(row["validate"])), "store"


def request_id_of(span: Span) -> str | None:
    """The engine request id a parentless OTLP span names (``gen_ai.request.id``), or None."""
    value = span["attributes"].get(REQUEST_ID)
    return value if type(value) is str and 0 < len(value) <= _MAX_REQUEST_ID else None


class EngineRequest(NamedTuple):
    """The call that handed an engine one request: its trace, its id, and where an engine span under it
    sits in the Weave tree (the client's ``tracestate`` entry: ``top``, ``<root>`` or ``<root>.<turn>``)."""

    trace_id: str
    span_id: str
    place: str | None


def _place(span: Span) -> str | None:
    """What ``tracecar.client.traceparent.tracestate()`` would have said for this call."""
    mark = span["attributes"].get(MARK)
    if not isinstance(mark, dict):
        return None
    if mark.get("trajectory") is True and span.get("parent_id") is None:
        return "top"
    if mark.get("top") is True:
        return span["span_id"]
    root, turn = mark.get("root"), mark.get("turn")
    return f"{root}.{turn}" if isinstance(root, str) and isinstance(turn, str) else None


class EngineRequests:
    """Bounded LRU of engine request id → :class:`EngineRequest` (thread-safe).

    Fed by every validated ``/v1/spans`` batch; ``on_unmatched`` is called with the number of
    request ids forgotten (evicted) before any engine span named them, once engine spans have
    joined by request id at all (a job whose engine traces nothing is not told so per request)."""

    def __init__(self, max_requests: int, on_unmatched: Callable[[int], None] | None = None) -> None:
        self.max_requests = max_requests
        self.on_unmatched = on_unmatched
        self.recorded_any = False  # some client notes its engine requests: parentless engine spans may wait for them
        self.matched_any = False  # some engine span named one: from then on a request never named is worth counting
        self._items: OrderedDict[str, tuple[EngineRequest, bool]] = OrderedDict()  # -> (call, matched)
        self._lock = threading.Lock()

    def remember(self, spans: Iterable[Span]) -> None:
        if self.max_requests <= 0:
            return
        fresh: list[tuple[str, EngineRequest]] = []
        for span in spans:
            ids = span["attributes"].get(ENGINE_REQUESTS)
            if type(ids) is not list or span["kind"] == "annotation":
                continue
            call = EngineRequest(span["trace_id"], span["span_id"], _place(span))
            fresh.extend((rid, call) for rid in ids if type(rid) is str and 0 < len(rid) <= _MAX_REQUEST_ID)
        if not fresh:
            return
        evicted = 0
        with self._lock:
            self.recorded_any = True
            items = self._items
            for rid, call in fresh:
                known = items.get(rid)
                items[rid] = (call, known is not None and known[0] == call and known[1])
                items.move_to_end(rid)
            while len(items) > self.max_requests:
                _, (_, matched) = items.popitem(last=False)
                evicted += not matched
        if evicted and self.matched_any and self.on_unmatched is not None:  # not when the engine traces nothing at all
            self.on_unmatched(evicted)

    def lookup(self, request_id: str) -> EngineRequest | None:
        """The call that sent ``request_id`` (or, for VERL's ``<id>_P`` / ``<id>_D`` legs, ``<id>``)."""
        keys = [request_id]
        if request_id[-2:] in _PD_LEGS:
            keys.append(request_id[:-2])
        with self._lock:
            for key in keys:
                found = self._items.get(key)
                if found is not None:
                    if not found[1]:
                        self._items[key] = (found[0], True)
                    self.matched_any = True
                    return found[0]
        return None


def rekey(span: Span, call: EngineRequest) -> None:
    """Puts a parentless engine span under the call that sent its request: that call's trace and
    parent id, and the Weave place its ``tracestate`` would have given. Its own span id (made from
    its OTLP trace id, so a resend is still a duplicate) and its OTel ids (under ``otel``) stay."""
    span["trace_id"], span["parent_id"] = call.trace_id, call.span_id
    otel = span["attributes"].get("otel")
    if isinstance(otel, dict):
        otel["joined_by"] = REQUEST_ID
    if call.place == "top":
        span["attributes"][MARK] = {"top": True}
    elif call.place and "." in call.place:
        root, turn = call.place.split(".", 1)
        span["attributes"][MARK] = {"root": root, "turn": turn}
    elif call.place:
        span["attributes"][MARK] = {"root": call.place, "turn": span["span_id"]}
