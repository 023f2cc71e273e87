"""Sample: VERL-compatible budget at ingest (head-based), whole trajectories only.

``max_samples_per_step_per_worker = N`` keeps at most N distinct sample indices per
(experiment, step, worker, validate); every span of a kept sample is kept (all its
``rollout_n`` rollouts too) and every span of a dropped one is dropped, so no trajectory is
ever split. Decisions are persisted with the spans they admit (same transaction), so a
restarted collector keeps honouring them. Spans without a step or sample index (calls made
outside any ``rollout_trace_attr``) are outside every budget and kept.

This is the head-based mode: the first N indices to arrive win. With ``tail_sampling`` on (or
any other budget set) the same limit is enforced by the tail-based decision instead, which
chooses by rules (errors, reward extremes, spread, a seeded hash) once the step is seen; see
:mod:`tracecar.collector.selection`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

Decision = tuple[str, int, bool]


def budget_key(experiment: Any, step: int, worker: str, validate: Any) -> str:
    return f"{experiment}\x1f{step}\x1f{worker}\x1f{int(bool(validate))}"


@dataclass
class SampleOutcome:
    kept: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)
    new_decisions: list[Decision] = field(default_factory=list)


class StepBudgetSampler:
    """First N distinct sample indices seen per budget key win; the rest are sampled out."""

    def __init__(
        self,
        max_samples_per_step_per_worker: int | None,
        load_decisions: Callable[[str], dict[int, bool]],
        max_cached_keys: int = 4096,
        limit_for: Callable[[Any, Any], int | None] | None = None,
    ) -> None:
        self.limit = max_samples_per_step_per_worker
        self._limit_for = limit_for  # per (experiment, validate) limit, when overrides exist
        self._load = load_decisions
        self._cache: OrderedDict[str, dict[int, bool]] = OrderedDict()
        self._max_cached_keys = max_cached_keys

    def sample(self, spans: list[dict[str, Any]], job_limit: int | None = None) -> SampleOutcome:
        """Decides each span; runs on the event loop (pure dict work, no I/O but a cache miss).

        ``job_limit`` is the budget the job sent with the batch (VERL's trace config, through
        the adapter); it applies where the collector's own settings set none.
        """
        out = SampleOutcome()
        if self.limit is None and self._limit_for is None and job_limit is None:
            out.kept = spans
            return out
        for span in spans:
            attrs = span["attributes"]
            step, index = attrs.get("step"), attrs.get("sample_index")
            if type(step) is not int or type(index) is not int:
                out.kept.append(span)
                continue
            limit = self.limit if self._limit_for is None else self._limit_for(attrs.get("experiment_name"), attrs.get("validate"))
            if limit is None:
                limit = job_limit
            if limit is None:
                out.kept.append(span)
                continue
            key = budget_key(attrs.get("experiment_name"), step, span["worker"], attrs.get("validate"))
            decisions = self._decisions(key)
            keep = decisions.get(index)
            if keep is None:
                keep = sum(decisions.values()) < limit
                decisions[index] = keep
                out.new_decisions.append((key, index, keep))
            (out.kept if keep else out.dropped).append(span)
        return out

    def forget(self, decisions: list[Decision]) -> None:
        """Undoes decisions whose spans were never committed (the write failed)."""
        for key, index, _ in decisions:
            cached = self._cache.get(key)
            if cached is not None:
                cached.pop(index, None)

    def _decisions(self, key: str) -> dict[int, bool]:
        decisions = self._cache.get(key)
        if decisions is None:
            decisions = self._load(key)
            self._cache[key] = decisions
            if len(self._cache) > self._max_cached_keys:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return decisions
