"""Sample: VERL-compatible budget at ingest (head-based), whole trajectories only.

``max_samples_per_step_per_worker = N`` keeps at most N distinct sample indices per
(experiment, step, worker, validate); every span of a kept sample is kept (all its
``rollout_n`` rollouts too) and every span of a dropped one is dropped, reward annotations
included, so no trajectory is ever split. Decisions are persisted with the spans they admit
(same transaction), so a restarted collector keeps honouring them. Spans without a step or
sample index (calls made outside any ``rollout_trace_attr``) are outside every budget and kept.

Which N: VERL draws them uniformly (``np.random.choice`` over the step's sample indices, per
worker). The VERL adapter announces each ``generate_sequences`` call's sample indices with a
*membership* span before any of its trajectories; on arrival the whole step is decided at once:
the N indices with the lowest ``sample_hash(seed, experiment, step, index)`` are kept. That is a
uniform, seeded, reproducible choice that does not depend on which trajectory finishes first.
An index nobody announced (a client that sends no membership, or one outside the list) falls
back to first-come within what is left of the budget; tail sampling (``tail_sampling=true``)
holds the step and fills by the same hash instead, for clients that cannot announce.

Fully-asynchronous VERL rolls out with ``step = -1`` for the whole run; there the trajectory's
``policy_version`` attribute (the parameter version its worker's rollout server reported,
stamped by the adapter) stands in for the step, so a worker keeps N samples per policy version
rather than N ever.

This is the head-based mode. With ``tail_sampling`` on (or any other budget set) the same limit
is enforced by the tail-based decision instead, which chooses by rules (errors, reward
extremes, spread, a seeded hash) once the step is seen; see :mod:`tracecar.collector.processors.sampling`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from ...spool.store import TRACE_DECISIONS
from ...types import Span
from .decide import index_order, sample_hash

SampleIndex = int | str
Decision = tuple[str, SampleIndex, bool]
MEMBERSHIP = "membership"  # the span kind announcing a step's sample indices (never stored)
#: VERL's step for fully-asynchronous rollouts (no trainer step is known in the rollouter).
ASYNC_STEP = -1


def is_sample_index(value: Any) -> TypeGuard[int | str]:
    return type(value) is int or type(value) is str


def budget_step(attrs: dict[str, Any]) -> tuple[int, int | None] | None:
    """(step, policy version or None) a span is budgeted under, or None if it has no step.

    The version matters only for ``step == -1`` (fully-async VERL), where it is the step.
    """
    step = attrs.get("step")
    if type(step) is not int:
        return None
    version = attrs.get("policy_version")
    return step, (version if step == ASYNC_STEP and type(version) is int else None)


def budget_key(experiment: Any, step: int, worker: str, validate: Any, version: int | None = None) -> str:
    key = f"{experiment}\x1f{step}\x1f{worker}\x1f{int(bool(validate))}"
    return key if version is None else f"{key}\x1fv{version}"


def choose(indices: list[SampleIndex], decided: dict[SampleIndex, bool], limit: int, seed: int,
           experiment: Any, hash_step: int) -> dict[SampleIndex, bool]:
    """Decisions for the undecided ``indices``: the lowest hashes fill what ``decided`` left free."""
    free = max(0, limit - sum(decided.values()))
    todo = sorted({i for i in indices if i not in decided},
                  key=lambda i: (sample_hash(seed, experiment, hash_step, i), index_order(i)))
    return {index: rank < free for rank, index in enumerate(todo)}


@dataclass
class SampleOutcome:
    kept: list[Span] = field(default_factory=list)
    dropped: list[Span] = field(default_factory=list)
    new_decisions: list[Decision] = field(default_factory=list)


class StepBudgetSampler:
    """Announced steps: N lowest hashes win; unannounced indices: first come within what is left."""

    def __init__(
        self,
        max_samples_per_step_per_worker: int | None,
        load_decisions: Callable[[str], dict[Any, bool]],
        max_cached_keys: int = 4096,
        limit_for: Callable[[Any, Any], int | None] | None = None,
        seed: int = 0,
        max_traces: int = 65536,
        seed_for: Callable[[Any, Any], int] | None = None,
        load_trace: Callable[[str], bool | None] | None = None,
    ) -> None:
        self.limit = max_samples_per_step_per_worker
        self._limit_for = limit_for  # per (experiment, validate) limit, when overrides exist
        self._load = load_decisions
        self._cache: OrderedDict[str, dict[SampleIndex, bool]] = OrderedDict()
        self._max_cached_keys = max_cached_keys
        self.seed = seed
        self._seed_for = seed_for  # per (experiment, validate) seed, when overrides exist
        # trace_id -> kept, so a trajectory's reward annotation (no step attributes) follows it; also
        # persisted (decisions under TRACE_DECISIONS) and read back by ``load_trace`` for one this cache lost
        # (a restart, or 65,536 trajectories since: the trainer's annotations come late)
        self._traces: OrderedDict[str, bool] = OrderedDict()
        self._max_traces = max_traces
        self._load_trace = load_trace

    def _limit(self, attrs: dict[str, Any], job_limit: int | None) -> int | None:
        limit = self.limit if self._limit_for is None else self._limit_for(attrs.get("experiment_name"), attrs.get("validate"))
        return job_limit if limit is None else limit

    def announce(self, memberships: list[Span], job_limit: int | None = None) -> list[Decision]:
        """Decides every announced sample index of each announced step at once (see module doc)."""
        out: list[Decision] = []
        for span in memberships:
            attrs = span["attributes"]
            where = budget_step(attrs)
            indices = attrs.get("sample_indices")
            if where is None or not isinstance(indices, list):
                continue
            limit = self._limit(attrs, job_limit)
            if limit is None:
                continue
            step, version = where
            key = budget_key(attrs.get("experiment_name"), step, span["worker"], attrs.get("validate"), version)
            decisions = self._decisions(key)
            hash_step = step if version is None else version
            experiment = attrs.get("experiment_name")
            seed = self.seed if self._seed_for is None else self._seed_for(experiment, attrs.get("validate"))
            for index, keep in choose([i for i in indices if is_sample_index(i)], decisions, limit, seed,
                                      experiment, hash_step).items():
                decisions[index] = keep
                out.append((key, index, keep))
        return out

    def sample(self, spans: list[Span], job_limit: int | None = None) -> SampleOutcome:
        """Decides each span; runs on the event loop (pure dict work, no I/O but a cache miss).

        ``job_limit`` is the budget the job sent with the batch (VERL's trace config, through
        the adapter); it applies where the collector's own settings set none. Annotations are
        decided after the batch's other spans, so a reward sent with its trajectory follows it.
        """
        out = SampleOutcome()
        if self.limit is None and self._limit_for is None and job_limit is None:
            out.kept = spans
            return out
        annotations = []
        persisted: set[str] = set()
        for span in spans:
            if span["kind"] == "annotation":
                annotations.append(span)
                continue
            attrs = span["attributes"]
            where, index = budget_step(attrs), attrs.get("sample_index")
            if where is None or not is_sample_index(index):
                out.kept.append(span)
                continue
            limit = self._limit(attrs, job_limit)
            if limit is None:
                out.kept.append(span)
                continue
            step, version = where
            key = budget_key(attrs.get("experiment_name"), step, span["worker"], attrs.get("validate"), version)
            decisions = self._decisions(key)
            keep = decisions.get(index)
            if keep is None:
                keep = sum(decisions.values()) < limit
                decisions[index] = keep
                out.new_decisions.append((key, index, keep))
            self._remember(span["trace_id"], keep)
            if span["trace_id"] not in persisted:  # each batch persists its trajectories' decisions (INSERT OR
                persisted.add(span["trace_id"])  # IGNORE): a concurrent batch's failed write cannot lose one
                out.new_decisions.append((TRACE_DECISIONS, span["trace_id"], keep))
            (out.kept if keep else out.dropped).append(span)
        for span in annotations:
            known = self._traces.get(span["trace_id"])
            if known is None and self._load_trace is not None:
                known = self._load_trace(span["trace_id"])
                self._remember(span["trace_id"], True if known is None else known)  # asked once per trajectory
            keep = True if known is None else known  # unknown: its trajectory was never budgeted
            (out.kept if keep else out.dropped).append(span)
        return out

    def forget(self, decisions: list[Decision]) -> None:
        """Undoes decisions whose spans were never committed (the write failed)."""
        for key, index, _ in decisions:
            if key == TRACE_DECISIONS:
                self._traces.pop(str(index), None)
                continue
            cached = self._cache.get(key)
            if cached is not None:
                cached.pop(index, None)

    def _remember(self, trace_id: str, keep: bool) -> None:
        traces = self._traces
        if trace_id in traces:
            traces.move_to_end(trace_id)
            return
        traces[trace_id] = keep
        if len(traces) > self._max_traces:
            traces.popitem(last=False)

    def _decisions(self, key: str) -> dict[SampleIndex, bool]:
        decisions = self._cache.get(key)
        if decisions is None:
            decisions = self._load(key)
            self._cache[key] = decisions
            if len(self._cache) > self._max_cached_keys:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return decisions
