"""Hot-path cost per traced call, tracecar against its peers, each doing the same work.

One agent-loop method (1,500 prompt ids, 500 response ids, a tool-call dict, a reward) is called
N times in each mode, each mode in a fresh process:

  plain     the undecorated method: the baseline every "added" figure subtracts
  tracecar  tracecar's rollout_trace_op, the real client posting to a collector on 127.0.0.1
  otel      the OpenTelemetry SDK: TracerProvider + BatchSpanProcessor + the OTLP/HTTP exporter
            (to the loopback sink stub), inputs and output as OpenInference-style JSON attributes
            (``input.value`` / ``output.value``, ``openinference.span.kind``), as OpenInference's
            instrumentors record them
  mlflow    VERL's ``mlflow`` backend (verl/utils/rollout_trace.py): ``enable_async_logging``,
            tracking URI ``sqlite:///<tmp>/mlruns.db`` (VERL's default is /tmp/mlruns.db),
            ``mlflow.start_span`` per call with ``set_inputs`` / ``set_outputs``
  weave     VERL's in-process weave backend: ``weave.init`` + ``create_call`` / ``finish_call``
            per call (bench/verl_style.py), to the loopback sink stub; one run per interpreter
            given in ``--weave-pythons`` (weave's per-value cost differs between 3.11 and 3.12)
  optional: verl_off, tracecar_off (decorated, tracing off), plain_burst / tracecar_burst (no gap),
            tracecar_legacy[_burst] (the client's previous packing, ``TRACECAR_PACKING=legacy``: the
            same-run baseline of the packing work)

What is measured, per mode:
  * caller time: perf_counter_ns around each call after warm-up; "added" = mode minus plain
    (median and p99);
  * background CPU per call (after warm-up calls and a flush, so connections and lazy imports
    are paid before timing): process CPU minus the calling thread's (time.thread_time) over the
    timed calls, plus the CPU of the whole process while flushing afterwards (what the peer's
    threads still owed), divided by the calls. Every thread shares the worker's GIL, so the
    headline is added caller median + background CPU per call;
  * drops: spans traced minus spans the peer delivered (tracecar: the client's own counters;
    otel: spans its exporter reported exported; mlflow: traces in its tracking store; weave:
    calls the loopback stub received). A figure with drops is not a cost figure: queues are sized
    to the run (``--queue``) and calls are paced by ``--gap-us`` of sleep (outside the timed
    region; an agent loop awaits the GPU between traced calls).

``--traj-calls N`` groups the calls into trajectories of N (tracecar: a ``rollout_trace_attr``
each, OTel: a parent span each; both are spans sent). Every run also reports the whole process's
CPU per call over the calls and the flush after, minus plain's: the worker's total for tracing
(caller + background + what was still owed when the calls ended), and the backlog (spans still
queued when the calls ended: a sender that keeps up holds about one body's worth at most).
``--rounds R`` runs the modes R times in alternating order (ABBA) and prints each round's
tracecar / peer ratio of that total, its median and spread (issue 32's worker figure):

    .venv/bin/python bench/hot_path.py --modes plain,tracecar,otel --calls 3000 --gap-us 100 --traj-calls 4 --rounds 6

By default nothing is pinned; ``--pin`` puts the caller (and all its threads) on CPU 0 and the
collector + stub on CPU 1, which makes a peer with many background threads (weave) pay their CPU
on the caller's core and inflates its caller figure.

    .venv/bin/python bench/hot_path.py [--pin] [--calls 5000] [--gap-us 200]
        [--mlflow-python bench/.venv-mlflow/bin/python]
        [--weave-pythons .venv/bin/python,bench/.venv-weave312/bin/python]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from common import (
    BENCH,
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

MODES = ("plain", "verl_off", "tracecar_off", "tracecar", "tracecar_legacy", "otel", "mlflow", "weave", "plain_burst", "tracecar_burst",
         "tracecar_legacy_burst")
DEFAULT_MODES = "plain,tracecar,otel,mlflow,weave"
PEERS = ("otel", "mlflow", "weave")


# ---- child: one mode in its own process ------------------------------------------------
def make_loop(decorate: Callable[[Callable[..., Any]], Callable[..., Any]] | None) -> Any:
    class ToolAgentLoop:
        def step(self, prompt_ids: list[int], response_ids: list[int], tool_call: dict[str, Any], reward: float) -> dict[str, Any]:
            """One turn's bookkeeping: what VERL's agent loop hands its traced methods."""
            return {"num_turns": 3, "reward": reward, "tool": tool_call["name"], "response_len": len(response_ids)}

    if decorate is not None:
        ToolAgentLoop.step = decorate(ToolAgentLoop.step)  # type: ignore[method-assign]
    return ToolAgentLoop()


def bound_inputs(sig: inspect.Signature, self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name without ``self``, as VERL's rollout_trace_op builds them."""
    bound = sig.bind(self, *args, **kwargs)
    bound.apply_defaults()
    inputs = dict(bound.arguments)
    del inputs["self"]
    return inputs


def setup_otel(base_url: str, queue: int,
               project: str = "bench-rollout") -> tuple[Callable[..., Any], Callable[[], Any], Callable[[], int]]:
    """OpenTelemetry SDK + OTLP/HTTP, attributes the OpenInference way; returns decorate, flush, delivered.

    The provider becomes the global one, so ``opentelemetry.trace.get_tracer`` opens parents of the
    decorated calls (bench/vs_phoenix.py's trajectory roots).
    """
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

    class CountingExporter(OTLPSpanExporter):
        """The real exporter; counts the spans it reports exported (the rest were dropped)."""

        exported = 0

        def export(self, spans: Any) -> Any:
            result = super().export(spans)
            if result == SpanExportResult.SUCCESS:
                CountingExporter.exported += len(spans)
            return result

    provider = TracerProvider(resource=Resource.create({"service.name": project, "openinference.project.name": project}))
    provider.add_span_processor(BatchSpanProcessor(CountingExporter(endpoint=base_url + "/v1/traces"),
                                                   max_queue_size=queue))
    trace.set_tracer_provider(provider)
    otel_tracer = provider.get_tracer("bench.hot_path")
    attrs = {"sample_index": 0, "step": 1, "rollout_n": 0, "experiment_name": "bench"}

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        sig, name = inspect.signature(func), func.__qualname__

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            inputs = bound_inputs(sig, self, args, kwargs)
            with otel_tracer.start_as_current_span(name) as span:
                span.set_attribute("openinference.span.kind", "CHAIN")
                span.set_attribute("input.value", json.dumps(inputs))
                span.set_attribute("input.mime_type", "application/json")
                span.set_attribute("metadata", json.dumps(attrs))
                result = func(self, *args, **kwargs)
                span.set_attribute("output.value", json.dumps(result))
                span.set_attribute("output.mime_type", "application/json")
                return result

        return wrapper

    return decorate, lambda: provider.force_flush(120_000), lambda: CountingExporter.exported


def setup_mlflow(workdir: str) -> tuple[Callable[..., Any], Callable[[], Any], Callable[[], int]]:
    """VERL's mlflow backend: async logging, a SQLite tracking store, start_span with inputs/outputs."""
    import mlflow

    db = Path(workdir) / "mlruns.db"
    mlflow.config.enable_async_logging()
    mlflow.set_tracking_uri(f"sqlite:///{db}")
    mlflow.set_experiment(WEAVE_PROJECT)

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        sig, name = inspect.signature(func), func.__qualname__

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            inputs = bound_inputs(sig, self, args, kwargs)
            with mlflow.start_span(name=name) as span:
                span.set_inputs(inputs)
                result = func(self, *args, **kwargs)
                span.set_outputs(result)
            return result

        return wrapper

    def flush() -> None:
        mlflow.flush_trace_async_logging(terminate=False)

    def delivered() -> int:
        with sqlite3.connect(db) as con:
            return con.execute("SELECT COUNT(*) FROM trace_info").fetchone()[0]

    return decorate, flush, delivered


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    burst = args.child.endswith("_burst")
    mode = args.child.removesuffix("_burst")
    rng = random.Random(1)
    inputs = [(token_ids(1500, rng), token_ids(500, rng), tool_call(rng), round(rng.random(), 3)) for _ in range(8)]
    flush: Callable[[], Any] = lambda: None  # noqa: E731
    delivered: Callable[[], int | None] = lambda: None  # noqa: E731
    stats: Callable[[], dict[str, Any]] = dict
    context: Any = None
    queue = args.queue or max(2048, args.calls + args.warmup + 64)
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
            delivered = lambda: httpx.get(args.stub + "/_stats", timeout=10).json()["calls"]  # noqa: E731
    elif mode == "otel":
        decorate, flush, delivered = setup_otel(args.stub, queue)
        loop = make_loop(decorate)
    elif mode == "mlflow":
        decorate, flush, delivered = setup_mlflow(args.workdir)
        loop = make_loop(decorate)
    else:
        from tracecar.client import rollout_trace_attr, rollout_trace_op, tracer

        if mode != "tracecar_off":
            # packing only when asked: bench/ab.py runs this child under older clients without it
            legacy: dict[str, Any] = {"packing": "legacy"} if mode == "tracecar_legacy" else {}
            tr = tracer.configure(url=args.collector, experiment="bench", queue_max_spans=queue, **legacy)
            flush = lambda: tr.flush(120)  # noqa: E731
            stats = tr.stats
            delivered = lambda: tr.stats()["sent"]  # noqa: E731 - includes the rollout_trace_attr span
        loop = make_loop(rollout_trace_op)
        context = rollout_trace_attr(sample_index=0, step=1, rollout_n=0)

    trajectory = trajectory_opener(mode, args.traj_calls)
    gap_s = 0 if burst else args.gap_us / 1e6
    limit_s = args.weave_seconds if mode == "weave" else args.seconds
    warmup = 3 if mode == "weave" else args.warmup
    step, ns = loop.step, time.perf_counter_ns
    durations: list[int] = []
    if per_traj := args.traj_calls:
        context = None  # each trajectory is its own context (below)
    if context is not None:
        context.__enter__()
    received0 = delivered() if mode == "weave" else 0  # the stub is shared: count this run's calls only
    for i in range(warmup):
        if per_traj and i % per_traj == 0:
            warm = trajectory(10**6 + i // per_traj)
            warm.__enter__()
        step(*inputs[i % 8])
        if per_traj and (i % per_traj == per_traj - 1 or i == warmup - 1):
            warm.__exit__(None, None, None)
    flush()  # warm-up spans delivered: connections open, lazy imports done, queues empty before timing
    proc0, thread0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
    deadline = wall0 + limit_s
    open_traj = None
    for i in range(args.calls):
        a = inputs[i & 7]
        if per_traj and i % per_traj == 0:
            open_traj = trajectory(i // per_traj)
            open_traj.__enter__()
        t0 = ns()
        step(*a)
        durations.append(ns() - t0)
        if per_traj and i % per_traj == per_traj - 1:
            open_traj.__exit__(None, None, None)  # type: ignore[union-attr]
            open_traj = None
        if gap_s:
            time.sleep(gap_s)
        if (i & 15) == 0 and time.perf_counter() > deadline:
            break
    if open_traj is not None:
        open_traj.__exit__(None, None, None)
    proc1, thread1, wall1 = time.process_time(), time.thread_time(), time.perf_counter()
    backlog = backlog_of(mode)
    if context is not None:
        context.__exit__(None, None, None)
    flush()
    proc2, wall2 = time.process_time(), time.perf_counter()
    n = len(durations)
    # trajectories are spans too (tracecar's rollout_trace_attr, OTel's parent span)
    traced = n + warmup + (-(-n // per_traj) + -(-warmup // per_traj) if per_traj else 0)
    traced = traced if mode not in ("plain", "verl_off", "tracecar_off") else 0
    got = delivered()
    if got is not None and mode == "weave":
        got -= received0
    us = [d / 1000 for d in durations]
    bg_loop = ((proc1 - proc0) - (thread1 - thread0)) * 1e6 / n
    flush_cpu = (proc2 - proc1) * 1e6 / n
    return {
        "mode": args.child, "calls": n, "median_us": median(us), "p99_us": percentile(us, 99), "mean_us": sum(us) / n,
        "bg_loop_us": bg_loop, "flush_cpu_us": flush_cpu, "bg_cpu_us_per_call": bg_loop + flush_cpu,
        # the whole worker's CPU per call, caller included (loop + what was still owed at its end);
        # minus plain's in the report: "total" = caller + sender + owed
        "proc_cpu_us": (proc2 - proc0) * 1e6 / n, "backlog": backlog,
        "flush_s": wall2 - wall1, "loop_s": wall1 - wall0, "stats": stats(), "python": sys.version.split()[0],
        "traced": traced, "delivered": got, "traj_calls": per_traj,
        "dropped": stats()["dropped_total"] if "dropped_total" in stats() else max(0, traced - got) if got is not None and traced else 0,
    }


def trajectory_opener(mode: str, per_traj: int) -> Callable[[int], Any]:
    """``--traj-calls``: what opens one trajectory of that many calls (a context manager by index):
    tracecar's ``rollout_trace_attr`` (its own span), OTel a parent span; other peers none."""
    if not per_traj or mode not in ("tracecar", "tracecar_legacy", "otel"):
        return lambda k: contextlib.nullcontext()
    if mode == "otel":
        from opentelemetry import trace

        parent = trace.get_tracer("bench.hot_path")
        return lambda k: parent.start_as_current_span("trajectory", attributes={"sample_index": k, "step": 1})
    from tracecar.client import rollout_trace_attr

    return lambda k: rollout_trace_attr(sample_index=k, step=1, rollout_n=0)


def backlog_of(mode: str) -> int | None:
    """Spans still waiting in the peer's queue when the timed calls end (a sender that keeps up
    holds at most about one body's worth): tracecar's queue, OTel's BatchSpanProcessor queue."""
    try:
        if mode.startswith("tracecar") and mode != "tracecar_off":
            from tracecar.client import tracer

            return len(tracer.active.sender.queue) if tracer.active else None
        if mode == "otel":
            from opentelemetry import trace

            for proc in trace.get_tracer_provider()._active_span_processor._span_processors:  # type: ignore[attr-defined]
                inner = getattr(proc, "_batch_processor", proc)
                queue = getattr(inner, "_queue", None)
                if queue is not None:
                    return len(queue)
    except Exception:  # noqa: BLE001 - a peer's internals moved: no figure rather than a wrong one
        return None
    return None


# ---- parent: services, one child per mode, the report ----------------------------------
def mode_runs(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(label, mode, interpreter) for every run: weave once per interpreter in --weave-pythons."""
    runs = []
    for mode in args.modes.split(","):
        if mode == "weave":
            for python in map(os.path.abspath, (args.weave_pythons or PY).split(",")):
                ver = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                     capture_output=True, text=True, check=True).stdout.strip()
                runs.append((f"weave_py{ver}", mode, python))
        elif mode == "mlflow":
            runs.append((mode, mode, os.path.abspath(args.mlflow_python) if args.mlflow_python else PY))
        else:
            runs.append((mode, mode, PY))
    return runs


def run_mode(mode: str, python: str, args: argparse.Namespace, stub_url: str, collector_url: str, work: Path) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=work))
    cmd = [python, str(Path(__file__).resolve()), "--child", mode, "--calls", str(args.calls), "--warmup", str(args.warmup),
           "--gap-us", str(args.gap_us), "--seconds", str(args.seconds), "--weave-seconds", str(args.weave_seconds),
           "--queue", str(args.queue), "--traj-calls", str(args.traj_calls),
           "--stub", stub_url, "--collector", collector_url, "--workdir", str(workdir)]
    # TRACECAR_OPEN_MARKERS passes through: the live view's markers A/B (on by default)
    # an inherited PYTHONPATH stays behind bench/: a same-run A/B against another tree's code
    # (PYTHONPATH=<that tree>/tests/typecheck) reaches the children
    pythonpath = os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run(cmd, env=clean_env(NO_PROXY="127.0.0.1,localhost", PYTHONPATH=pythonpath,
                                            TRACECAR_OPEN_MARKERS=os.environ.get("TRACECAR_OPEN_MARKERS")), capture_output=True,
                         text=True, timeout=args.weave_seconds + args.seconds + 240, cwd=str(workdir),
                         preexec_fn=pin(WORKER_CPUS) if args.pin else None)
    if out.returncode != 0:
        raise RuntimeError(f"mode {mode} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description="Per-call cost of tracing on the caller's path, against peers.")
    parser.add_argument("--calls", type=int, default=5000, help="timed calls per mode (each mode stops at its time bound)")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--gap-us", type=float, default=200.0, help="sleep between calls (not timed); 0 = tight loop")
    parser.add_argument("--seconds", type=float, default=20.0, help="time bound of the timed loop, per mode")
    parser.add_argument("--weave-seconds", type=float, default=20.0, help="time bound of each weave run's timed loop")
    parser.add_argument("--queue", type=int, default=0, help="span queue size of tracecar and otel (0: calls + warm-up, no drops)")
    parser.add_argument("--traj-calls", type=int, default=0,
                        help="calls per trajectory (tracecar: a rollout_trace_attr each, OTel: a parent span); 0: one for the run")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the modes this many times, alternating their order (ABBA), and print each round's "
                             "tracecar / cheapest-peer ratio of total worker CPU per call with its spread")
    parser.add_argument("--weave-pythons", default=None, help="comma-separated interpreters with weave; one weave run each")
    parser.add_argument("--mlflow-python", default=None, help="interpreter with mlflow (its own venv: its pins clash)")
    parser.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of {','.join(MODES)}")
    parser.add_argument("--pin", action="store_true", help="pin the caller to CPU 0 and collector + stub to CPU 1")
    parser.add_argument("--no-pin", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old commands
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--stub", help=argparse.SUPPRESS)
    parser.add_argument("--collector", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return

    print(machine_note())
    work = Path(tempfile.mkdtemp(prefix="tracecar-bench-hot-"))
    sidecar = SIDECAR_CPUS if args.pin else None
    results: dict[str, dict[str, Any]] = {}
    try:
        stub = start_stub(workdir=work, cpus=sidecar)
        with services(stub):
            collector = start_collector(work / "collector", cpus=sidecar)
            print("pinning: " + (f"caller on CPU {sorted(WORKER_CPUS)}, collector + stub on CPU {sorted(sidecar)}"
                                 if sidecar else "none (the scheduler places every thread)"))
            with services(collector):
                rounds = []
                for r in range(args.rounds):
                    results = {}
                    run_all(args, stub.url, collector.url, work, results, reverse=r % 2 == 1)
                    rounds.append(results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results, args)
    if args.rounds > 1:
        report_rounds(rounds)


def run_all(args: argparse.Namespace, stub_url: str, collector_url: str, work: Path, results: dict[str, dict[str, Any]],
            reverse: bool = False) -> None:
    runs = mode_runs(args)
    # plain first always (the baseline the others subtract), the rest in alternating order
    runs = runs[:1] + runs[1:][::-1] if reverse and runs and runs[0][1] == "plain" else runs[::-1] if reverse else runs
    for label, mode, python in runs:
        results[label] = r = run_mode(mode, python, args, stub_url, collector_url, work)
        print(f"  {label:15} {r['calls']:>6} calls  median {r['median_us']:10.2f} µs  p99 {r['p99_us']:10.2f} µs"
              f"  bg {r['bg_cpu_us_per_call']:10.1f} µs/call  cpu {r['proc_cpu_us']:8.1f} µs/call  backlog {r.get('backlog')}"
              f"  dropped {r['dropped']}  (python {r['python']})", flush=True)


def total_cpu(results: dict[str, dict[str, Any]], label: str) -> float:
    """The worker's CPU per call for tracing (caller + background + owed at the end of the calls):
    the process's CPU over the calls and the flush after, minus the undecorated run's."""
    base = results.get("plain_burst" if label.endswith("_burst") else "plain")
    return results[label]["proc_cpu_us"] - (base["proc_cpu_us"] if base else 0.0)


def report_rounds(rounds: list[dict[str, dict[str, Any]]]) -> None:
    """Each round's tracecar / peer ratio of total worker CPU per call (the rounds alternate the
    modes' order), its median and spread: the same-run figure; and whether the sender kept up."""
    header(f"INTERLEAVED: {len(rounds)} rounds, total worker CPU per call (caller + sender + owed at the end), minus plain")
    peers = sorted({k for r in rounds for k in r if k.split("_py")[0] in PEERS})
    rows = []
    for i, r in enumerate(rounds):
        if "tracecar" not in r:
            continue
        t = r["tracecar"]
        row = [i + 1, total_cpu(r, "tracecar"), t["flush_cpu_us"], t.get("backlog"), t["dropped"]]
        for p in peers:
            row += [total_cpu(r, p), r[p]["dropped"], ratio(total_cpu(r, "tracecar"), total_cpu(r, p))]
        rows.append(row)
    heads = ["round", "tracecar µs/call", "owed µs/call", "backlog", "dropped"]
    for p in peers:
        heads += [f"{p} µs/call", f"{p} dropped", f"tracecar/{p}"]
    print(table(rows, heads))
    for j, p in enumerate(peers):
        got = [row[7 + 3 * j] for row in rows]
        print(f"tracecar / {p}, total worker CPU per call: median {median(got):.3f} (1/{ratio(1, median(got)):.1f}), "
              f"spread {min(got):.3f}-{max(got):.3f} over {len(got)} rounds")
    print("backlog = spans still queued when the calls ended (keeping up: at most about one body's worth); "
          "owed = CPU the process spent flushing after the calls, per call")


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    zero = {"median_us": 0.0, "p99_us": 0.0}
    header(f"hot path: per call (gap {args.gap_us:g} µs between calls; *_burst: none; "
           f"pinning: {'caller CPU 0, services CPU 1' if args.pin else 'none'})")
    rows = []
    for label, r in results.items():
        base = results.get("plain_burst" if label.endswith("_burst") else "plain", zero)
        r["added_med"], r["added_p99"] = r["median_us"] - base["median_us"], r["p99_us"] - base["p99_us"]
        r["headline"] = r["added_med"] + r["bg_cpu_us_per_call"]
        rows.append([label, r["python"], r["calls"], r["added_med"], r["added_p99"], r["bg_loop_us"], r["flush_cpu_us"],
                     r["headline"], total_cpu(results, label), r.get("backlog", "-"), r["traced"],
                     r["delivered"] if r["delivered"] is not None else "-", r["dropped"]])
    print(table(rows, ["mode", "python", "calls", "added med µs", "added p99 µs", "bg CPU µs/call", "flush CPU µs/call",
                       "added+bg µs", "total CPU µs", "backlog", "traced", "delivered", "dropped"]))
    print("added = mode minus plain (median / p99 of the caller's time); bg CPU = other threads' CPU during the calls; "
          "flush CPU = the process while flushing afterwards; added+bg = added median + bg + flush, per call; "
          "total CPU = the process's CPU over the calls and the flush, minus plain's (caller + background + owed); "
          "backlog = spans queued when the calls ended")
    for label in ("tracecar", "tracecar_burst", "tracecar_legacy", "tracecar_legacy_burst"):
        if label in results:
            s = results[label]["stats"]
            print(f"{label}: client stats sent={s.get('sent')} dropped={s.get('dropped')} queued={s.get('queued')}")
    print("\n" + machine_note())
    header("RATIOS")
    drops = {k: r["dropped"] for k, r in results.items() if r["dropped"]}
    if drops:
        print(f"WARNING: spans dropped {drops}: those figures are not cost figures (pace with --gap-us, size --queue)")
    for old, new in (("tracecar_legacy", "tracecar"), ("tracecar_legacy_burst", "tracecar_burst")):
        if old in results and new in results:
            a, b = results[old], results[new]
            print(f"{old} / {new} (previous packing / this one): added median {ratio(a['added_med'], b['added_med']):.2f}x   "
                  f"bg CPU {a['bg_cpu_us_per_call']:.1f} / {b['bg_cpu_us_per_call']:.1f} µs = "
                  f"{ratio(a['bg_cpu_us_per_call'], b['bg_cpu_us_per_call']):.2f}x   added+bg {ratio(a['headline'], b['headline']):.2f}x")
    peers = {k: r for k, r in results.items() if k.split("_py")[0] in PEERS}
    t = results.get("tracecar")
    if t is None or not peers:
        return
    for label, p in peers.items():
        print(f"{label:>14} / tracecar: added median {ratio(p['added_med'], t['added_med']):10,.1f}x   "
              f"p99 {ratio(p['added_p99'], t['added_p99']):10,.1f}x   "
              f"bg CPU {ratio(p['bg_cpu_us_per_call'], t['bg_cpu_us_per_call']):8,.1f}x"
              f"   added+bg {ratio(p['headline'], t['headline']):10,.1f}x")
    cheapest = min(peers, key=lambda k: peers[k]["headline"])
    c = peers[cheapest]
    caller_ok = t["added_med"] <= c["added_med"] / 50
    bg_ok = t["bg_cpu_us_per_call"] <= c["bg_cpu_us_per_call"] / 5
    print(f"cheapest peer (added+bg): {cheapest} ({c['headline']:,.1f} µs/call; tracecar {t['headline']:,.1f})")
    print(f"goal added caller time <= 1/50 of {cheapest}'s: tracecar {t['added_med']:.2f} µs vs {c['added_med']:.1f} µs = "
          f"1/{ratio(c['added_med'], t['added_med']):.1f}  {'MET' if caller_ok else 'NOT MET'}")
    print(f"goal background CPU <= 1/5 of {cheapest}'s: tracecar {t['bg_cpu_us_per_call']:.1f} µs vs "
          f"{c['bg_cpu_us_per_call']:.1f} µs = 1/{ratio(c['bg_cpu_us_per_call'], t['bg_cpu_us_per_call']):.2f}  "
          f"{'MET' if bg_ok else 'NOT MET'}")


if __name__ == "__main__":
    main()
