"""The read stores at scale: SQLite's trajectory index against ClickHouse (embedded chDB), same store, same run (ABAB).

Builds one spool of demo-shaped trajectories (bench/viewer_store.py: ~7 spans each, token ids
and decoded texts, rewards, trainer annotations), then brings each read store up to date with it
from nothing and times that (spans/s to queryable: the SQLite index folds the spans; the
ClickHouse store folds them through its own index and inserts the rows in batches), and then
times the same reads on both, alternating store by store for every query (A B A B ..., median
of ``--repeat``): the first list page, a filtered and sorted page, a deep page, text search (a
common word, a rare one), ``attr=`` (a tenth of the rows, a thousandth) and the truth filters (a reward
component; a fate with one), one step's rows in sample order (what ``/v1/groups`` reads), the
per-step counts (``/v1/health?step=``), the facets and overview, and an export walk of one
experiment (``page_after``). Prints each figure and the ratio ClickHouse / SQLite; RATIOS last.

    .venv/bin/python bench/read_stores.py [--spans 1000000] [--repeat 5] [--keep DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from viewer_store import build

from tracecar.collector.read_store import ReadStore
from tracecar.collector.settings import CollectorSettings
from tracecar.collector.trajectory_filter import TrajectoryFilter
from tracecar.collector.viewer.clickhouse_store import ClickHouseStore
from tracecar.collector.viewer.index import TrajectoryIndex

from common import machine_note


def catch_up(store: ReadStore) -> float:
    started = time.perf_counter()
    while not store.refresh(budget_s=5.0, all_held=True):
        pass
    return time.perf_counter() - started


def uncached(store: ReadStore) -> None:
    """Both stores keep facets and overviews until their next change: time what computing them costs."""
    getattr(store, "_cache").clear()  # noqa: B009 - not part of the ReadStore protocol


def walk(store: ReadStore, flt: TrajectoryFilter) -> int:
    after, n = 0, 0
    while True:
        rows = store.page_after(flt, after, 500)
        if not rows:
            return n
        n += len(rows)
        after = rows[-1]["cursor"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--keep", type=Path, help="build (or reuse) the spool in this directory")
    ap.add_argument("--reuse-stores", action="store_true",
                    help="with --keep: reuse the read stores a previous run left caught up there (times the reads again only)")
    args = ap.parse_args()
    print(machine_note(), flush=True)
    ratios: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tracecar-read-stores-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        spool = root / "spool.sqlite3"
        if not spool.exists():
            started = time.perf_counter()
            spans, trajectories = build(spool, args.spans)
            print(f"built {spans:,} spans ({trajectories:,} trajectories) in {time.perf_counter() - started:.0f} s")
        reuse = bool(args.keep and args.reuse_stores)
        for leftover in () if reuse else ("viewer-index.sqlite3", "ch-index.sqlite3"):
            for suffix in ("", "-wal", "-shm"):
                Path(str(root / leftover) + suffix).unlink(missing_ok=True)
        sqlite = TrajectoryIndex(spool)
        settings = CollectorSettings(data_dir=root, backend="local", store="clickhouse")
        ch_dir = root / "clickhouse"
        if ch_dir.exists() and not reuse:
            import shutil

            shutil.rmtree(ch_dir)
        clickhouse = ClickHouseStore(TrajectoryIndex(spool, root / "ch-index.sqlite3", track_changes=True), settings, ch_dir)
        stores: dict[str, ReadStore] = {"sqlite": sqlite, "clickhouse": clickhouse}
        total = sqlite.status()["latest_seq"]
        rates = {}
        for name, store in stores.items():
            seconds = catch_up(store)
            rates[name] = total / seconds
            print(f"{name:10} caught up with {total:,} spans in {seconds:6.1f} s: {rates[name]:9,.0f} spans/s to queryable",
                  flush=True)
        if not reuse:  # caught up already: the rates mean nothing
            ratios.append(f"{'spans/s to queryable, from nothing':45} {rates['clickhouse'] / rates['sqlite']:6.2f}")
        facets = sqlite.facets()
        experiment = facets["experiments"][-1]["experiment"]
        step = facets["experiments"][-1]["step_max"]
        n = sqlite.list(TrajectoryFilter(), limit=1)["total"]
        queries: list[tuple[str, Callable[[ReadStore], Any]]] = [
            ("list: first page (start desc)", lambda s: s.list(TrajectoryFilter(), limit=50)),
            ("list: experiment, reward asc, has_error", lambda s: s.list(
                TrajectoryFilter(experiment=experiment, has_error=True), sort="reward", descending=False, limit=50)),
            ("list: deep page (offset n/2, turns)", lambda s: s.list(TrajectoryFilter(), sort="turns", limit=50, offset=n // 2)),
            ("list: trained=false, kept_because=fill", lambda s: s.list(TrajectoryFilter(trained=False, kept_because="fill"),
                                                                          limit=50)),
            ("search: common word (q=answer)", lambda s: s.list(TrajectoryFilter(q="answer"), limit=50)),
            ("search: rare word (q=Task 12345)", lambda s: s.list(TrajectoryFilter(q="Task 12345"), limit=50)),
            ("attr: a tenth (attr=data_source=src3)", lambda s: s.list(
                TrajectoryFilter(attributes=(("data_source", "src3"),)), limit=50)),
            ("attr: a thousandth (attr=data_source=rare)", lambda s: s.list(
                TrajectoryFilter(attributes=(("data_source", "rare"),)), limit=50)),
            ("truth: reward component (where=acc=1)", lambda s: s.list(TrajectoryFilter(reward_where="acc=1"), limit=50)),
            ("truth: fate=filtered, where=format<1", lambda s: s.list(
                TrajectoryFilter(fate="filtered", reward_where="format<1"), limit=50)),
            ("groups: one step in sample order", lambda s: s.list(
                TrajectoryFilter(experiment=experiment, step=step, validate=False), sort="sample_index", descending=False,
                limit=200_000)),
            ("health: one step's counts", lambda s: s.step_counts(TrajectoryFilter(experiment=experiment, step=step))),
            ("facets (uncached)", lambda s: (uncached(s), s.facets())),
            ("overview: one experiment (uncached)", lambda s: (uncached(s), s.overview(experiment))),
            ("export: walk one experiment", lambda s: walk(s, TrajectoryFilter(experiment=experiment))),
        ]
        print(f"\n{n:,} trajectories; medians of {args.repeat}, stores alternating (ABAB); ms")
        print(f"{'read':45} {'sqlite':>10} {'clickhouse':>11} {'ratio ch/sqlite':>16}")
        for label, query in queries:
            samples: dict[str, list[float]] = {name: [] for name in stores}
            for store in stores.values():
                query(store)  # warm: caches, the first FINAL merge
            for _ in range(args.repeat):
                for name, store in stores.items():
                    started = time.perf_counter()
                    query(store)
                    samples[name].append((time.perf_counter() - started) * 1000)
            a, b = statistics.median(samples["sqlite"]), statistics.median(samples["clickhouse"])
            print(f"{label:45} {a:10.1f} {b:11.1f} {b / a:16.2f}", flush=True)
            ratios.append(f"{label + ' (ms)':45} {b / a:6.2f}")
        for store in stores.values():
            store.close()
    print(machine_note())
    print("RATIOS clickhouse / sqlite")
    print("\n".join(ratios))


if __name__ == "__main__":
    main()
