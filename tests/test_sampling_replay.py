"""Replay of a realistic GRPO step (1,024 samples × 8 rollouts) under a tail budget.

Rewards: each sample has a difficulty p ~ Beta(2, 2); a rollout scores Bernoulli(p) plus a
N(0, 0.05) shaping term (seeded). 2% of rollouts have a failed tool call. Eight workers each
run 128 samples, their spans interleaved in batches as they would arrive. The kept set is checked
against every rule, and the memory the selector holds while the step waits and while it is
decided is reported (tracemalloc: Python allocations; RSS: the process, SQLite included):

    pytest tests/test_sampling_replay.py -s
"""

from __future__ import annotations

import gc
import math
import random
import resource
import tracemalloc
from typing import Any

import orjson
import psutil
import pytest

from tests.sampling_kit import Harness
from tracecar.collector.processors.sampling import sample_hash
from tracecar.collector.spool.store import HELD, PENDING

pytestmark = pytest.mark.timeout(300)

SAMPLES, ROLLOUTS, WORKERS, STEP = 1024, 8, 8, 42
# trajectory by trajectory (keep_groups_whole=False): the rules' per-trajectory quotas are what this checks
BUDGET = dict(max_trajectories_per_step=256, keep_errors_share=0.25, keep_reward_extremes=4, keep_spread_groups=8,
              keep_groups_whole=False)


def build_step(seed: int = 7) -> tuple[list[list[dict[str, Any]]], dict[str, dict[str, Any]]]:
    """Batches (interleaved across workers) and, per trace id, what the test knows of it."""
    rnd = random.Random(seed)
    truth: dict[str, dict[str, Any]] = {}
    per_worker: dict[str, list[list[dict[str, Any]]]] = {}
    for sample in range(SAMPLES):
        p = rnd.betavariate(2, 2)
        worker = f"worker-{sample % WORKERS}"
        for n in range(ROLLOUTS):
            trace = f"s{sample:04d}n{n}"
            error = rnd.random() < 0.02
            reward = round(float(rnd.random() < p) + rnd.gauss(0, 0.05), 6)
            attrs = {"step": STEP, "sample_index": sample, "rollout_n": n, "validate": False, "experiment_name": "grpo"}
            base = {"worker": worker, "project": "p", "entity": None, "trace_id": trace, "attributes": attrs,
                    "output": None, "exception": None, "inputs": {}}
            response = [rnd.randrange(100_000) for _ in range(rnd.randint(100, 400))]
            spans = [
                {**base, "span_id": f"{trace}-gen", "parent_id": f"{trace}-run", "name": "AgentLoop.generate", "kind": "op",
                 "start_time": 1.0, "end_time": 2.0, "inputs": {"prompt_ids": list(range(64))},
                 "output": {"token_ids": response, "response_text": "x" * len(response)}},
                {**base, "span_id": f"{trace}-tool", "parent_id": f"{trace}-run", "name": "Tool.execute", "kind": "op",
                 "start_time": 2.0, "end_time": 2.5, "inputs": {"parameters": {"query": "q" * 40}},
                 "exception": "ToolError: timeout" if error else None, "output": None if error else {"result": "r" * 200}},
                {**base, "span_id": f"{trace}-run", "parent_id": trace, "name": "AgentLoop.run", "kind": "op",
                 "start_time": 1.0, "end_time": 3.0},
                {**base, "span_id": trace, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
                 "start_time": 0.9, "end_time": 3.1},
                {**base, "span_id": f"{trace}-reward", "parent_id": None, "name": "annotation", "kind": "annotation",
                 "start_time": 4.0, "end_time": 4.0, "attributes": {"reward": reward}},
            ]
            per_worker.setdefault(worker, []).append(spans)
            truth[trace] = {"sample": sample, "n": n, "error": error, "reward": reward,
                            "order": (sample_hash(0, "grpo", STEP, sample), sample, n, trace)}
    batches: list[list[dict[str, Any]]] = []
    queues = {w: [s for traj in trajs for s in traj] for w, trajs in per_worker.items()}
    while queues:
        w = rnd.choice(sorted(queues))
        batches.append(queues[w][:500])
        del queues[w][:500]
        if not queues[w]:
            del queues[w]
    return batches, truth


def test_replay_1024_by_8_step_keeps_what_the_rules_say(tmp_path):
    batches, truth = build_step()
    h = Harness(tmp_path, **BUDGET)
    process = psutil.Process()
    gc.collect()
    rss_start = process.memory_info().rss
    tracemalloc.start()
    base_traced = tracemalloc.get_traced_memory()[0]
    for batch in batches:
        h.feed(batch)
    del batches
    gc.collect()
    held_traced = tracemalloc.get_traced_memory()[0] - base_traced
    rss_holding = process.memory_info().rss - rss_start
    assert h.selector.held_trajectories == SAMPLES * ROLLOUTS and h.spool.held_count == SAMPLES * ROLLOUTS * 5

    h.clock.advance(h.settings.step_idle_s + 1)
    gc.collect()
    rss_before = process.memory_info().rss
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    traced_before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    released = h.selector.tick()
    peak = tracemalloc.get_traced_memory()[1] - traced_before
    rss_delta = process.memory_info().rss - rss_before
    maxrss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss_before) * 1024  # KiB on Linux
    tracemalloc.stop()
    print(f"\n[sampling memory] {SAMPLES}x{ROLLOUTS} step, {SAMPLES * ROLLOUTS * 5} spans held in SQLite: "
          f"while waiting: summaries {held_traced / 2**20:.2f} MiB (tracemalloc), RSS +{rss_holding / 2**20:.1f} MiB "
          f"(incl. SQLite page cache); deciding: tracemalloc peak +{peak / 2**20:.2f} MiB, RSS delta "
          f"{rss_delta / 2**20:+.2f} MiB, peak-RSS growth {maxrss_growth / 2**20:.2f} MiB")
    assert held_traced < 16 * 2**20 and peak < 64 * 2**20

    decisions = {d["trace_id"]: d for d in h.spool.step_decisions("grpo", False, STEP)}
    kept = {t: d["rule"] for t, d in decisions.items() if d["keep"]}
    assert len(decisions) == SAMPLES * ROLLOUTS and len(kept) == 256
    assert {d["reason"] for d in decisions.values() if not d["keep"]} == {"max_trajectories_per_step"}
    assert released == 256 * 5 and h.spool.held_count == 0

    # 1. errors: the first ceil(25% of 256) errored trajectories in hash order
    errored = sorted((t for t, x in truth.items() if x["error"]), key=lambda t: truth[t]["order"])
    assert len(errored) > 64
    assert [t for t in errored if kept.get(t) == "error"] == errored[:math.ceil(0.25 * 256)]
    # 2. the 4 highest and 4 lowest rewards of the step are kept
    by_reward = sorted(truth, key=lambda t: truth[t]["reward"])
    assert all(t in kept for t in by_reward[:4] + by_reward[-4:])
    assert sum(r == "reward_max" for r in kept.values()) <= 4 and sum(r == "reward_min" for r in kept.values()) <= 4
    # 3. the 8 groups with the widest reward spread are kept whole
    groups: dict[int, list[str]] = {}
    for t, x in truth.items():
        groups.setdefault(x["sample"], []).append(t)
    spread = {s: max(truth[t]["reward"] for t in ts) - min(truth[t]["reward"] for t in ts) for s, ts in groups.items()}
    widest = sorted(groups, key=lambda s: (-spread[s], sample_hash(0, "grpo", STEP, s)))[:8]
    assert all(t in kept for s in widest for t in groups[s])
    # 4. the rest is the hash fill: every kept-by-fill trajectory ranks before every dropped one
    fill = [truth[t]["order"] for t, r in kept.items() if r == "fill"]
    dropped = [truth[t]["order"] for t in truth if t not in kept]
    assert fill and max(fill) < min(dropped)

    # forwarded whole, each root saying why; nothing of the dropped
    rows = h.spool.query("SELECT span_id, trace_id, state, payload FROM spans")
    assert {r["state"] for r in rows} == {PENDING} and HELD not in {r["state"] for r in rows}
    assert {r["trace_id"] for r in rows} == set(kept) and len(rows) == 256 * 5
    for r in rows:
        if r["span_id"] == r["trace_id"]:
            assert orjson.loads(r["payload"])["attributes"]["kept_because"] == kept[r["trace_id"]]
    h.close()
