"""``tracecar demo``: a VERL-shaped rollout that feeds a running collector (also the quickstart's)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from .common import collector_url, get_json


def cmd_demo(args: argparse.Namespace) -> None:
    from .. import tracer
    from ..demo import run_demo

    experiment = args.experiment or os.environ.get("TRACECAR_EXPERIMENT") or "demo"
    project = args.project or os.environ.get("TRACECAR_PROJECT") or "tracecar-demo"
    get_json(args, "/healthz")  # one line now if the collector is not there, not 30 s of retries
    tr = tracer.configure(url=collector_url(args), experiment=experiment, project=project)
    started = time.perf_counter()
    n = asyncio.run(run_demo(args.steps, args.samples, args.rollout_n, args.seed))
    drained = tracer.flush(30)
    stats = tr.stats() if tr else {}
    print(f"demo: {n} trajectories in {time.perf_counter() - started:.2f}s; sent {stats.get('sent', 0)} spans, "
          f"dropped {stats.get('dropped_total', 0)} {stats.get('dropped', {})}{'' if drained else ' (flush timed out)'}")
    if not drained or stats.get("dropped_total", 0) or not stats.get("sent"):
        sys.exit(1)
