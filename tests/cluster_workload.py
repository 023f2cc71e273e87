"""A VERL-shaped workload for the cluster tests: the same spans, fed to one collector or to nodes.

VERL repeats each prompt ``rollout_n`` times (interleaved) and splits the batch evenly over its
agent-loop workers (``generate_sequences``: ``batch.repeat(interleave=True)`` then ``chunk``):
with 10 prompts × 4 rollouts over 8 workers each worker gets 5 rollouts, so most GRPO groups
are split across workers, and (two workers per node) across nodes. Each trajectory is VERL's
agent loop: a root, two ``generate`` turns with token ids and log-probabilities (decoded on the
node), a tool call (some fail), then the reward and advantage as a trainer annotation. Rewards
are seeded: some groups all equal (GRPO learns nothing from them), some with ties.

``TAIL_BUDGETS``: the tail rules under test, one experiment each (N per step with errors,
best/worst and spread quotas, under a token limit; whole groups per step, under a byte limit; a
uniform choice: the seeded hash fill alone, 4 of 40, each kept one stamped with its chance; N per
step with error and best/worst quotas alone, trajectory by trajectory: the last two decompose, so
node collectors send the gateway their candidates only).
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

PROMPTS, ROLLOUT_N, WORKERS = 10, 4, 8
EXPERIMENTS = ("exp-traj", "exp-group", "exp-uniform", "exp-topk")
STEPS = (1, 2)
PER_STEP = PROMPTS * ROLLOUT_N

#: the budgets of one collector that sees everything, and of the gateway (TRACECAR_* settings)
TAIL_BUDGETS: dict[str, Any] = {
    "max_trajectories_per_step": 12,
    "keep_reward_extremes": 2,
    "keep_spread_groups": 1,
    "keep_errors_share": 0.25,
    "trajectories_per_step": PER_STEP,
    "reward_wait_s": 60,
    "step_idle_s": 300,
    "decision_wait_s": 600,
    "budgets": json.dumps({  # exp-traj and exp-uniform decide trajectory by trajectory (GRPO groups whole is the default)
        "exp-traj": {"max_tokens_per_step": 1100, "keep_groups_whole": False},
        "exp-group": {"max_trajectories_per_step": None, "max_groups_per_step": 3, "max_bytes_per_step": 40000},
        "exp-uniform": {"max_trajectories_per_step": 4, "keep_errors_share": 0, "keep_reward_extremes": 0,
                        "keep_spread_groups": 0, "keep_groups_whole": False},
        # decomposes (docs/cluster.md, sending candidates only): count alone, trajectory by trajectory, no spread quota
        "exp-topk": {"max_trajectories_per_step": 3, "keep_reward_extremes": 1, "keep_spread_groups": 0,
                     "keep_groups_whole": False},
    }),
}


@dataclass
class Trajectory:
    experiment: str
    step: int
    sample_index: int
    rollout: int
    worker: str
    spans: list[dict[str, Any]]
    reward: dict[str, Any]  # the trainer's annotation (sent after the trajectory)

    @property
    def trace_id(self) -> str:
        return self.spans[-1]["trace_id"]


def _id(*parts: Any) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def trajectory(experiment: str, step: int, sample: int, rollout: int, worker: str, rng: random.Random,
               reward: float, advantage: float) -> Trajectory:
    trace = _id(experiment, step, sample, rollout)
    attrs = {"step": step, "sample_index": sample, "rollout_n": rollout, "validate": False, "experiment_name": experiment}
    t0 = 1_700_000_000.0 + step * 1000 + sample * 10 + rollout
    spans: list[dict[str, Any]] = []
    prompt = [rng.randrange(3, 250) for _ in range(24)]
    for turn in range(2):
        response = [rng.randrange(3, 250) for _ in range(16)]
        spans.append({
            "span_id": f"{trace}-g{turn}", "trace_id": trace, "parent_id": trace, "name": "AsyncLLMServerManager.generate",
            "kind": "op", "start_time": t0 + turn, "end_time": t0 + turn + 0.5, "attributes": attrs,
            "inputs": {"prompt_ids": list(prompt), "sampling_params": {"temperature": 1.0}},
            "output": {"response_ids": response, "response_logprobs": [round(-rng.random() * 3, 4) for _ in response]},
        })
        prompt += response
    failed = (sample + rollout + step) % 7 == 0
    spans.append({
        "span_id": f"{trace}-t", "trace_id": trace, "parent_id": trace, "name": "CalculatorTool.execute", "kind": "op",
        "start_time": t0 + 2, "end_time": t0 + 2.2, "attributes": attrs, "inputs": {"expression": f"{sample}+{rollout}"},
        "output": None if failed else {"result": sample + rollout},
        "exception": "ToolError: calculator backend timed out" if failed else None,
    })
    spans.append({
        "span_id": trace, "trace_id": trace, "parent_id": None, "name": "ToolAgentLoop.run", "kind": "trajectory",
        "start_time": t0, "end_time": t0 + 3, "attributes": attrs, "inputs": {"sample_index": sample},
        "output": {"num_turns": 2},
    })
    annotation = {"span_id": f"{trace}-r", "trace_id": trace, "parent_id": None, "name": "reward", "kind": "annotation",
                  "start_time": t0 + 4, "end_time": t0 + 4, "attributes": {"reward": reward, "advantage": advantage}}
    return Trajectory(experiment, step, sample, rollout, worker, spans, annotation)


def workload(seed: int = 0) -> list[Trajectory]:
    """Every trajectory of the run, in VERL's order (step, then the repeated batch)."""
    rng = random.Random(seed)
    out: list[Trajectory] = []
    chunk = PER_STEP // WORKERS
    for step in STEPS:
        for experiment in EXPERIMENTS:
            for sample in range(PROMPTS):
                if sample % 5 == 0:  # an all-equal group: zero spread
                    rewards = [1.0] * ROLLOUT_N
                else:
                    rewards = [float(rng.choice([0, 0.25, 0.5, 0.75, 1.0])) for _ in range(ROLLOUT_N)]
                mean = sum(rewards) / ROLLOUT_N
                for rollout in range(ROLLOUT_N):
                    position = sample * ROLLOUT_N + rollout  # batch.repeat(rollout_n, interleave=True)
                    worker = f"w{position // chunk}"
                    out.append(trajectory(experiment, step, sample, rollout, worker, rng, rewards[rollout],
                                          round(rewards[rollout] - mean, 6)))
    return out


def node_of(worker: str, nodes: int) -> int:
    """Workers are spread over nodes in blocks (two per node with 8 workers and 4 nodes), as Ray places them."""
    return int(worker[1:]) * nodes // WORKERS


def batches(trajectories: list[Trajectory], per_trajectory: bool = False) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(worker, spans) batches in sending order: per step and worker, its trajectories, then its rewards
    (``per_trajectory``: one batch per trajectory and one per reward, workers interleaved, as a
    sender thread posting as the agent loops finish would)."""
    for step in STEPS:
        if per_trajectory:
            mine = [t for t in trajectories if t.step == step]
            order = sorted(mine, key=lambda t: (int(t.worker[1:]) * 7 + t.sample_index * 3 + t.rollout) % 11)
            for t in order:
                yield t.worker, t.spans
            for t in order:
                yield t.worker, [t.reward]
            continue
        for w in range(WORKERS):
            mine = [t for t in trajectories if t.step == step and t.worker == f"w{w}"]
            if mine:
                yield f"w{w}", [s for t in mine for s in t.spans]
                yield f"w{w}", [t.reward for t in mine]


def post(client: httpx.Client, url: str, worker: str, spans: list[dict[str, Any]], **envelope: Any) -> dict[str, Any]:
    """One v1 batch from ``worker``; asserts it was taken whole (2xx, nothing rejected)."""
    body = {"v": 1, "worker": worker, "project": "cluster-proj", **envelope, "spans": spans}
    for _ in range(60):
        r = client.post(url + "/v1/spans", json=body, timeout=30)
        if r.status_code != 503:
            break
        time.sleep(float(r.headers.get("retry-after", "1")))
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["rejected_count"] == 0, answer
    return answer


def kept_set(url: str, experiment: str, step: int, headers: dict[str, str] | None = None,
             **params: Any) -> dict[str, tuple[bool, str]]:
    """trace_id -> (kept, rule or reason) of one step's tail decisions (``/v1/decisions``)."""
    answer = httpx.get(url + "/v1/decisions", params={"experiment": experiment, "step": step, **params}, headers=headers,
                       timeout=30).json()
    return {d["trace_id"]: (d["keep"], d["rule"] if d["keep"] else d["reason"]) for d in answer["decisions"]}


class Feeder(threading.Thread):
    """Posts each batch to its worker's node until acknowledged (2xx), in order; counts what it did."""

    def __init__(self, node_urls: list[str], plan: list[tuple[str, list[dict[str, Any]]]], pace_s: float,
                 headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> None:
        super().__init__(daemon=True)
        self.node_urls, self.plan, self.pace_s = node_urls, plan, pace_s
        self.headers, self.timeout_s = headers or {}, timeout_s
        self.acked: list[str] = []  # span ids, in acknowledgement order
        self.done_batches = 0
        self.failed_posts = 0
        self.errors: list[str] = []  # answers that refused spans (none expected)
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(headers=self.headers) as client:
            for worker, spans in self.plan:
                url = self.node_urls[node_of(worker, len(self.node_urls))]
                while not self.stop.is_set():
                    try:
                        r = client.post(url + "/v1/spans", json={"v": 1, "worker": worker, "project": "cluster-proj",
                                                                 "spans": spans}, timeout=self.timeout_s)
                    except httpx.HTTPError:
                        r = None
                    if r is not None and r.status_code == 200:
                        if r.json()["rejected_count"]:
                            self.errors.append(r.text[:500])
                        self.acked.extend(s["span_id"] for s in spans)
                        break
                    self.failed_posts += 1
                    time.sleep(0.05)
                self.done_batches += 1
                time.sleep(self.pace_s)

    def progress(self) -> float:
        return self.done_batches / len(self.plan)
