"""Candidates: which of a node's trajectories can be in the gateway's kept set (docs/cluster.md).

A node collector with a gateway holds each step of a tail-budgeted experiment until its own view
of the step closes, then forwards only its *candidates*; the rest stay in its local store. That is
exact when the budget decomposes: every rule picks a top-k (or bottom-k) of one total order, and
a global top-k member is in the top-k of whichever part of the step holds it (node, round). So a
node proposes, per rule, its own top-k, and the gateway, deciding over the union with the same
:func:`~.decide.decide`, keeps what one collector that saw everything keeps.

Decomposable (``max_trajectories_per_step`` the only limit, trajectory by trajectory, no
``keep_spread_groups``): ``error`` (the first ``ceil(share × limit)`` error trajectories by the
sample hash), ``reward_max`` / ``reward_min`` (the ``keep_reward_extremes`` best / worst), ``fill``
(the first ``limit`` by the sample hash: a bottom-k, the uniform choice). Every other budget
falls back to sending everything: whole GRPO groups split across nodes (a group's error or best
rollout may be on another node), ``reward_spread`` (a split group's spread needs all its
rewards), byte and token limits and VERL's per-worker count (first fit can keep a unit far down
the order).

The uniform fill's inclusion probability k/n needs n, the job's units left to the fill: each
forwarded candidate root carries how many complete trajectories its node round did not send
(:data:`UNSENT_ATTR`, counted once per round by its tag), which the gateway adds to what it holds
(and to the ``count`` close) and strips before storing.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .decide import Candidate, Verdict, index_order, sample_hash
from .policy import Budget

#: where a node keeps the budgets it learned from its gateway (its data dir), so a restart holds as before
LEARNED_FILE = "gateway-budgets.json"
#: root attribute of a forwarded candidate: {"tag": <its node round>, "n": complete trajectories that round did not send}
UNSENT_ATTR = "tracecar_unsent"
CANDIDATE, NOT_CANDIDATE = "candidate", "not_candidate"


def decomposable(budget: Budget) -> bool:
    """Whether each node's own top-k per rule covers the global kept set (see the module doc)."""
    return (budget.mode == "tail" and not budget.group_unit and set(budget.limits()) == {"max_trajectories_per_step"}
            and (budget.max_trajectories_per_step or 0) >= 1 and budget.keep_spread_groups <= 0)


def choose(candidates: Sequence[Candidate], budget: Budget, experiment: Any, step: int) -> tuple[list[Verdict], int]:
    """Verdicts for one node round (kept: forward it; ``rule`` "candidate") and the complete trajectories not sent.

    Incomplete trajectories are always candidates: their root may still reach the gateway before its decision;
    so are those whose reward has not come when a reward rule is on (this node's reward wait may end before
    the gateway's would: the reward may still make it an extreme there).
    """
    if not decomposable(budget):  # held under budgets this node no longer knows (or that changed): send everything
        return [Verdict(c.trace_id, True, rule=CANDIDATE) for c in candidates], 0
    limit = budget.max_trajectories_per_step or 0
    seed = budget.sampling_seed
    hashes: dict[Any, int] = {}

    def order_of(c: Candidate) -> tuple[Any, ...]:  # decide()'s unit order, trajectory by trajectory
        h = hashes.get(c.sample_index)
        if h is None:
            h = hashes[c.sample_index] = sample_hash(seed, experiment, step, c.sample_index)
        return (h, index_order(c.sample_index), -1 if c.rollout_n is None else c.rollout_n, c.trace_id)

    complete = sorted((c for c in candidates if c.complete), key=order_of)
    k = budget.keep_reward_extremes
    chosen: set[str] = {c.trace_id for c in candidates if not c.complete or (k > 0 and c.reward is None)}
    chosen.update(c.trace_id for c in complete[:limit])  # fill: a bottom-k of the sample hash
    if budget.keep_errors_share > 0:
        quota = min(limit, math.ceil(budget.keep_errors_share * limit))
        chosen.update(c.trace_id for c in [c for c in complete if c.has_error][:quota])
    if k > 0:
        rewarded = [c for c in complete if c.reward is not None]
        chosen.update(c.trace_id for c in sorted(rewarded, key=lambda c: (-(c.reward or 0.0), order_of(c)))[:k])
        chosen.update(c.trace_id for c in sorted(rewarded, key=lambda c: (c.reward or 0.0, order_of(c)))[:k])
    verdicts = [Verdict(c.trace_id, True, rule=CANDIDATE) if c.trace_id in chosen
                else Verdict(c.trace_id, False, reason=NOT_CANDIDATE) for c in candidates]
    return verdicts, sum(1 for c in complete if c.trace_id not in chosen)


class LearnedPolicies:
    """The gateway's budgets as a node learned them (its heartbeat's answer), resolved as the gateway resolves them."""

    def __init__(self, description: dict[str, Any]) -> None:
        def budgets(pair: Any) -> tuple[Budget, Budget]:
            return Budget(**pair[0]), Budget(**pair[1])

        self.description = description
        self.default = budgets(description["default"])
        self.experiments = {str(e): budgets(pair) for e, pair in description.get("experiments", {}).items()}
        self.any_decomposable = any(decomposable(b) for pair in (self.default, *self.experiments.values()) for b in pair)

    def get(self, experiment: Any, validate: Any) -> Budget:
        pair = self.experiments.get(experiment, self.default) if isinstance(experiment, str) else self.default
        return pair[1 if validate else 0]


def describe(policies: Any, experiments: Sequence[str]) -> dict[str, Any]:
    """A gateway's resolved budgets, for its nodes (``LearnedPolicies`` reads it)."""
    def pair(experiment: Any) -> list[dict[str, Any]]:
        return [dataclasses.asdict(policies.get(experiment, v)) for v in (False, True)]

    return {"default": pair(None), "experiments": {e: pair(e) for e in experiments}}


def learn(description: Any) -> LearnedPolicies | None:
    """The node's view of the gateway's budgets, or None when it cannot read them (it then sends everything)."""
    try:
        return LearnedPolicies(description)
    except (TypeError, KeyError, ValueError, IndexError):
        return None


def load_learned(path: Path) -> Any:
    """The budgets a node learned before it restarted, or None."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def save_learned(path: Path, description: Any) -> None:
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(description))
        tmp.replace(path)
    except OSError:
        pass  # learned again from the next heartbeat answer
