"""tracecar's collector against Arize Phoenix (``phoenix serve``), fed the same rollout spans.

Each system is started on 127.0.0.1 in its own temporary working directory, then fed by
``--senders`` processes (default 2), each sending its share of ``--spans`` rollout calls (default
10,000; 1,500 prompt ids + 500 response ids, a tool call and a reward, the call of
bench/hot_path.py) grouped into trajectories of ``--turns`` calls under one root span:

  tracecar  the real client (rollout_trace_attr + rollout_trace_op) to ``tracecar serve``
            (local store, token2text off, the defaults otherwise)
  phoenix   the OpenTelemetry SDK (BatchSpanProcessor + OTLP/HTTP exporter) with OpenInference
            JSON attributes (bench/hot_path.py's otel peer) to ``phoenix serve`` on SQLite

Senders build everything first, then start together on one signal. Printed per system:
  * time to acknowledged: from the signal until every sender's flush returned (all spans
    answered 2xx), with the spans each client dropped;
  * time to queryable: until every span is in the store (tracecar: ``tracecar_spans_forwarded_total``
    {backend="local"}, counted as spans reach the store; Phoenix: rows in its SQLite ``spans`` table);
  * server CPU-s per 1,000 spans (the server process and its children, signal to queryable), and
    the senders' own CPU per 1,000;
  * peak RSS of the server (process and children, sampled every 0.1 s).
Bounded: ``--timeout`` seconds for the whole wait per system (default 300).

Phoenix is installed in its own venv (its pins clash with weave's):
    python3.11 -m venv bench/.venv-phoenix && bench/.venv-phoenix/bin/pip install arize-phoenix
    .venv/bin/python bench/vs_phoenix.py --phoenix bench/.venv-phoenix/bin/phoenix
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from common import (
    PY,
    Service,
    clean_env,
    free_port,
    header,
    machine_note,
    ratio,
    scrape,
    start_collector,
    start_service,
    table,
    token_ids,
    tool_call,
)

DEAD_PROXY = "http://127.0.0.1:9"


# ---- sender child ----------------------------------------------------------------------
def run_sender(args: argparse.Namespace) -> None:
    """Builds the client, says ready, waits for 'go' on stdin, sends, flushes, prints one JSON line."""
    import hot_path

    rng = random.Random(args.index)
    inputs = [(token_ids(1500, rng), token_ids(500, rng), tool_call(rng), round(rng.random(), 3)) for _ in range(8)]
    queue = args.count + args.count // args.turns + 64
    if args.sender == "tracecar":
        from tracecar.client import rollout_trace_attr, rollout_trace_op, tracer

        tr = tracer.configure(url=args.url, experiment="vs-phoenix", queue_max_spans=queue)
        loop = hot_path.make_loop(rollout_trace_op)

        def trajectory(j: int) -> Any:
            return rollout_trace_attr(sample_index=args.index * 1_000_000 + j, step=1, rollout_n=0)

        flush = lambda: tr.flush(args.timeout)  # noqa: E731
        dropped = lambda: tr.stats()["dropped_total"]  # noqa: E731
    else:
        from opentelemetry import trace

        decorate, otel_flush, delivered = hot_path.setup_otel(args.url, queue, project="vs-phoenix")
        loop = hot_path.make_loop(decorate)
        root = trace.get_tracer("bench.vs_phoenix")

        def trajectory(j: int) -> Any:
            return root.start_as_current_span("rollout_trace", attributes={
                "openinference.span.kind": "CHAIN", "metadata": json.dumps({"sample_index": args.index * 1_000_000 + j,
                                                                             "step": 1, "rollout_n": 0})})

        flush = otel_flush
        dropped = lambda: sent - delivered()  # noqa: E731
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0, t0 = time.process_time(), time.perf_counter()
    sent = 0
    for j in range(args.count // args.turns):
        with trajectory(j):
            for t in range(args.turns):
                loop.step(*inputs[(j + t) & 7])
                sent += 1
        sent += 1  # the root span
    flush()
    print(json.dumps({"ack_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0, "spans": sent,
                      "dropped": dropped()}), flush=True)


# ---- servers ---------------------------------------------------------------------------
def start_phoenix(phoenix: str, workdir: Path) -> Service:
    port, grpc = free_port(), free_port()
    env = clean_env(PHOENIX_WORKING_DIR=workdir, PHOENIX_HOST="127.0.0.1", PHOENIX_PORT=port, PHOENIX_GRPC_PORT=grpc,
                    PHOENIX_TELEMETRY_ENABLED="false", PHOENIX_SQL_DATABASE_URL=f"sqlite:///{workdir / 'phoenix.db'}",
                    HTTP_PROXY=DEAD_PROXY, HTTPS_PROXY=DEAD_PROXY, NO_PROXY="127.0.0.1,localhost",
                    HF_HUB_OFFLINE="1", DO_NOT_TRACK="1")
    return start_service("phoenix", [phoenix, "serve"], f"http://127.0.0.1:{port}/healthz", workdir / "phoenix.log",
                         timeout=180, poll_s=0.2, stdout_to_log=True, env=env, cwd=str(workdir), stdin=subprocess.DEVNULL)


def tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


def tree_cpu(pid: int) -> float:
    total = 0.0
    for p in tree(pid):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def tree_rss(pid: int) -> int:
    total = 0
    for p in tree(pid):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def stored_count(system: str, service: Service, workdir: Path) -> int:
    if system == "tracecar":
        m = scrape(service.url)
        return int(m.total("tracecar_spans_forwarded_total", backend="local"))
    db = workdir / "phoenix.db"
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            return con.execute("SELECT COUNT(*) FROM spans").fetchone()[0]
    except sqlite3.OperationalError:
        return 0  # table not created yet / locked for a moment


def run_system(system: str, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"tracecar-bench-{system}-"))
    try:
        if system == "tracecar":
            service = start_collector(work / "collector", token2text=False, backend="local")
        else:
            service = start_phoenix(args.phoenix, work)
        try:
            return feed_and_wait(system, service, work, args)
        finally:
            service.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def feed_and_wait(system: str, service: Service, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    per = args.spans // args.senders
    senders = [subprocess.Popen([PY, str(Path(__file__).resolve()), "--sender", system, "--url", service.url,
                                 "--count", str(per), "--turns", str(args.turns), "--index", str(i),
                                 "--timeout", str(args.timeout)],
                                env=clean_env(NO_PROXY="127.0.0.1,localhost", HTTP_PROXY=DEAD_PROXY, HTTPS_PROXY=DEAD_PROXY),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(args.senders)]
    try:
        for s in senders:
            line = s.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"{system} sender failed: {line}{s.stderr.read()[-3000:]}")
        expected = args.senders * (per + per // args.turns)
        base = stored_count(system, service, work)
        peak = [tree_rss(service.pid)]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.1):
                peak[0] = max(peak[0], tree_rss(service.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        cpu0, t0 = tree_cpu(service.pid), time.perf_counter()
        for s in senders:
            s.stdin.write("go\n")
            s.stdin.flush()
        reports = []
        for s in senders:
            out, err = s.communicate(timeout=args.timeout)
            if s.returncode != 0:
                raise RuntimeError(f"{system} sender exited {s.returncode}: {err[-3000:]}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
        ack_s = time.perf_counter() - t0
        deadline, stored = t0 + args.timeout, 0
        while time.perf_counter() < deadline:
            stored = stored_count(system, service, work) - base
            if stored >= expected:
                break
            time.sleep(0.1)
        query_s = time.perf_counter() - t0
        cpu = tree_cpu(service.pid) - cpu0
        stop.set()
        sampler.join()
        return {"system": system, "spans": sum(r["spans"] for r in reports), "expected": expected, "stored": stored,
                "dropped": sum(r["dropped"] for r in reports), "ack_s": ack_s, "query_s": query_s,
                "complete": stored >= expected, "server_cpu_per_1k": cpu * 1000 / max(1, stored),
                "sender_cpu_per_1k": sum(r["cpu_s"] for r in reports) * 1000 / max(1, expected),
                "peak_rss_mib": peak[0] / 2**20}
    finally:
        for s in senders:
            if s.poll() is None:
                s.kill()
                s.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description="tracecar's collector against Arize Phoenix, same spans.")
    parser.add_argument("--spans", type=int, default=10_000, help="rollout calls in all (each a span), split over the senders")
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4, help="calls per trajectory (one root span each)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait per system, in all")
    parser.add_argument("--phoenix", default=str(Path(__file__).resolve().parent / ".venv-phoenix/bin/phoenix"),
                        help="the phoenix executable (its own venv)")
    parser.add_argument("--systems", default="tracecar,phoenix")
    parser.add_argument("--sender", choices=("tracecar", "phoenix"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sender:
        run_sender(args)
        return
    print(machine_note())
    results = {s: run_system(s, args) for s in args.systems.split(",")}
    header(f"{args.spans:,} rollout spans (+ {args.spans // args.turns:,} trajectory roots) from {args.senders} sender processes")
    print(table([[r["system"], r["spans"], r["dropped"], r["stored"], r["ack_s"],
                  r["query_s"] if r["complete"] else f">{r['query_s']:.0f} (incomplete)",
                  r["spans"] / r["query_s"], r["server_cpu_per_1k"], r["sender_cpu_per_1k"], r["peak_rss_mib"]]
                 for r in results.values()],
                ["system", "spans sent", "dropped", "stored", "acknowledged s", "queryable s", "spans/s to queryable",
                 "server CPU-s / 1k", "sender CPU-s / 1k", "server peak RSS MiB"]))
    print("\n" + machine_note())
    header("RATIOS")
    if "tracecar" in results and "phoenix" in results:
        t, p = results["tracecar"], results["phoenix"]
        print(f"phoenix / tracecar: time to acknowledged {ratio(p['ack_s'], t['ack_s']):.1f}x, time to queryable "
              f"{ratio(p['query_s'], t['query_s']):.1f}x{'' if p['complete'] else ' (phoenix incomplete at the time bound)'}, "
              f"server CPU per span {ratio(p['server_cpu_per_1k'], t['server_cpu_per_1k']):.1f}x, "
              f"peak RSS {ratio(p['peak_rss_mib'], t['peak_rss_mib']):.1f}x")


if __name__ == "__main__":
    main()
