"""What an engine span needs from its trajectory: worker, project and budget attributes.

An ``llm_request`` span from vLLM carries only the ids its ``traceparent`` gave it. To be
sampled with its trajectory (the same budget key, so the same keep/drop decision, including a
trajectory the head sampler already dropped and therefore never stored) and exported to the
same project, it takes these from the trajectory's tracecar spans: first from a bounded memory
of recently received trajectories (every batch of ``/v1/spans`` is remembered as it is
validated, kept or not), then from the store (after a restart).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, NamedTuple

from ..spool.store import Spool
from ..types import Span

OTLP_WORKER_PREFIX = "otlp:"  # the worker of OTLP spans that join no trajectory: otlp:<service.name>


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

    def remember(self, spans: Iterable[Span]) -> None:
        """Notes the trajectories of a validated ``/v1/spans`` batch (one entry per trace)."""
        if self.max_traces <= 0:
            return
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
