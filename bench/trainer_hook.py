"""Trainer-side cost of ``verl_trainer.hook_trainer()`` per training step (issue 29), ABAB in one run.

Runs in the VERL venv (``.venv-verl/bin/python bench/trainer_hook.py``): VERL 0.9.1's own
``ray_trainer.compute_advantage`` (GRPO) on a ``DataProto`` shaped like a step's batch
(``--batch`` sequences × ``--prompt`` + ``--response`` tokens, every sequence traced), called
from a trainer's ``fit`` frame, interleaved per round:

  A  no hook (the baseline)
  B  the hook with trainer rows in the background (the default): the step's critical path
  C  the hook without trainer rows (the annotations only)
  D  the hook with trainer rows packed inline (``"sync"``): B's background work, made visible

Each variant's median wall time per step and its ratio to A in the same run. The client sends to
a real collector on 127.0.0.1 (a subprocess, stopped at the end); the background thread is
drained between rounds so one round's work never lands in the next one's timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import collector_env, free_port, launch_collector  # noqa: E402


def make_batch(n: int, prompt: int, response: int, ids: list[str]) -> Any:
    import numpy as np
    import torch
    from verl.protocol import DataProto

    g = torch.Generator().manual_seed(0)
    responses = torch.randint(0, 100_000, (n, response), generator=g)
    mask = torch.ones((n, response), dtype=torch.long)
    mask[:, response // 3: response // 3 + 64] = 0  # a tool response
    lengths = torch.randint(response // 2, response + 1, (n,), generator=g)
    for i, length in enumerate(lengths.tolist()):
        mask[i, length:] = 0
    attention = torch.cat([torch.ones((n, prompt), dtype=torch.long), (torch.arange(response)[None, :] < lengths[:, None]).long()], 1)
    scores = torch.zeros((n, response))
    scores[torch.arange(n), lengths - 1] = torch.rand(n, generator=g)
    tensors = {"prompts": torch.randint(0, 100_000, (n, prompt), generator=g), "responses": responses,
               "attention_mask": attention, "response_mask": mask, "token_level_rewards": scores,
               "old_log_probs": -torch.rand((n, response), generator=g), "ref_log_prob": -torch.rand((n, response), generator=g)}
    non = {"tracecar_trace_id": np.array(ids, dtype=object), "uid": np.array([f"u{i // 8}" for i in range(n)], dtype=object),
           "acc": np.array([i % 2 for i in range(n)]), "reward_model": np.array([{"ground_truth": "42"}] * n, dtype=object)}
    return DataProto.from_dict(tensors=tensors, non_tensors=non, meta_info={"reward_extra_keys": ["acc"]})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.torch_threads)

    from verl.trainer.ppo import ray_trainer

    from tracecar.client import tracer, verl_tokens, verl_trainer

    port = free_port()
    data_dir = Path(f"/tmp/tracecar-bench-trainer-{port}")
    data_dir.mkdir(parents=True, exist_ok=True)
    service = launch_collector(collector_env(port, data_dir, backend="local"), data_dir / "collector.log")
    try:
        tracer.configure(url=f"http://127.0.0.1:{port}", flush_interval_s=0.05, queue_max_spans=1 << 20)
        ids = [f"{i + 1:032x}" for i in range(args.batch)]
        original = ray_trainer.compute_advantage

        class Trainer:
            global_steps = 1

            def fit(self, batch: Any) -> Any:
                return ray_trainer.compute_advantage(batch, adv_estimator=ray_trainer.AdvantageEstimator.GRPO, num_repeat=8)

        def step(mode: Any) -> tuple[float, float]:
            batch = make_batch(args.batch, args.prompt, args.response, ids)
            ray_trainer.compute_advantage = original
            if mode is not None:
                verl_trainer.hook_trainer(ray_trainer, trainer_tokens=mode)
            started, cpu = time.perf_counter(), time.thread_time()
            Trainer().fit(batch)
            took, cpu = time.perf_counter() - started, time.thread_time() - cpu
            ray_trainer.compute_advantage = original
            verl_tokens.drain(120)
            tracer.flush(120)
            return took * 1000, cpu * 1000

        variants = {"A no hook": None, "B hook, rows in background": True, "C hook, no rows": False, "D hook, rows inline": "sync"}
        step(True)  # warm-up: imports, the packing thread, the collector's first batches
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, mode in variants.items():
                times[name].append(step(mode))
        base = statistics.median(t for t, _ in times["A no hook"])
        base_cpu = statistics.median(c for _, c in times["A no hook"])
        print(f"compute_advantage per step, {args.batch} sequences x {args.prompt}+{args.response} tokens, {args.rounds} interleaved"
              f" rounds, torch threads {torch.get_num_threads()} (median wall ms and the step thread's CPU ms; ratio to A in this run)")
        for name, values in times.items():
            median = statistics.median(t for t, _ in values)
            cpu = statistics.median(c for _, c in values)
            print(f"  {name:30} wall {median:8.2f} ms x{median / base:5.2f} (+{median - base:6.2f})"
                  f"   step-thread CPU {cpu:8.2f} ms x{cpu / base_cpu:5.2f} (+{cpu - base_cpu:6.2f})")
        print(f"  rows sent: {verl_tokens.stats['rows']}, steps dropped: {verl_tokens.stats['dropped_steps']}")
    finally:
        tracer.shutdown(10)
        service.stop()


if __name__ == "__main__":
    main()
