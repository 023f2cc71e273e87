"""One VERL-shaped rollout worker process for tests/test_verl_workload_whole.py.

Usage: python verl_workload_worker.py URL WORKER_NUMBER MANIFEST_PATH

Plays what one VERL AgentLoopWorker does over a short run, through the real tracecar client:
training steps 1 and 2 with int sample indices (each announced first, as the adapter does per
``generate_sequences``; ``rollout_n`` = 2), a validation pass reusing step 2 with string (uuid-like)
indices, fully-async rollouts with ``step = -1`` under two policy versions, a ``trace=False``
sample, failing tool calls, nested sync and async ops, and a reward annotation per trajectory.
Trajectories of one call run concurrently with seeded random delays, so they finish out of
order. Writes a manifest of every traced trajectory (and how many spans it sent).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys

from tracecar.client import annotate, announce_step, rollout_trace_attr, rollout_trace_op
from tracecar.client import tracer as tracer_module
from tracecar.client.config import ClientConfig

EXPERIMENT = "multi"


class Tool:
    @rollout_trace_op
    def parse(self, text: str) -> dict:  # a sync op inside an async one
        return {"name": text[:4]}

    @rollout_trace_op
    async def execute(self, index, n: int) -> str:
        await asyncio.sleep(0)
        self.parse(f"call{index}")
        if n == 1:
            raise ValueError(f"tool failed for {index}")
        return "ok"


class Loop:
    def __init__(self, rng: random.Random) -> None:
        self.tool, self.rng = Tool(), rng

    @rollout_trace_op
    async def generate(self, prompt_ids: list[int]) -> dict:
        await asyncio.sleep(self.rng.random() * 0.01)
        return {"response_ids": prompt_ids[::-1]}

    @rollout_trace_op
    async def run(self, index, n: int) -> dict:
        out = await self.generate([1, 2, n])
        try:
            await self.tool.execute(index, n)
        except ValueError:
            pass
        await asyncio.sleep(self.rng.random() * 0.02)
        return {"response_ids": out["response_ids"]}


#: Spans one traced trajectory sends: root, run, generate, execute, parse + its reward annotation.
SPANS_PER_TRAJECTORY = 6


async def one(loop: Loop, manifest: list, step: int, index, n: int, validate: bool = False, version=None,
              trace: bool = True) -> None:
    extra = {} if version is None else {"policy_version": version}
    with rollout_trace_attr(sample_index=index, step=step, rollout_n=n, name="agent_loop", validate=validate,
                            trace=trace, **extra) as traj:
        await loop.run(index, n)
        if trace:
            annotate(reward=float(n) + (hash(str(index)) % 7) / 10)
    if traj is not None:
        manifest.append({"trace_id": traj.span_id, "step": step, "sample_index": index, "rollout_n": n,
                         "validate": validate, "policy_version": version, "spans": SPANS_PER_TRAJECTORY})


async def main(url: str, k: int, path: str) -> None:
    tracer = tracer_module.configure(ClientConfig(url=url, experiment=EXPERIMENT, worker_id=f"worker-{k}",
                                                  flush_interval_s=0.02))
    rng = random.Random(100 + k)
    loop = Loop(rng)
    manifest: list = []
    for step in (1, 2):
        indices = [k * 10 + j for j in range(5)]
        announce_step(step, [i for i in indices for _ in range(2)])
        await asyncio.gather(*(one(loop, manifest, step, i, n) for i in indices for n in range(2)))
    val = [f"val-{k}-{j:02d}-7d3f" for j in range(4)]
    announce_step(2, val, validate=True)
    await asyncio.gather(*(one(loop, manifest, 2, i, 0, validate=True) for i in val))
    for version in (0, 1):  # fully async: one sample per call, step -1, no membership
        await asyncio.gather(*(one(loop, manifest, -1, f"async-{k}-{version}-{j}", 0, version=version) for j in range(3)))
    await one(loop, manifest, 3, k * 10, 0, trace=False)  # VERL's trace=False: nothing is sent
    assert tracer.flush(30), "spans not delivered"
    with open(path, "w") as f:
        json.dump(manifest, f)
    tracer_module.shutdown(10)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
