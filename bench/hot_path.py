"""Hot-path cost per traced call: what tracing adds on the caller's thread, and behind it.

One agent-loop method (1,500 prompt ids, 500 response ids, a tool-call dict, a reward) is called
N times in each mode, each mode in a fresh process:

  plain         the undecorated method (baseline a)
  verl_off      VERL-style rollout_trace_op, no backend            (a, decorated, tracing off)
  tracecar_off  tracecar's rollout_trace_op, TRACECAR_URL unset    (a, decorated, tracing off)
  weave         VERL-style in-process weave: weave.init + create_call/finish_call per call (b),
                sending to a loopback stub trace server (bench/sink_stub.py)
  tracecar      tracecar's client posting to a running collector subprocess (c)
  *_burst       plain / tracecar with no gap between calls: a hot loop, caches warm, and the
                sender thread competing for the GIL with every call

Calls are spaced by ``--gap-us`` of sleep (outside the timed region; an agent loop awaits the GPU
between traced calls). perf_counter_ns brackets each call after warm-up. Background CPU is the
process CPU time minus the calling thread's, over the timed calls, then over the flush. The
caller is pinned to CPU 0, the collector and stub to CPU 1 (``--no-pin`` turns that off).

    .venv/bin/python bench/hot_path.py [--calls 5000] [--weave-seconds 20] [--gap-us 100]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from common import (
    PY,
    SIDECAR_CPUS,
    WEAVE_PROJECT,
    WORKER_CPUS,
    clean_env,
    header,
    machine_note,
    median,
    percentile,
    pin,
    ratio,
    services,
    start_collector,
    start_stub,
    table,
    token_ids,
    tool_call,
    weave_env,
)

MODES = ("plain", "verl_off", "tracecar_off", "weave", "tracecar", "plain_burst", "tracecar_burst")


# ---- child: one mode in its own process ------------------------------------------------
def make_loop(decorate: Callable[[Callable[..., Any]], Callable[..., Any]] | None) -> Any:
    class ToolAgentLoop:
        def step(self, prompt_ids: list[int], response_ids: list[int], tool_call: dict[str, Any], reward: float) -> dict[str, Any]:
            """One turn's bookkeeping: what VERL's agent loop hands its traced methods."""
            return {"num_turns": 3, "reward": reward, "tool": tool_call["name"], "response_len": len(response_ids)}

    if decorate is not None:
        ToolAgentLoop.step = decorate(ToolAgentLoop.step)  # type: ignore[method-assign]
    return ToolAgentLoop()


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    burst = args.child.endswith("_burst")
    mode = args.child.removesuffix("_burst")
    rng = random.Random(1)
    inputs = [(token_ids(1500, rng), token_ids(500, rng), tool_call(rng), round(rng.random(), 3)) for _ in range(8)]
    flush: Callable[[], Any] = lambda: None  # noqa: E731
    stats: Callable[[], dict[str, Any]] = dict
    context: Any = None
    if mode == "plain":
        loop = make_loop(None)
    elif mode in ("verl_off", "weave"):
        import verl_style

        if mode == "weave":
            os.environ.update(weave_env(args.stub))
        verl_style.RolloutTraceConfig.init(WEAVE_PROJECT, "bench", "weave" if mode == "weave" else None)
        loop = make_loop(verl_style.rollout_trace_op)
        context = verl_style.rollout_trace_attr(sample_index=0, step=1, rollout_n=0)
        if mode == "weave":
            flush = verl_style.RolloutTraceConfig.client.flush
    else:
        from tracecar.client import rollout_trace_attr, rollout_trace_op, tracer

        if mode != "tracecar_off":
            tr = tracer.configure(url=args.collector, experiment="bench")
            flush = lambda: tr.flush(120)  # noqa: E731
            stats = tr.stats
        loop = make_loop(rollout_trace_op)
        context = rollout_trace_attr(sample_index=0, step=1, rollout_n=0)

    gap_s = 0 if burst else args.gap_us / 1e6
    limit_s = args.weave_seconds if mode == "weave" else args.seconds
    warmup = 3 if mode == "weave" else args.warmup
    step, ns = loop.step, time.perf_counter_ns
    durations: list[int] = []
    if context is not None:
        context.__enter__()
    for i in range(warmup):
        step(*inputs[i % 8])
    proc0, thread0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
    deadline = wall0 + limit_s
    for i in range(args.calls):
        a = inputs[i & 7]
        t0 = ns()
        step(*a)
        durations.append(ns() - t0)
        if gap_s:
            time.sleep(gap_s)
        if (i & 15) == 0 and time.perf_counter() > deadline:
            break
    proc1, thread1, wall1 = time.process_time(), time.thread_time(), time.perf_counter()
    if context is not None:
        context.__exit__(None, None, None)
    flush()
    proc2, wall2 = time.process_time(), time.perf_counter()
    n = len(durations)
    us = [d / 1000 for d in durations]
    return {
        "mode": args.child, "calls": n, "median_us": median(us), "p99_us": percentile(us, 99), "mean_us": sum(us) / n,
        "bg_cpu_us_per_call": ((proc1 - proc0) - (thread1 - thread0)) * 1e6 / n,
        "flush_cpu_us_per_call": (proc2 - proc1) * 1e6 / n, "flush_s": wall2 - wall1,
        "loop_s": wall1 - wall0, "stats": stats(), "python": sys.version.split()[0],
    }


# ---- parent: services, one child per mode, the report ----------------------------------
def run_mode(mode: str, args: argparse.Namespace, stub_url: str, collector_url: str) -> dict[str, Any]:
    python = args.weave_python if (mode == "weave" and args.weave_python) else PY
    cmd = [python, __file__, "--child", mode, "--calls", str(args.calls), "--warmup", str(args.warmup),
           "--gap-us", str(args.gap_us), "--seconds", str(args.seconds), "--weave-seconds", str(args.weave_seconds),
           "--stub", stub_url, "--collector", collector_url]
    out = subprocess.run(cmd, env=clean_env(NO_PROXY="127.0.0.1,localhost"), capture_output=True, text=True,
                         timeout=args.weave_seconds + args.seconds + 240, preexec_fn=None if args.no_pin else pin(WORKER_CPUS))
    if out.returncode != 0:
        raise RuntimeError(f"mode {mode} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description="Per-call cost of tracing on the caller's path.")
    parser.add_argument("--calls", type=int, default=5000, help="timed calls per mode (weave stops at --weave-seconds)")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--gap-us", type=float, default=100.0, help="sleep between calls (not timed); 0 = tight loop")
    parser.add_argument("--seconds", type=float, default=20.0, help="time bound of the timed loop, per mode")
    parser.add_argument("--weave-seconds", type=float, default=20.0, help="time bound of the weave mode's timed loop")
    parser.add_argument("--weave-python", default=None, help="interpreter for the weave mode (another venv with weave)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--no-pin", action="store_true", help="do not pin the caller to CPU 0 and collector + stub to CPU 1")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--stub", help=argparse.SUPPRESS)
    parser.add_argument("--collector", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return

    print(machine_note())
    work = Path(tempfile.mkdtemp(prefix="tracecar-bench-hot-"))
    sidecar = None if args.no_pin else SIDECAR_CPUS
    stub = start_stub(workdir=work, cpus=sidecar)
    collector = start_collector(work / "collector", cpus=sidecar)
    print("pinning: " + ("none" if sidecar is None else f"caller on CPU {sorted(WORKER_CPUS)}, collector + stub on CPU {sorted(sidecar)}"))
    results: dict[str, dict[str, Any]] = {}
    try:
        with services(stub, collector):
            for mode in args.modes.split(","):
                results[mode] = r = run_mode(mode, args, stub.url, collector.url)
                print(f"  {mode:15} {r['calls']:>6} calls  median {r['median_us']:10.2f} µs  p99 {r['p99_us']:10.2f} µs"
                      f"  (python {r['python']})", flush=True)
            stub_stats = httpx.get(stub.url + "/_stats", timeout=10).json()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results, stub_stats, args)


def report(results: dict[str, dict[str, Any]], stub_stats: dict[str, Any], args: argparse.Namespace) -> None:
    zero = {"median_us": 0.0, "p99_us": 0.0}
    header(f"hot path: per-call time on the caller's thread (gap {args.gap_us:g} µs between calls; *_burst: none)")
    rows = []
    for mode, r in results.items():
        base = results.get("plain_burst" if mode.endswith("_burst") else "plain", zero)
        rows.append([mode, r["calls"], r["median_us"], r["p99_us"], r["median_us"] - base["median_us"],
                     r["p99_us"] - base["p99_us"], r["bg_cpu_us_per_call"], r["flush_cpu_us_per_call"], r["flush_s"]])
    print(table(rows, ["mode", "calls", "median µs", "p99 µs", "added med µs", "added p99 µs",
                       "bg CPU µs/call", "flush CPU µs/call", "flush s"]))
    for mode in ("tracecar", "tracecar_burst"):
        if mode in results:
            s = results[mode]["stats"]
            print(f"{mode}: client stats sent={s.get('sent')} dropped={s.get('dropped')} queued={s.get('queued')}")
    print(f"weave stub saw {stub_stats.get('calls')} calls in {stub_stats.get('requests')} requests: {stub_stats.get('paths')}")
    print("added = mode minus plain (gap modes) or plain_burst (burst modes); bg CPU = process CPU minus the "
          "caller thread's during the timed calls; flush CPU = all threads while flushing afterwards")
    if "weave" in results and "tracecar" in results:
        base = results.get("plain", zero)
        w, t = results["weave"], results["tracecar"]
        w_add, t_add = w["median_us"] - base["median_us"], t["median_us"] - base["median_us"]
        w_p99, t_p99 = w["p99_us"] - base["p99_us"], t["p99_us"] - base["p99_us"]
        print("\n" + machine_note())
        header("RATIOS")
        print(f"weave_added / tracecar_added (median): {ratio(w_add, t_add):,.0f}x   (target >= 20x)")
        print(f"weave_added / tracecar_added (p99):    {ratio(w_p99, t_p99):,.0f}x")
        print(f"weave_bg_cpu / tracecar_bg_cpu per call: {ratio(w['bg_cpu_us_per_call'], t['bg_cpu_us_per_call']):,.1f}x")
        w_total = w['mean_us'] + w['bg_cpu_us_per_call'] + w['flush_cpu_us_per_call']
        t_total = t['mean_us'] + t['bg_cpu_us_per_call'] + t['flush_cpu_us_per_call']
        print(f"weave_total_cpu / tracecar_total_cpu per call (caller + background + flush): "
              f"{ratio(w_total, t_total):,.1f}x")
        print(f"tracecar added cost: {t_add:.2f} µs median, {t_p99:.2f} µs p99 per call   (target: a few µs)")
        if "tracecar_burst" in results and "plain_burst" in results:
            tb, pb = results["tracecar_burst"], results["plain_burst"]
            print(f"tracecar added cost, hot loop (burst): {tb['median_us'] - pb['median_us']:.2f} µs median, "
                  f"{tb['p99_us'] - pb['p99_us']:.2f} µs p99 per call")


if __name__ == "__main__":
    main()
