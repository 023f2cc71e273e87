"""Decide: which trajectories of one step (one round of it) a budget keeps, and why.

Pure function of the step's trajectory summaries, the resolved :class:`~.policy.Budget`, and
what earlier rounds of the same step already kept; the order summaries are given in does not
matter (every ordering below ends in a content tie-break), so reruns and restarts agree.

Unit of decision: the sample group (every rollout of one sample index in the step) when a budget
counts samples (``max_samples_per_step_per_worker`` or ``max_groups_per_step``), so all rollouts
of a kept sample stay together, as in VERL; otherwise the single trajectory. Only trajectories
whose root has arrived are candidates; the others are dropped as ``incomplete``, so no partial
trajectory is ever forwarded as if whole.

Rules, in priority order, each admitting a unit only if it fits every step limit on top of what
is already kept (first fit: a unit that does not fit is skipped, the next one is tried):

1. ``error``: units with an exception on any span (a raised trajectory or a failed tool call),
   in hash order, within their own quota: ``keep_errors_share`` of each limit, rounded up.
2. ``reward_max`` / ``reward_min``: the ``keep_reward_extremes`` highest and lowest rewards of the
   step (a group ranks by its best / worst rollout), alternating high and low; one already kept
   by the error rule counts as covered; one that does not fit gives way to the next.
3. ``reward_spread``: the ``keep_spread_groups`` groups with the widest reward spread
   (max - min > 0 over at least two rewarded rollouts), kept whole.
4. ``fill``: everything else in order of ``blake2b(seed, experiment, step, sample_index)`` (then
   rollout_n), so several collectors and reruns choose the same samples. Where a count is the only
   limit this is a uniform draw (a bottom-k of the hash): each unit the fill kept carries its
   inclusion probability k/n (:func:`uniform_fill`).

A unit dropped carries the limit that stopped it in the fill pass. Later rounds (trajectories
that arrive after their step was decided) start from the earlier rounds' usage, so budgets stay
exact; rule quotas are shared across rounds; a late rollout of a sample group decided earlier
follows that group's decision (``same_group``) when it fits.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .policy import Budget

#: A VERL sample index: ``extra_info.index`` as the dataset has it, an int or a string.
SampleIndex = int | str

#: Bytes a root grows by when ``kept_because`` is written into it (a bound, counted in the cost).
KEPT_MARK_BYTES = 48

RULES = ("error", "reward_max", "reward_min", "reward_spread", "fill", "same_group")


@dataclass(slots=True)
class Candidate:
    """What a decision needs to know about one trajectory (no payloads)."""

    trace_id: str
    worker: str
    sample_index: SampleIndex
    rollout_n: int | None
    has_error: bool
    reward: float | None
    nbytes: int
    tokens: int
    complete: bool


@dataclass(slots=True)
class Verdict:
    trace_id: str
    keep: bool
    rule: str | None = None
    reason: str | None = None
    # kept by a uniform fill: the chance it had (k of the n units left to the fill); see uniform_fill
    inclusion_probability: float | None = None


@dataclass
class Usage:
    """What a step has kept so far, in every dimension a limit can count."""

    trajectories: int = 0
    bytes: int = 0
    tokens: int = 0
    groups: set[SampleIndex] = field(default_factory=set)
    worker_samples: dict[str, set[SampleIndex]] = field(default_factory=dict)

    def copy(self) -> Usage:
        return Usage(self.trajectories, self.bytes, self.tokens, set(self.groups),
                     {w: set(s) for w, s in self.worker_samples.items()})

    def add(self, unit: Unit) -> None:
        self.trajectories += len(unit.members)
        self.bytes += unit.bytes
        self.tokens += unit.tokens
        for c in unit.members:
            self.groups.add(c.sample_index)
            self.worker_samples.setdefault(c.worker, set()).add(c.sample_index)

    def blocked_by(self, unit: Unit, limits: dict[str, int]) -> str | None:
        """The first limit ``unit`` would exceed on top of this usage, or None if it fits."""
        if not limits:
            return None
        n = limits.get("max_trajectories_per_step")
        if n is not None and self.trajectories + len(unit.members) > n:
            return "max_trajectories_per_step"
        n = limits.get("max_groups_per_step")
        if n is not None and len(self.groups | {c.sample_index for c in unit.members}) > n:
            return "max_groups_per_step"
        n = limits.get("max_samples_per_step_per_worker")
        if n is not None:
            new: dict[str, set[SampleIndex]] = {}
            for c in unit.members:
                if c.sample_index not in self.worker_samples.get(c.worker, ()):
                    new.setdefault(c.worker, set()).add(c.sample_index)
            if any(len(self.worker_samples.get(w, ())) + len(s) > n for w, s in new.items()):
                return "max_samples_per_step_per_worker"
        n = limits.get("max_bytes_per_step")
        if n is not None and self.bytes + unit.bytes > n:
            return "max_bytes_per_step"
        n = limits.get("max_tokens_per_step")
        if n is not None and self.tokens + unit.tokens > n:
            return "max_tokens_per_step"
        return None


@dataclass
class Prior:
    """What earlier rounds of the step decided (empty for a step's first decision)."""

    usage: Usage = field(default_factory=Usage)
    error_usage: Usage = field(default_factory=Usage)
    rule_units: dict[str, int] = field(default_factory=dict)
    groups: dict[SampleIndex, bool] = field(default_factory=dict)  # sample_index -> kept (group unit only)


@dataclass
class Unit:
    members: list[Candidate]
    order: tuple[Any, ...]
    bytes: int
    tokens: int

    @property
    def has_error(self) -> bool:
        return any(c.has_error for c in self.members)

    def rewards(self) -> list[float]:
        return [c.reward for c in self.members if c.reward is not None]


def sample_hash(seed: int, experiment: Any, step: int, sample_index: SampleIndex) -> int:
    """The fill order: same (seed, experiment, step, sample_index) → same rank everywhere.

    Also the head mode's uniform choice over a step's announced sample indices
    (:mod:`tracecar.collector.processors.sampling.head`), so both modes pick the same samples for one seed.
    """
    key = f"{seed}\x1f{experiment}\x1f{step}\x1f{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def index_order(sample_index: SampleIndex) -> tuple[int, int, str]:
    """A sort key for a mix of int and string indices (ints first, then strings)."""
    return (0, sample_index, "") if type(sample_index) is int else (1, 0, str(sample_index))


def trajectory_cost(c: Candidate, cap: int | None) -> int:
    """Bytes a kept trajectory forwards: its size plus the kept mark, at most the cap."""
    size = c.nbytes + KEPT_MARK_BYTES
    return size if cap is None else min(size, cap)


def scaled_limits(limits: dict[str, int], share: float) -> dict[str, int]:
    """A rule's quota: ``share`` of each limit, rounded up (any share > 0 allows one)."""
    return {name: math.ceil(share * value) for name, value in limits.items()}


def uniform_fill(budget: Budget, left: Sequence[Unit] = ()) -> bool:
    """Whether the fill is a uniform draw: a bottom-k of the sample hash, k set by a count alone.

    True when the only limit is ``max_trajectories_per_step`` over single trajectories, or
    ``max_groups_per_step`` over whole groups, with no per-trajectory cap: every unit then costs
    one, so the fill keeps the first k units in hash order, and each of the n units left to it
    had the same chance k/n (a simple random sample). Byte and token limits (first fit skips
    larger units) or a per-worker sample count make the chance depend on the unit. Whole groups
    under ``max_trajectories_per_step`` alone (``keep_groups_whole``, the default) are a uniform draw
    of groups when every group ``left`` to the fill has the same size (they all cost alike).
    """
    limits = set(budget.limits())
    if budget.max_trajectory_bytes is not None or not limits:
        return False
    if budget.group_unit and limits == {"max_groups_per_step"}:
        return True
    if limits != {"max_trajectories_per_step"}:
        return False
    return len({len(unit.members) for unit in left}) <= 1  # single trajectories, or groups all of one size


def decide(candidates: Iterable[Candidate], budget: Budget, experiment: Any, step: int,
           prior: Prior | None = None, unsent: int = 0) -> tuple[list[Verdict], Usage]:
    """Verdicts for every candidate (input order kept) and the step's usage afterwards.

    ``unsent``: complete trajectories of the step that node collectors did not forward (not their
    candidates, :mod:`.candidates`): none of them can be kept, but they count in a uniform fill's n.
    """
    candidates = list(candidates)
    prior = prior or Prior()
    limits = budget.limits()
    cap = budget.max_trajectory_bytes
    seed = budget.sampling_seed
    verdicts: dict[str, Verdict] = {}
    hashes: dict[SampleIndex, int] = {}

    def order_of(c: Candidate) -> tuple[Any, ...]:
        h = hashes.get(c.sample_index)
        if h is None:
            h = hashes[c.sample_index] = sample_hash(seed, experiment, step, c.sample_index)
        return (h, index_order(c.sample_index), -1 if c.rollout_n is None else c.rollout_n, c.trace_id)

    def make_unit(members: list[Candidate]) -> Unit:
        members.sort(key=order_of)
        return Unit(members, order_of(members[0]), sum(trajectory_cost(c, cap) for c in members),
                    sum(c.tokens for c in members))

    complete = []
    for c in candidates:
        if c.complete:
            complete.append(c)
        else:
            verdicts[c.trace_id] = Verdict(c.trace_id, False, reason="incomplete")
    by_sample: dict[SampleIndex, list[Candidate]] = {}
    for c in complete:
        by_sample.setdefault(c.sample_index, []).append(c)
    if budget.group_unit:
        units = [make_unit(list(members)) for members in by_sample.values()]
    else:
        units = [make_unit([c]) for c in complete]
    units.sort(key=lambda u: u.order)

    usage = prior.usage.copy()
    error_usage = prior.error_usage.copy()
    rule_units = dict(prior.rule_units)
    kept: set[int] = set()  # id() of kept units

    def keep(unit: Unit, rule: str) -> None:
        kept.add(id(unit))
        usage.add(unit)
        rule_units[rule] = rule_units.get(rule, 0) + 1
        for c in unit.members:
            verdicts[c.trace_id] = Verdict(c.trace_id, True, rule=rule)

    open_units = []
    for unit in units:  # late rollouts of groups decided in an earlier round
        decided = prior.groups.get(unit.members[0].sample_index) if budget.group_unit else None
        if decided is None:
            open_units.append(unit)
        elif not decided:
            for c in unit.members:
                verdicts[c.trace_id] = Verdict(c.trace_id, False, reason="group_dropped")
        elif (why := usage.blocked_by(unit, limits)) is None:
            keep(unit, "same_group")
        else:
            for c in unit.members:
                verdicts[c.trace_id] = Verdict(c.trace_id, False, reason=why)

    # 1. errors, within their own quota
    error_limits = scaled_limits(limits, budget.keep_errors_share)
    if budget.keep_errors_share > 0:
        for unit in open_units:
            if unit.has_error and usage.blocked_by(unit, limits) is None and error_usage.blocked_by(unit, error_limits) is None:
                keep(unit, "error")
                error_usage.add(unit)

    # 2. reward extremes, alternating highest and lowest
    rewarded = [u for u in open_units if u.rewards()]
    high = sorted(rewarded, key=lambda u: (-max(u.rewards()), u.order))
    low = sorted(rewarded, key=lambda u: (min(u.rewards()), u.order))
    want = {"reward_max": budget.keep_reward_extremes - rule_units.get("reward_max", 0),
            "reward_min": budget.keep_reward_extremes - rule_units.get("reward_min", 0)}
    queues = {"reward_max": iter(high), "reward_min": iter(low)}
    while any(want[r] > 0 and queues[r] is not None for r in want):
        for rule in ("reward_max", "reward_min"):
            if want[rule] <= 0 or queues[rule] is None:
                continue
            for unit in queues[rule]:
                if id(unit) in kept:  # already kept by an earlier rule: that extreme is covered
                    want[rule] -= 1
                    break
                if usage.blocked_by(unit, limits) is None:
                    keep(unit, rule)
                    want[rule] -= 1
                    break
            else:
                queues[rule] = None  # type: ignore[assignment]

    # 3. widest reward spread, whole groups
    spread_want = budget.keep_spread_groups - rule_units.get("reward_spread", 0)
    if spread_want > 0:
        # (unit to keep, rewards of the whole group, single-trajectory units it stands for)
        groups: list[tuple[Unit, list[float], list[Unit]]] = []
        if budget.group_unit:
            groups = [(u, u.rewards(), [u]) for u in open_units if id(u) not in kept]
        else:
            open_by_sample: dict[SampleIndex, list[Unit]] = {}
            for u in open_units:
                if id(u) not in kept:
                    open_by_sample.setdefault(u.members[0].sample_index, []).append(u)
            for sample_index, rest in open_by_sample.items():
                rewards = [c.reward for c in by_sample[sample_index] if c.reward is not None]
                groups.append((make_unit([u.members[0] for u in rest]), rewards, rest))
        ranked = sorted(
            ((max(r) - min(r), u, parts) for u, r, parts in groups if len(r) >= 2 and max(r) > min(r)),
            key=lambda entry: (-entry[0], entry[1].order),
        )
        for _, unit, parts in ranked:
            if spread_want <= 0:
                break
            if usage.blocked_by(unit, limits) is None:
                keep(unit, "reward_spread")
                kept.update(id(u) for u in parts)
                spread_want -= 1

    # 4. fill by hash
    left = [unit for unit in open_units if id(unit) not in kept]
    filled = []
    for unit in left:
        why = usage.blocked_by(unit, limits)
        if why is None:
            keep(unit, "fill")
            filled.append(unit)
        else:
            for c in unit.members:
                verdicts[c.trace_id] = Verdict(c.trace_id, False, reason=why)
    if filled and uniform_fill(budget, left):  # stamped so step and group statistics can be re-weighted
        chance = round(len(filled) / (len(left) + unsent), 6)
        for unit in filled:
            for c in unit.members:
                verdicts[c.trace_id].inclusion_probability = chance
    return [verdicts[c.trace_id] for c in candidates], usage

