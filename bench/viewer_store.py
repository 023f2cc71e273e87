"""Viewer at scale: the trajectory list's page queries on a store of a million spans.

Builds a spool of demo-shaped trajectories (root, agent-loop run, 2-4 generate calls with
token ids and decoded text, 1-3 tool calls, a reward annotation: about 7 spans each), then
times, per query, the ``/v1/trajectories`` API's page (collector/viewer/list_api.py: the index
let catch up, then its list) against the viewer's own list (collector/viewer/index.py, what
``/ui/api/trajectories`` answers) with the same filter and sort, in this process on the same file:
one list now, so the ratio should be near 1 (before, the API was SQL over the spans: 3.6-7.8 s a
page, docs/performance.md). Prints each ratio (API ms / viewer ms), the index's
one-time catch-up, and its page of EXPLAIN QUERY PLAN; the list's prompt/response previews and text
searches (collector/viewer/search.py) against the same page without previews. Then the GRPO group view of one step
(collector/viewer/groups.py) and the dataset export (collector/viewer/export.py): its rate, and its peak
traced memory for 1,000 against 8,000 trajectories (constant memory: a ratio near 1); with
``--http``, the same through a collector process (``/v1/groups`` latency, ``/v1/export`` of the
whole store with the collector's RSS sampled).

    .venv/bin/python bench/viewer_store.py [--spans 1000000] [--keep DIR] [--groups-export-only | --list-only] [--http]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import orjson

from tracecar.collector.processors.token_arrays import TokenArrays
from tracecar.collector.spool.store import Spool, SpoolRow
from tracecar.collector.viewer.index import ListFilter, TrajectoryIndex
from tracecar.collector.viewer.list_api import list_page

TOPICS = ("compute the area of a circle", "add two fractions", "factor a quadratic", "convert miles to kilometres",
          "find the median", "solve for x", "count the primes below n", "simplify the expression")


def trajectory(rng: random.Random, t: int, per_step: int) -> list[dict]:
    trace = f"{t:032x}"
    attrs = {"experiment_name": f"exp{t // 40_000}", "step": t // per_step + 1, "sample_index": (t % per_step) // 4,
             "rollout_n": t % 4, "validate": False}
    if t % 5:
        attrs["kept_because"] = ("reward_max", "reward_min", "error", "fill")[t % 4]
    attrs["data_source"] = "rare" if t % 1000 == 7 else f"src{t % 10}"  # what attr= filters on: a tenth, a thousandth
    base = {"trace_id": trace, "worker": "bench", "project": "p", "entity": None, "attributes": attrs, "exception": None}
    start = 1_700_000_000.0 + t
    spans, prompt = [], list(range(40))
    run = f"{trace}r"
    turns = rng.randint(2, 4)
    for i in range(turns):
        reply = [rng.randrange(100_000) for _ in range(rng.randint(8, 40))]
        # searchable text (search.py): a topic per sample, a task number per trajectory, a final answer
        prompt_text = f"<|user|>Task {t}: {TOPICS[attrs['sample_index'] % len(TOPICS)]}<|assistant|>" + "p" * len(prompt)
        response_text = f"The answer is {rng.randrange(10_000)}." if i == turns - 1 else '<tool_call>{"expression": "1+1"}</tool_call>'
        spans.append({**base, "span_id": f"{trace}g{i}", "parent_id": run, "name": "LLMServerClient.generate", "kind": "op",
                      "start_time": start + i, "end_time": start + i + 0.5, "inputs": {"prompt_ids": prompt},
                      "output": {"token_ids": reply, "prompt_text": prompt_text, "response_text": response_text}})
        prompt = prompt + reply
        if i < turns - 1:
            failed = rng.random() < 0.2
            spans.append({**base, "span_id": f"{trace}t{i}", "parent_id": run, "name": "CalculatorTool.execute", "kind": "op",
                          "start_time": start + i + 0.5, "end_time": start + i + 0.6, "inputs": {"parameters": {"expression": "1+1"}},
                          "output": None if failed else {"result": 2}, "exception": "ValueError: bad" if failed else None})
    spans.append({**base, "span_id": run, "parent_id": trace, "name": "ToolAgentLoop.run", "kind": "op", "start_time": start,
                  "end_time": start + turns, "inputs": {}, "output": {"response_ids": prompt[40:], "num_turns": turns}})
    spans.append({**base, "span_id": trace, "parent_id": None, "name": "agent_loop", "kind": "trajectory", "start_time": start,
                  "end_time": start + turns + rng.random(), "inputs": {}, "output": None})
    spans.append({**base, "span_id": f"{trace}a", "parent_id": None, "name": "annotation", "kind": "annotation",
                  "start_time": start + turns + 1, "end_time": start + turns + 1,
                  "attributes": {"reward": round(rng.uniform(-1, 1), 3), "reward_extra_info": {"acc": t % 3 == 0, "format": t % 2}},
                  "inputs": {}, "output": None})
    if t % 4 == 0:  # what the trainer did (client.annotate), on a quarter of the trajectories
        note = ({"trained": False, "filtered_by": ("overlong", "dynamic_sampling")[t % 8 // 4]} if t % 8 == 0 else
                {"trained": True, "advantage": round(rng.uniform(-2, 2), 3), "policy_version": t // 256,
                 "trained_on_version": t // 256 + 1})
        spans.append({**base, "span_id": f"{trace}b", "parent_id": None, "name": "annotation", "kind": "annotation",
                      "start_time": start + turns + 2, "end_time": start + turns + 2, "attributes": note, "inputs": {}, "output": None})
    return spans


def token_blob(span: dict) -> bytes | None:
    """Per-token arrays of an agent loop's output (response_mask, response_logprobs), packed as the collector packs them."""
    ids = (span.get("output") or {}).get("response_ids")
    if span["name"] != "ToolAgentLoop.run" or not ids:
        return None
    return TokenArrays(ids=ids, logprobs=[-0.01 * (i % 50) for i in range(len(ids))], mask=[i % 3 != 0 for i in range(len(ids))],
                       ends=list(range(1, len(ids) + 1))).pack()


def build(path: Path, target: int) -> tuple[int, int]:
    spool = Spool(path, local_only=True, sync="normal")
    rng = random.Random(0)
    n = t = 0
    batch: list[SpoolRow] = []
    while n < target:
        for span in trajectory(rng, t, 256):
            batch.append(SpoolRow(span, orjson.dumps(span), None, token_arrays=token_blob(span)))
        t += 1
        if len(batch) >= 5000:
            spool.write(batch)
            n += len(batch)
            batch = []
    if batch:
        spool.write(batch)
        n += len(batch)
    spool.close()
    return n, t


def timed(fn, repeat: int = 5) -> float:
    fn()  # warm the page cache
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


def groups_and_export(spool: Spool, index: TrajectoryIndex) -> None:
    """GET /v1/groups' work for one step (64 groups of 4), and the export's rate and memory."""
    import tracemalloc

    from tracecar.collector.viewer.export import jsonl_chunks, parquet_chunks, records
    from tracecar.collector.viewer.group_export_api import groups_of_step

    class Owner:  # what groups_of_step reads off the collector
        pass

    owner = Owner()
    owner.spool = spool  # type: ignore[attr-defined]
    for name, options in (("groups of one step, 50, no diffs", {"diff": False}),
                          ("groups of one step, 20 with diffs", {"limit": 20}),
                          ("groups of one step, 64 with diffs", {"limit": 64})):
        ms = timed(lambda: groups_of_step(owner, index, "exp1", 200, False, **options), 3)  # type: ignore[arg-type]
        print(f"{name:32} {'':>15} {ms:10.1f}")
    import pyarrow.parquet  # noqa: F401 - imported before measuring (its import is not the export's memory)

    for fmt, writer in (("jsonl", jsonl_chunks), ("parquet", parquet_chunks)):
        started = time.perf_counter()
        size = sum(len(chunk) for chunk in writer(records(spool, index, ListFilter(), limit=8_000, token_ids=True)))
        rate = 8_000 / (time.perf_counter() - started)
        peaks = []
        for count in (1_000, 8_000):  # memory: 8x the trajectories, the same peak
            tracemalloc.start()
            for _ in writer(records(spool, index, ListFilter(step_min=100), limit=count, token_ids=True)):
                pass
            peaks.append(tracemalloc.get_traced_memory()[1] / 2**20)
            tracemalloc.stop()
        print(f"export {fmt}: {rate:,.0f} trajectories/s ({size / 2**20:,.1f} MiB for 8,000); peak traced memory "
              f"{peaks[0]:.1f} MiB for 1,000, {peaks[1]:.1f} MiB for 8,000 (ratio {peaks[1] / peaks[0]:.2f})")


def over_http(folder: Path, trajectories: int) -> None:
    """The same through a collector process: GET /v1/groups latency, and GET /v1/export of the whole
    store in both formats while the collector's RSS is sampled (it must stay flat)."""
    import threading

    import httpx
    import psutil

    from common import services, start_collector

    collector = start_collector(folder)
    with services(collector):
        httpx.get(collector.url + "/ui/api/status", timeout=120)
        for label, params in (("all 64 groups, diffs", {}), ("20 groups, diffs", {"limit": 20}),
                              ("20 widest groups, diffs", {"sort": "spread", "limit": 20})):
            ms = timed(lambda: httpx.get(collector.url + "/v1/groups", params={"experiment": "exp1", "step": 200, **params},
                                         timeout=60).raise_for_status())
            print(f"GET /v1/groups, {label:24} {ms:8.1f} ms")
        process = psutil.Process(collector.proc.pid)
        for fmt in ("jsonl", "parquet"):
            before = process.memory_info().rss
            peak, stop = [before], threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    peak[0] = max(peak[0], process.memory_info().rss)
                    time.sleep(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            started, size = time.perf_counter(), 0
            with httpx.stream("GET", collector.url + "/v1/export", params={"format": fmt, "token_ids": "true"}, timeout=600) as r:
                for chunk in r.iter_bytes():
                    size += len(chunk)
            elapsed = time.perf_counter() - started
            stop.set()
            sampler.join()
            print(f"GET /v1/export?format={fmt}, whole store: {size / 2**20:,.0f} MiB in {elapsed:.0f} s "
                  f"({trajectories / elapsed:,.0f} trajectories/s); collector RSS {before / 2**20:.0f} MiB before, "
                  f"peak {peak[0] / 2**20:.0f} MiB")


def search_cases(index: TrajectoryIndex) -> None:
    """The list with its prompt/response previews and text searches (search.py), each against the
    same page without previews (the list before previews existed), in this run."""
    plain = timed(lambda: index.list(ListFilter(), limit=50, previews=False))
    cases = [
        ("list newest, with previews", ListFilter(), "start"),
        ("list one step, with previews", ListFilter(experiment="exp1", step=200), "reward"),
        ("search 'task 12345' (1 hit)", ListFilter(q="task 12345"), "start"),  # t < trajectories built
        ("search 'quadratic' (1/8)", ListFilter(q="quadratic"), "start"),
        ("search 'quadratic', by reward", ListFilter(q="quadratic"), "reward"),
        ("search 'answer' (every one)", ListFilter(q="answer"), "start"),
        ("search 'answer 42' + one step", ListFilter(q="answer 42", experiment="exp1", step=200), "reward"),
        ("search 'nothingmatches'", ListFilter(q="nothingmatches"), "start"),
    ]
    print(f"{'list page of 50 (previews/search)':36} {'no previews ms':>15} {'this ms':>10} {'ratio':>8} {'total':>8}")
    for name, flt, sort in cases:
        ms = timed(lambda: index.list(flt, sort=sort, limit=50))
        total = index.list(flt, sort=sort, limit=1)["total"]
        print(f"{name:36} {plain:15.1f} {ms:10.1f} {ms / plain:7.2f}x {total:8,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--keep", type=Path, help="build (or reuse) the store in this directory")
    parser.add_argument("--groups-export-only", action="store_true", help="skip the list queries (groups and export only)")
    parser.add_argument("--list-only", action="store_true", help="the list, previews and search only (no groups, no export)")
    parser.add_argument("--http", action="store_true", help="also time /v1/groups and /v1/export through a collector process")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="tracecar-viewer-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spool.sqlite3"
    if not path.exists():
        started = time.perf_counter()
        spans, trajectories = build(path, args.spans)
        print(f"built {spans:,} spans / {trajectories:,} trajectories in {time.perf_counter() - started:.0f}s "
              f"({path.stat().st_size / 2**20:,.0f} MiB)")
    if not args.groups_export_only:
        (folder / "viewer-index.sqlite3").unlink(missing_ok=True)
    index = TrajectoryIndex(path)
    started = time.perf_counter()
    while not index.refresh(5.0):
        pass
    print(f"viewer index: one-time catch-up {time.perf_counter() - started:.1f}s, then incremental")
    spool = Spool(path, local_only=True)
    cases = [
        ("newest first, no filter", {}, "start", True),
        ("best reward, no filter", {}, "reward", True),
        ("worst reward, no filter", {}, "reward", False),
        ("longest duration, no filter", {}, "duration", True),
        ("one step, worst reward", {"experiment": "exp1", "step": 200}, "reward", False),
        ("step range, best reward", {"step_min": 10, "step_max": 20}, "reward", True),
        ("reward range, newest", {"reward_min": 0.9}, "start", True),
        ("dropped by the trainer, newest", {"trained": False}, "start", True),
        ("filtered by one rule, best", {"filtered_by": "overlong"}, "reward", True),
    ]
    print(f"{'query (page of 50)':32} {'/v1/traj. ms':>15} {'viewer ms':>10} {'ratio':>8}")
    for name, filters, sort, descending in [] if args.groups_export_only else cases:
        api = timed(lambda: list_page(index, ListFilter(**filters), sort=sort, descending=descending, limit=50, offset=0,
                                      budget_s=5.0))
        view = timed(lambda: index.list(ListFilter(**filters), sort=sort, descending=descending, limit=50))
        print(f"{name:32} {api:15.1f} {view:10.1f} {api / view:7.2f}x")
    view = timed(lambda: index.list(ListFilter(), sort="turns", limit=50))
    print(f"{'most turns, no filter':32} {'(no such sort)':>15} {view:10.1f}")
    from tracecar.collector.viewer.tokens import trajectory_tokens

    some = index.list(ListFilter(), limit=1)["trajectories"][0]["trace_id"]
    print(f"{'token view of one trajectory':32} {'':>15} {timed(lambda: trajectory_tokens(spool, some)):10.1f}")
    if not args.groups_export_only:
        search_cases(index)
    index._cache.clear()
    print(f"{'step overview of one experiment':32} {'':>15} {timed(lambda: (index._cache.clear(), index.overview('exp1'))):10.1f}")
    if not args.list_only:
        groups_and_export(spool, index)
    sql, params = index.list_sql(ListFilter(), "reward", True, nulls=False)
    print("plan, best reward:", " | ".join(r[3] for r in index._db().execute("EXPLAIN QUERY PLAN " + sql, [*params, 50, 0])))
    trajectories = index.list(ListFilter(), limit=1)["total"]
    index.close()
    spool.close()
    if args.http:
        over_http(folder, trajectories)


if __name__ == "__main__":
    main()
