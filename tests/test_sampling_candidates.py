"""The budget algebra behind sending candidates only (processors/sampling/candidates.py, docs/cluster.md).

For budgets that decompose, deciding over the union of every part's candidates (a part: a node, or
a node's round), with the parts' unsent counts, keeps exactly what deciding over everything keeps
(same rules, same stamped chances), and everything a part kept to itself is dropped on the step's
limit there. Random workloads and random partitions; plus the budgets that must fall back.
"""

from __future__ import annotations

import random

import pytest

from tracecar.collector.processors.sampling.candidates import choose, decomposable
from tracecar.collector.processors.sampling.decide import Candidate, decide
from tracecar.collector.processors.sampling.policy import Budget


def budget(rng: random.Random) -> Budget:
    return Budget(mode="tail", max_trajectories_per_step=rng.randint(1, 12), keep_errors_share=rng.choice([0, 0.25, 0.5]),
                  keep_reward_extremes=rng.randint(0, 3), keep_spread_groups=0, keep_groups_whole=False,
                  sampling_seed=rng.randint(0, 3))


def workload(rng: random.Random, n: int) -> list[Candidate]:
    out = []
    for i in range(n):
        reward = None if rng.random() < 0.15 else rng.choice([0.0, 0.25, 0.5, 0.75, 1.0])
        out.append(Candidate(f"t{i:04d}", f"w{rng.randint(0, 7)}", rng.randint(0, n // 4), rng.randint(0, 3),
                             rng.random() < 0.2, reward, 1000, 100, rng.random() > 0.05))
    return out


@pytest.mark.parametrize("seed", range(200))
def test_the_union_of_the_parts_candidates_decides_as_everything(seed: int) -> None:
    rng = random.Random(seed)
    b = budget(rng)
    assert decomposable(b)
    everything = workload(rng, rng.randint(1, 80))
    parts: list[list[Candidate]] = [[] for _ in range(rng.randint(1, 6))]
    for c in everything:
        rng.choice(parts).append(c)
    sent: list[Candidate] = []
    unsent = 0
    for part in parts:
        verdicts, n = choose(part, b, "exp", 3)
        sent += [c for c, v in zip(part, verdicts) if v.keep]
        unsent += n
        assert n == sum(1 for v in verdicts if not v.keep)
    want = {v.trace_id: v for v in decide(everything, b, "exp", 3)[0]}
    got = {v.trace_id: v for v in decide(sent, b, "exp", 3, unsent=unsent)[0]}
    kept = {t: (v.rule, v.inclusion_probability) for t, v in want.items() if v.keep}
    assert {t: (v.rule, v.inclusion_probability) for t, v in got.items() if v.keep} == kept
    for trace_id, v in want.items():
        if trace_id in got:
            assert (got[trace_id].keep, got[trace_id].reason) == (v.keep, v.reason)
        else:  # kept to itself by its part: one collector drops it on the limit
            assert (v.keep, v.reason) == (False, "max_trajectories_per_step")


def test_a_part_sends_at_most_the_union_of_its_rules_k() -> None:
    rng = random.Random(7)
    b = Budget(mode="tail", max_trajectories_per_step=4, keep_errors_share=0.25, keep_reward_extremes=1,
               keep_spread_groups=0, keep_groups_whole=False)
    part = [Candidate(f"t{i}", "w0", i, 0, rng.random() < 0.3, rng.random(), 100, 10, True) for i in range(500)]
    verdicts, unsent = choose(part, b, "exp", 1)
    assert sum(v.keep for v in verdicts) <= 4 + 1 + 1 + 1 and unsent >= 493


@pytest.mark.parametrize("values", [
    {"max_trajectories_per_step": 4, "keep_groups_whole": True},  # a split group's error or best rollout may be elsewhere
    {"max_trajectories_per_step": 4, "keep_groups_whole": False, "keep_spread_groups": 1},  # a spread needs all rewards
    {"max_trajectories_per_step": 4, "keep_groups_whole": False, "keep_spread_groups": 0, "max_bytes_per_step": 10_000},
    {"max_trajectories_per_step": 4, "keep_groups_whole": False, "keep_spread_groups": 0, "max_tokens_per_step": 10_000},
    {"max_groups_per_step": 4, "keep_spread_groups": 0},
])
def test_budgets_that_do_not_decompose_send_everything(values: dict) -> None:
    b = Budget(mode="tail", **values)
    assert not decomposable(b)
    part = [Candidate(f"t{i}", "w0", i, 0, False, float(i), 100, 10, True) for i in range(20)]
    verdicts, unsent = choose(part, b, "exp", 1)
    assert all(v.keep for v in verdicts) and unsent == 0
