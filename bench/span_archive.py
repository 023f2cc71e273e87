"""Evicted spans moved to ClickHouse: what moving costs against deleting, and what a read from there costs.

Builds one spool of demo-shaped trajectories (bench/viewer_store.py: ~7 spans each, token ids, decoded
texts, packed per-token arrays, rewards) and copies it three times: ``kept`` (never evicted), ``moved``
(the ClickHouse store's span archive on embedded chDB, collector/viewer/clickhouse_spans.py) and ``deleted``
(no archive, as with the SQLite store). Then, same run, alternating:

* eviction: chunk after chunk of the same trajectories evicted from ``moved`` (archive insert, then
  delete) and from ``deleted`` (delete only); prints spans/s of each and the ratio;
* reads: random trajectories read whole (``get_trajectory``: the tree API) and as tokens
  (``trajectory_tokens``) from ``kept`` (the spool) and from ``moved`` (the archive), alternating per
  trajectory, each answer asserted equal; prints the median ms of each and the ratio;
* an export's page: 100 random trajectories read whole, the archived ones in one query (as ``/v1/export``);
* size: the archive's bytes on disk against the same spans' bytes in SQLite.

    .venv/bin/python bench/span_archive.py [--spans 300000] [--reads 200] [--chunk 2000]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from viewer_store import build  # noqa: E402

from tracecar.collector.settings import CollectorSettings  # noqa: E402
from tracecar.collector.spool.query import get_trajectory  # noqa: E402
from tracecar.collector.spool.store import Spool  # noqa: E402
from tracecar.collector.viewer.clickhouse_spans import ClickHouseSpanArchive  # noqa: E402
from tracecar.collector.viewer.clickhouse_store import ClickHouseStore  # noqa: E402
from tracecar.collector.viewer.index import TrajectoryIndex  # noqa: E402
from tracecar.collector.viewer.tokens import trajectory_tokens  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=300_000)
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--chunk", type=int, default=2000, help="trajectories evicted per round (each mode)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tracecar-archive-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        spans, trajectories = build(root / "kept.sqlite3", args.spans)
        print(f"built {spans:,} spans, {trajectories:,} trajectories in {time.perf_counter() - started:.0f} s")
        for name in ("moved", "deleted"):
            shutil.copy(root / "kept.sqlite3", root / f"{name}.sqlite3")
        kept, moved, deleted = (Spool(root / f"{n}.sqlite3", local_only=True, sync="normal") for n in ("kept", "moved", "deleted"))
        settings = CollectorSettings(data_dir=root, backend="local", store="clickhouse")
        store = ClickHouseStore(TrajectoryIndex(moved.path, root / "index.sqlite3", track_changes=True), settings)
        moved.archive = ClickHouseSpanArchive(store)
        ids = [r["trace_id"] for r in kept.query("SELECT DISTINCT trace_id FROM spans ORDER BY trace_id")]
        sqlite_bytes = kept.query("SELECT SUM(nbytes) AS b FROM spans")[0]["b"]

        times = {"moved": 0.0, "deleted": 0.0}
        counts = {"moved": 0, "deleted": 0}
        ratios = []
        for i in range(0, len(ids), args.chunk):
            chunk = ids[i:i + args.chunk]
            round_s = {}
            for name, spool in (("moved", moved), ("deleted", deleted)) if (i // args.chunk) % 2 == 0 else (
                    ("deleted", deleted), ("moved", moved)):
                t0 = time.perf_counter()
                _, n = spool.evict(chunk)
                round_s[name] = time.perf_counter() - t0
                times[name] += round_s[name]
                counts[name] += n
            ratios.append(round_s["moved"] / round_s["deleted"])
        assert counts["moved"] == counts["deleted"] == spans, counts
        print(f"eviction: moved to ClickHouse {counts['moved'] / times['moved']:,.0f} spans/s, deleted "
              f"{counts['deleted'] / times['deleted']:,.0f} spans/s: {times['moved'] / times['deleted']:.2f}x the time "
              f"(rounds {min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds of {args.chunk} trajectories)")

        rng = random.Random(5)
        sample = rng.sample(ids, min(args.reads, len(ids)))
        for what, read in (("tree", lambda s, t: get_trajectory(s, t)), ("tokens", lambda s, t: trajectory_tokens(s, t))):
            ms: dict[str, list[float]] = {"kept": [], "moved": []}
            for n, trace in enumerate(sample):
                answers = {}
                for name, spool in (("kept", kept), ("moved", moved)) if n % 2 == 0 else (("moved", moved), ("kept", kept)):
                    t0 = time.perf_counter()
                    answers[name] = read(spool, trace)
                    ms[name].append((time.perf_counter() - t0) * 1000)
                assert answers["kept"] == answers["moved"] and answers["kept"] is not None, trace
            a, b = statistics.median(ms["moved"]), statistics.median(ms["kept"])
            print(f"read {what}: from the archive {a:.2f} ms, from the spool {b:.2f} ms (medians of {len(sample)}, "
                  f"alternating): {a / b:.1f}x; p90 {sorted(ms['moved'])[len(sample) * 9 // 10]:.2f} ms")

        pages: dict[str, list[float]] = {"kept": [], "moved": []}
        for n in range(10):  # an export's page: 100 trajectories, the archived ones read in one query
            page = rng.sample(ids, 100)
            for name, spool in (("kept", kept), ("moved", moved)) if n % 2 == 0 else (("moved", moved), ("kept", kept)):
                t0 = time.perf_counter()
                fetched = spool.archived_of(page)
                trees = [get_trajectory(spool, t, archived=fetched) for t in page]
                pages[name].append((time.perf_counter() - t0) * 1000)
                assert all(trees)
        a, b = statistics.median(pages["moved"]), statistics.median(pages["kept"])
        print(f"export page of 100 trajectories: from the archive {a:.0f} ms, from the spool {b:.0f} ms (medians of 10, "
              f"alternating): {a / b:.1f}x, {100_000 / a:,.0f} trajectories/s")

        on_disk = store.select(f"SELECT sum(bytes_on_disk) AS b FROM system.parts WHERE database = '{store.database}'"
                               " AND table = 'spans' AND active")[0]["b"]
        print(f"size: {on_disk / 2**20:.1f} MiB in ClickHouse for {sqlite_bytes / 2**20:.1f} MiB of the same spans in SQLite "
              f"({sqlite_bytes / max(on_disk, 1):.1f}x smaller)")
        store.close()
        for spool in (kept, moved, deleted):
            spool.close()


if __name__ == "__main__":
    main()
