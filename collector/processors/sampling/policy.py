"""Policy: the budget that applies to one (experiment, validate), resolved from the settings.

Layers, later wins: the top-level CollectorSettings fields; ``validation_budget`` (validate=True
steps only); ``budgets[experiment]``; ``budgets[experiment].validation``. In an override a field
left out inherits and a field given as ``null`` removes the limit (pydantic's fields_set tells
them apart). Each (experiment, validate) is resolved once and cached.

Mode: ``pass`` (no budget: keep everything, forward at once), ``head`` (only
``max_samples_per_step_per_worker``, tail sampling not asked for: VERL's first-N-seen at ingest),
``tail`` (hold spans, decide each step on whole trajectories, see :mod:`.decide`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ...settings import BudgetOverride, CollectorSettings

BUDGET_FIELDS = tuple(f for f in BudgetOverride.model_fields if f != "validation")
#: Limits that only a tail-based decision can enforce (they need whole trajectories or steps).
TAIL_LIMITS = ("max_trajectories_per_step", "max_groups_per_step", "max_bytes_per_step",
               "max_tokens_per_step", "max_trajectory_bytes")
LIMIT_NAMES = ("max_samples_per_step_per_worker",) + TAIL_LIMITS[:4]

Mode = Literal["pass", "head", "tail"]


@dataclass(frozen=True)
class Budget:
    """Resolved budget and rule quotas for one (experiment, validate)."""

    mode: Mode
    max_samples_per_step_per_worker: int | None = None
    max_trajectories_per_step: int | None = None
    max_groups_per_step: int | None = None
    max_bytes_per_step: int | None = None
    max_tokens_per_step: int | None = None
    max_trajectory_bytes: int | None = None
    trajectories_per_step: int | None = None
    keep_errors_share: float = 0.25
    keep_reward_extremes: int = 1
    keep_spread_groups: int = 1
    sampling_seed: int = 0
    keep_groups_whole: bool = True

    @property
    def group_unit(self) -> bool:
        """Whole sample groups are the unit of decision when a budget counts samples, and by default
        (``keep_groups_whole``): a GRPO group judged on the rollouts a budget happened to keep misleads.
        Without GRPO (one rollout per sample index) a group is one trajectory, so nothing changes."""
        return (self.keep_groups_whole or self.max_samples_per_step_per_worker is not None
                or self.max_groups_per_step is not None)

    def limits(self) -> dict[str, int]:
        """The step limits that are set, by setting name."""
        return {name: getattr(self, name) for name in LIMIT_NAMES if getattr(self, name) is not None}

    @classmethod
    def from_values(cls, values: dict[str, Any], where: str) -> Budget:
        tail_only = [name for name in TAIL_LIMITS if values.get(name) is not None]
        tail = values.get("tail_sampling")
        if tail is False and tail_only:
            raise ValueError(f"{where}: {', '.join(tail_only)} need tail_sampling (it is false)")
        if tail is None:
            tail = bool(tail_only)
        if tail:
            mode: Mode = "tail"
        elif values.get("max_samples_per_step_per_worker") is not None:
            mode = "head"
        else:
            mode = "pass"
        return cls(mode=mode, **{k: v for k, v in values.items() if k != "tail_sampling"})


class Policies:
    """Budget lookup by (experiment, validate); every configured combination is checked at start."""

    def __init__(self, settings: CollectorSettings) -> None:
        self.settings = settings
        self._cache: dict[tuple[Any, bool], Budget] = {}
        for experiment in (None, *settings.budgets):
            for validate in (False, True):
                self.get(experiment, validate)

    def get(self, experiment: Any, validate: Any) -> Budget:
        key = (experiment, bool(validate))
        budget = self._cache.get(key)
        if budget is None:
            budget = self._cache[key] = self._resolve(experiment, bool(validate))
        return budget

    @property
    def any_tail(self) -> bool:
        return any(b.mode == "tail" for b in self._cache.values())

    @property
    def any_limit(self) -> bool:
        return any(b.mode != "pass" for b in self._cache.values())

    def _resolve(self, experiment: Any, validate: bool) -> Budget:
        s = self.settings
        values: dict[str, Any] = {name: getattr(s, name) for name in BUDGET_FIELDS}
        layers: list[BudgetOverride] = []
        if validate and s.validation_budget is not None:
            layers.append(s.validation_budget)
        override = s.budgets.get(experiment) if isinstance(experiment, str) else None
        if override is not None:
            layers.append(override)
            if validate and override.validation is not None:
                layers.append(override.validation)
        for layer in layers:
            for name in layer.model_fields_set:
                if name != "validation":
                    values[name] = getattr(layer, name)
        where = f"budget of experiment {experiment!r}" if experiment is not None else "budget"
        return Budget.from_values(values, where + (" (validation steps)" if validate else ""))
