"""The tail-based rule engine (selection.decide) on its own: rules, quotas, limits, determinism."""

from __future__ import annotations

import math
import os
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracecar.collector.processors.sampling.decide import (
    KEPT_MARK_BYTES,
    Candidate,
    Prior,
    Unit,
    Usage,
    decide,
    sample_hash,
    scaled_limits,
    trajectory_cost,
)
from tracecar.collector.processors.sampling.policy import LIMIT_NAMES, Budget, Policies
from tracecar.collector.settings import CollectorSettings

#: More examples for a longer hunt: SAMPLING_EXAMPLES_SCALE=20 pytest tests/test_sampling_*.py
SCALE = int(os.environ.get("SAMPLING_EXAMPLES_SCALE", "1"))


def cand(i: int, sample: int, n: int = 0, *, worker: str = "w0", error: bool = False, reward: float | None = None,
         nbytes: int = 100, tokens: int = 0, complete: bool = True) -> Candidate:
    return Candidate(f"t{i}", worker, sample, n, error, reward, nbytes, tokens, complete)


def tail(**kw: Any) -> Budget:
    return Budget(mode="tail", **kw)


def kept(verdicts: list[Any]) -> dict[str, str]:
    return {v.trace_id: v.rule for v in verdicts if v.keep}


# ---- rules by example ---------------------------------------------------------------------
def test_errors_then_extremes_then_spread_then_hash_fill():
    cs = [cand(0, 0, reward=0.5), cand(1, 1, reward=0.9), cand(2, 2, reward=-3.0), cand(3, 3, error=True, reward=0.4),
          cand(4, 4, 0, reward=0.0), cand(5, 4, 1, reward=0.8), cand(6, 5, reward=0.5), cand(7, 6, reward=0.5)]
    verdicts, usage = decide(cs, tail(max_trajectories_per_step=6), "exp", 1)
    rules = kept(verdicts)
    assert rules["t3"] == "error" and rules["t1"] == "reward_max" and rules["t2"] == "reward_min"
    assert rules["t4"] == rules["t5"] == "reward_spread"  # sample 4: the only group with a spread
    assert usage.trajectories == 6 and sum(r == "fill" for r in rules.values()) == 1
    fill_pool = [c for c in cs if c.trace_id in {"t0", "t6", "t7"}]
    expected = min(fill_pool, key=lambda c: sample_hash(0, "exp", 1, c.sample_index))
    assert rules[expected.trace_id] == "fill"
    dropped = [v for v in verdicts if not v.keep]
    assert len(dropped) == 2 and {v.reason for v in dropped} == {"max_trajectories_per_step"}


def test_incomplete_trajectories_are_never_kept():
    verdicts, _ = decide([cand(0, 0, complete=False, error=True), cand(1, 1)], tail(), "exp", 1)
    assert [(v.keep, v.rule, v.reason) for v in verdicts] == [(False, None, "incomplete"), (True, "fill", None)]


def test_error_quota_is_a_share_of_each_limit_rounded_up():
    cs = [cand(i, i, error=True) for i in range(10)] + [cand(10 + i, 10 + i) for i in range(10)]
    verdicts, _ = decide(cs, tail(max_trajectories_per_step=8, keep_errors_share=0.3), "exp", 1)
    rules = list(kept(verdicts).values())
    assert rules.count("error") == math.ceil(0.3 * 8) == 3
    assert len(rules) == 8
    verdicts, _ = decide(cs, tail(max_trajectories_per_step=8, keep_errors_share=0.0), "exp", 1)
    assert "error" not in kept(verdicts).values()


def test_group_unit_keeps_every_rollout_of_a_sample_together():
    cs = [cand(s * 4 + n, s, n, worker=f"w{s % 2}", reward=float(s * n)) for s in range(6) for n in range(4)]
    budget = tail(max_samples_per_step_per_worker=2)
    assert budget.group_unit
    verdicts, usage = decide(cs, budget, "exp", 3)
    by_sample: dict[int, set[bool]] = {}
    for c, v in zip(cs, verdicts):
        by_sample.setdefault(c.sample_index, set()).add(v.keep)
    assert all(len(keeps) == 1 for keeps in by_sample.values())
    assert all(len(samples) <= 2 for samples in usage.worker_samples.values())
    assert sum(True in k for k in by_sample.values()) == 4  # 2 per worker, 2 workers


def test_bytes_budget_counts_the_kept_mark_and_the_truncation_cap():
    big = cand(0, 0, nbytes=50_000, reward=9.0)
    small = [cand(i, i, nbytes=1_000) for i in range(1, 6)]
    budget = tail(max_bytes_per_step=3 * (1_000 + KEPT_MARK_BYTES), max_trajectory_bytes=None)
    verdicts, usage = decide([big, *small], budget, "exp", 1)
    assert "t0" not in kept(verdicts) and len(kept(verdicts)) == 3  # first fit: the big one is skipped
    assert usage.bytes <= budget.max_bytes_per_step
    capped = tail(max_bytes_per_step=10_000, max_trajectory_bytes=8_000)
    verdicts, usage = decide([big, *small], capped, "exp", 1)
    assert kept(verdicts)["t0"] == "reward_max" and trajectory_cost(big, 8_000) == 8_000
    assert usage.bytes <= 10_000


def test_later_round_uses_what_earlier_rounds_kept():
    prior = Prior()
    for i in range(3):
        prior.usage.add(Unit([cand(100 + i, 100 + i)], (), 100, 0))
    prior.rule_units = {"reward_max": 1, "reward_min": 1}
    cs = [cand(i, i, reward=float(i)) for i in range(5)]
    verdicts, usage = decide(cs, tail(max_trajectories_per_step=4, keep_spread_groups=0), "exp", 1, prior)
    rules = kept(verdicts)
    assert len(rules) == 1 and set(rules.values()) == {"fill"}  # extremes' quota was used in round 1
    assert usage.trajectories == 4


def test_late_rollout_follows_its_groups_earlier_decision():
    prior = Prior(groups={0: True, 1: False})
    prior.usage.add(Unit([cand(100, 0)], (), 100, 0))
    cs = [cand(0, 0, 1), cand(1, 1, 1), cand(2, 2, 0)]
    verdicts, _ = decide(cs, tail(max_groups_per_step=2), "exp", 1, prior)
    assert [(v.keep, v.rule or v.reason) for v in verdicts] == [(True, "same_group"), (False, "group_dropped"), (True, "fill")]


def test_policy_layers_and_modes():
    s = CollectorSettings(
        max_samples_per_step_per_worker=4,
        validation_budget={"max_trajectories_per_step": 16},
        budgets={"big": {"max_trajectories_per_step": 64, "validation": {"max_trajectories_per_step": None}},
                 "verl": {"tail_sampling": True}},
    )
    p = Policies(s)
    assert p.get(None, False).mode == "head" and p.get("other", False).max_samples_per_step_per_worker == 4
    assert p.get("other", True).mode == "tail" and p.get("other", True).max_trajectories_per_step == 16
    assert p.get("big", False).limits() == {"max_samples_per_step_per_worker": 4, "max_trajectories_per_step": 64}
    assert p.get("big", True).max_trajectories_per_step is None  # null removes the inherited limit
    assert p.get("verl", False).mode == "tail" and p.get("verl", False).group_unit
    assert Policies(CollectorSettings()).get("x", False).mode == "pass"
    with pytest.raises(ValueError, match="max_bytes_per_step need tail_sampling"):
        Policies(CollectorSettings(budgets={"e": {"tail_sampling": False, "max_bytes_per_step": 10}}))


def test_hash_fill_is_seeded_and_shared_by_collectors():
    cs = [cand(i, i) for i in range(50)]
    a = kept(decide(cs, tail(max_trajectories_per_step=10), "exp", 7)[0])
    b = kept(decide(list(reversed(cs)), tail(max_trajectories_per_step=10), "exp", 7)[0])
    c = kept(decide(cs, tail(max_trajectories_per_step=10, sampling_seed=1), "exp", 7)[0])
    assert a == b and a != c
    # a second collector seeing half the samples keeps a subset consistent with the first
    half = [x for x in cs if x.sample_index % 2 == 0]
    d = kept(decide(half, tail(max_trajectories_per_step=5), "exp", 7)[0])
    rank = sorted(half, key=lambda x: sample_hash(0, "exp", 7, x.sample_index))
    assert set(d) == {x.trace_id for x in rank[:5]}


# ---- properties ---------------------------------------------------------------------------
@st.composite
def step_case(draw: Any) -> tuple[list[Candidate], Budget]:
    n_samples = draw(st.integers(1, 12))
    workers = draw(st.integers(1, 3))
    cands = []
    i = 0
    for s in range(n_samples):
        for n in range(draw(st.integers(1, 4))):
            reward = draw(st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0]), st.floats(-5, 5, allow_nan=False)))
            cands.append(Candidate(f"t{i}", f"w{draw(st.integers(0, workers - 1))}", s, n, draw(st.booleans()),
                                   reward, draw(st.integers(50, 5000)), draw(st.integers(0, 300)),
                                   draw(st.booleans()) or draw(st.booleans())))
            i += 1
    limit = st.one_of(st.none(), st.integers(0, 12))
    budget = tail(
        max_samples_per_step_per_worker=draw(limit), max_trajectories_per_step=draw(limit),
        max_groups_per_step=draw(limit), max_bytes_per_step=draw(st.one_of(st.none(), st.integers(0, 30_000))),
        max_tokens_per_step=draw(st.one_of(st.none(), st.integers(0, 2_000))),
        max_trajectory_bytes=draw(st.one_of(st.none(), st.integers(4096, 6000))),
        keep_errors_share=draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0])),
        keep_reward_extremes=draw(st.integers(0, 3)), keep_spread_groups=draw(st.integers(0, 2)),
        sampling_seed=draw(st.integers(0, 3)),
    )
    return cands, budget


def units_of(cands: list[Candidate], budget: Budget) -> list[Unit]:
    cap = budget.max_trajectory_bytes
    if budget.group_unit:
        groups: dict[int, list[Candidate]] = {}
        for c in cands:
            groups.setdefault(c.sample_index, []).append(c)
        members = list(groups.values())
    else:
        members = [[c] for c in cands]
    return [Unit(m, (), sum(trajectory_cost(c, cap) for c in m), sum(c.tokens for c in m)) for m in members]


def usage_of(cands: list[Candidate], budget: Budget) -> Usage:
    usage = Usage()
    for u in units_of(cands, budget):
        usage.add(u)
    return usage


@settings(max_examples=400 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step_case(), st.randoms(use_true_random=False))
def test_decide_properties(case: tuple[list[Candidate], Budget], rnd: random.Random) -> None:
    cands, budget = case
    limits = budget.limits()
    verdicts, usage = decide(cands, budget, "exp", 5)
    by_id = {c.trace_id: c for c in cands}
    keep = {v.trace_id: v for v in verdicts if v.keep}
    kept_c = [by_id[t] for t in keep]

    # no budget exceeded (recomputed from scratch, not trusting the engine's usage)
    fresh = usage_of(kept_c, budget)
    for name, limit in limits.items():
        value = {"max_trajectories_per_step": fresh.trajectories, "max_groups_per_step": len(fresh.groups),
                 "max_bytes_per_step": fresh.bytes, "max_tokens_per_step": fresh.tokens,
                 "max_samples_per_step_per_worker": max((len(s) for s in fresh.worker_samples.values()), default=0)}[name]
        assert value <= limit, name
    assert fresh.trajectories == usage.trajectories and fresh.bytes == usage.bytes

    # never a partial trajectory; whole groups in group mode
    assert all(by_id[t].complete for t in keep)
    if budget.group_unit:
        for s in {c.sample_index for c in cands}:
            assert len({c.trace_id in keep for c in cands if c.sample_index == s and c.complete}) <= 1

    # same input in another order -> same choice
    shuffled = cands[:]
    rnd.shuffle(shuffled)
    again, _ = decide(shuffled, budget, "exp", 5)
    assert {v.trace_id: (v.keep, v.rule, v.reason) for v in again} == {v.trace_id: (v.keep, v.rule, v.reason) for v in verdicts}

    # maximal: every dropped complete unit would exceed a limit on top of what was kept
    units = units_of([c for c in cands if c.complete], budget)
    dropped_units = [u for u in units if u.members[0].trace_id not in keep]
    for u in dropped_units:
        assert usage.blocked_by(u, limits) is not None

    # errored units are kept whenever their quota allows
    err_kept = [by_id[t] for t, v in keep.items() if v.rule == "error"]
    err_usage = usage_of(err_kept, budget)
    quota = scaled_limits(limits, budget.keep_errors_share)
    if budget.keep_errors_share > 0:
        for u in dropped_units:
            if u.has_error:
                assert err_usage.blocked_by(u, limits) is not None or err_usage.blocked_by(u, quota) is not None

    # extreme rewards are kept whenever their quota allows: walking the rule's ranking, a dropped
    # unit with fewer than k kept extremes (or errors) ranked above it did not fit when reached
    early_rules = ("error", "reward_max", "reward_min")
    early = usage_of([by_id[t] for t, v in keep.items() if v.rule in early_rules], budget)
    k = budget.keep_reward_extremes
    rewarded = [u for u in units if u.rewards()]
    for rule, rank in (("reward_max", lambda u: (-max(u.rewards()), order_key(u, budget))),
                       ("reward_min", lambda u: (min(u.rewards()), order_key(u, budget)))):
        assert sum(1 for u in units if keep.get(u.members[0].trace_id) and keep[u.members[0].trace_id].rule == rule) <= k
        above = 0
        for u in sorted(rewarded, key=rank):
            v = keep.get(u.members[0].trace_id)
            if v is None and above < k:
                assert early.blocked_by(u, limits) is not None, rule
            if v is not None and v.rule in early_rules:
                above += 1


def order_key(unit: Unit, budget: Budget) -> tuple[Any, ...]:
    return min((sample_hash(budget.sampling_seed, "exp", 5, c.sample_index), c.sample_index,
                -1 if c.rollout_n is None else c.rollout_n, c.trace_id) for c in unit.members)


def test_limit_names_cover_the_settings():
    assert set(LIMIT_NAMES) <= set(CollectorSettings.model_fields)
