"""Live view at scale: ``/v1/live``'s query (collector/spool/live.py) on a store of a million spans.

Builds (or reuses, ``--keep``) the viewer benchmark's store (bench/viewer_store.py: ~7 spans per
demo-shaped trajectory, all received within the last minutes, so every row is inside the live
window: the worst case), adds ``--running`` trajectories whose root has not arrived (2 finished
calls each, plus open markers for the call that hangs), then times the live query three ways:
the default scan cap (the newest 50,000 spans), a cap of the whole store, and one step. The
baseline, from the same run on the same file, is the /v1/trajectories page (collector/viewer/list_api.py
over the viewer's trajectory index, caught up first; newest first, page of 50). Prints each time and its
ratio to the baseline.

    .venv/bin/python bench/live_store.py [--spans 1000000] [--running 200] [--keep DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import orjson
from viewer_store import build, timed

from tracecar.collector.processors.open_calls import OpenCalls
from tracecar.collector.spool.live import running_trajectories
from tracecar.collector.spool.store import Spool, SpoolRow
from tracecar.collector.trajectory_filter import TrajectoryFilter
from tracecar.collector.viewer.index import TrajectoryIndex
from tracecar.collector.viewer.list_api import list_page


def add_running(spool: Spool, n: int, opens: OpenCalls, write_spans: bool = True) -> None:
    now = time.time()
    rows, markers = [], []
    for i in range(n):
        trace = f"live{i:028x}"
        attrs = {"experiment_name": "exp1", "step": 999_999, "sample_index": i, "rollout_n": 0, "validate": False}
        base = {"trace_id": trace, "worker": "bench", "project": "p", "entity": None, "attributes": attrs,
                "exception": None, "inputs": {}, "output": None}
        run = f"{trace}r"
        for j, name in enumerate(("LLMServerClient.generate", "CalculatorTool.execute")):
            span = {**base, "span_id": f"{trace}c{j}", "parent_id": run, "name": name, "kind": "op",
                    "start_time": now - 30 + j, "end_time": now - 29.5 + j}
            rows.append(SpoolRow(span, orjson.dumps(span), None))
        for span_id, parent, name in ((trace, None, "agent_loop"), (run, trace, "ToolAgentLoop.run"),
                                      (f"{trace}c2", run, "SearchTool.execute")):
            markers.append({"span_id": span_id + ".open", "trace_id": trace, "parent_id": parent, "name": name,
                            "start_time": now - 30, "worker": "bench", "attributes": attrs})
    if write_spans:
        spool.write(rows)
    opens.opened(markers, now)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--running", type=int, default=200)
    parser.add_argument("--keep", type=Path, help="build (or reuse) the store in this directory")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="tracecar-live-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spool.sqlite3"
    if not path.exists():
        started = time.perf_counter()
        spans, trajectories = build(path, args.spans)
        print(f"built {spans:,} spans / {trajectories:,} trajectories in {time.perf_counter() - started:.0f}s")
    spool = Spool(path, local_only=True)
    opens = OpenCalls(100_000)
    kept = bool(spool.query("SELECT 1 AS x FROM spans WHERE trace_id LIKE 'live%' LIMIT 1"))
    add_running(spool, args.running, opens, write_spans=not kept)  # a kept store has the spans: markers only
    total = spool.query("SELECT COUNT(*) AS n FROM spans")[0]["n"]
    print(f"store: {total:,} spans, {args.running} running trajectories at its end")

    def live(max_scan: int, flt: TrajectoryFilter) -> dict:
        return running_trajectories(spool, flt, window_s=3600, max_scan_spans=max_scan, limit=100,
                                    open_calls=lambda: opens.snapshot(0))

    index = TrajectoryIndex(path)
    started = time.perf_counter()
    while not index.refresh(5.0):
        pass
    print(f"viewer index caught up in {time.perf_counter() - started:.1f}s (one time; incremental after)")
    baseline = timed(lambda: list_page(index, TrajectoryFilter(), sort="start", descending=True, limit=50, offset=0, budget_s=5.0))
    print(f"{'query':44} {'ms':>8} {'this / baseline':>16}")
    print(f"{'baseline: /v1/trajectories page, newest first':44} {baseline:8.1f} {'1.0x':>16}")
    for name, cap, flt in (("/v1/live, default cap (50,000 newest spans)", 50_000, TrajectoryFilter()),
                           ("/v1/live, whole store scanned", 10**9, TrajectoryFilter()),
                           ("/v1/live?step= (one step)", 50_000, TrajectoryFilter(experiment="exp1", step=999_999))):
        answer = live(cap, flt)
        ms = timed(lambda cap=cap, flt=flt: live(cap, flt))
        print(f"{name:44} {ms:8.1f} {ms / baseline:15.1f}x   ({answer['total']} running, scan_capped={answer['scan_capped']})")
    index.close()
    spool.close()


if __name__ == "__main__":
    main()
