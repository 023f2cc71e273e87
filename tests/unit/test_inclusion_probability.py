"""The uniform fill's inclusion probability (decide.uniform_fill): k of the n units left to the fill."""

from __future__ import annotations

from tracecar.collector.processors.sampling.decide import Candidate, decide
from tracecar.collector.processors.sampling.policy import Budget


def candidates(samples: int, rollouts: int = 1, error_every: int = 0) -> list[Candidate]:
    out = []
    for s in range(samples):
        for r in range(rollouts):
            error = bool(error_every) and s % error_every == 0
            out.append(Candidate(f"t{s}-{r}", "w0", s, r, error, float(s % 3), 100, 10, True))
    return out


def no_rules(**limits: int) -> Budget:
    return Budget(mode="tail", keep_errors_share=0, keep_reward_extremes=0, keep_spread_groups=0, **limits)  # type: ignore[arg-type]


def test_a_count_alone_stamps_k_over_n_on_what_the_fill_kept() -> None:
    verdicts, _ = decide(candidates(40), no_rules(max_trajectories_per_step=10), "e", 1)
    kept = [v for v in verdicts if v.keep]
    assert len(kept) == 10 and {v.inclusion_probability for v in kept} == {0.25}
    assert all(v.inclusion_probability is None for v in verdicts if not v.keep)


def test_rules_first_then_the_fill_draws_from_what_is_left() -> None:
    budget = Budget(mode="tail", max_trajectories_per_step=10, keep_errors_share=0.2, keep_reward_extremes=1,
                    keep_spread_groups=0)
    verdicts, _ = decide(candidates(40, error_every=4), budget, "e", 1)
    by_rule: dict[str | None, list] = {}
    for v in verdicts:
        if v.keep:
            by_rule.setdefault(v.rule, []).append(v)
    ruled = sum(len(v) for r, v in by_rule.items() if r != "fill")
    fill = by_rule["fill"]
    assert {v.inclusion_probability for v in fill} == {round(len(fill) / (40 - ruled), 6)}
    assert all(v.inclusion_probability is None for r, vs in by_rule.items() if r != "fill" for v in vs)


def test_whole_groups_under_a_group_count_each_carry_the_groups_chance() -> None:
    verdicts, _ = decide(candidates(12, rollouts=4), no_rules(max_groups_per_step=3), "e", 1)
    kept = [v for v in verdicts if v.keep]
    assert len(kept) == 12 and {v.inclusion_probability for v in kept} == {0.25}


def test_byte_token_limits_or_a_cap_make_the_draw_non_uniform_so_nothing_is_stamped() -> None:
    for budget in (no_rules(max_trajectories_per_step=10, max_bytes_per_step=5000), no_rules(max_tokens_per_step=100),
                   Budget(mode="tail", max_trajectories_per_step=10, max_trajectory_bytes=8192, keep_errors_share=0,
                          keep_reward_extremes=0, keep_spread_groups=0),
                   no_rules(max_groups_per_step=3, max_trajectories_per_step=8)):
        verdicts, _ = decide(candidates(12, rollouts=2), budget, "e", 1)
        assert any(v.keep for v in verdicts) and all(v.inclusion_probability is None for v in verdicts)
