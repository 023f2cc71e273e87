"""The ClickHouse store's cursor: batches, deletions and a table that missed changes (real spool, real chDB)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import orjson

from tracecar.collector.settings import CollectorSettings
from tracecar.collector.spool.store import Spool, SpoolRow
from tracecar.collector.trajectory_filter import TrajectoryFilter
from tracecar.collector.viewer.clickhouse_store import TABLE, ClickHouseStore
from tracecar.collector.viewer.index import TrajectoryIndex

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from viewer_store import trajectory  # noqa: E402  - the bench's demo-shaped trajectories (texts, rewards, trainer notes)

ODD = "it's a \\ back\tslash"  # a name with a quote, a backslash and a tab: matched as itself by both stores


def spool_of(path: Path, trajectories: int) -> list[str]:
    spool = Spool(path, local_only=True, sync="normal")
    rng = random.Random(3)
    rows, ids = [], []
    for t in range(trajectories):
        spans = trajectory(rng, t, 16)
        if t % 10 == 0:
            for span in spans:
                span["attributes"] = {**span["attributes"], "experiment_name": ODD}
        ids.append(spans[0]["trace_id"])
        rows += [SpoolRow(s, orjson.dumps(s), None) for s in spans]
    spool.write(rows)
    spool.close()
    return ids


def rows_of(store: object, **flt: object) -> list[dict]:
    page = store.list(TrajectoryFilter(**flt), sort="reward", limit=1000)  # type: ignore[attr-defined]
    return page["trajectories"]


def test_batches_deletions_and_a_missed_change_refill(tmp_path: Path) -> None:
    path = tmp_path / "spool.sqlite3"
    ids = spool_of(path, 120)
    settings = CollectorSettings(data_dir=tmp_path, backend="local", store="clickhouse", store_batch_rows=25)
    sqlite = TrajectoryIndex(path, tmp_path / "plain.sqlite3")
    index = TrajectoryIndex(path, prune_deleted=True, track_changes=True)
    store = ClickHouseStore(index, settings)
    inserts = []
    original = store._insert
    store._insert = lambda rows: (inserts.append(len(rows)), original(rows))[1]  # type: ignore[method-assign]
    assert store.refresh(budget_s=60)
    assert sqlite.refresh(budget_s=60)
    assert len(inserts) >= 120 // 25 and max(inserts) <= 25  # batched, TRACECAR_STORE_BATCH_ROWS at a time
    assert rows_of(store) == rows_of(sqlite) and len(rows_of(store)) == 120
    assert rows_of(store, q="answer is") == rows_of(sqlite, q="answer is")
    assert rows_of(store, experiment=ODD) == rows_of(sqlite, experiment=ODD) and len(rows_of(store, experiment=ODD)) == 12

    # trajectories the spool deleted (forwarded, keep_forwarded=false) leave ClickHouse too
    spool = Spool(path, local_only=True, sync="normal")
    spool.evict(ids[:10])
    spool.close()
    index._pruned_at = 0.0  # prune now, not in 10 s
    sqlite.prune_deleted, sqlite._pruned_at = True, 0.0
    assert store.refresh(budget_s=60) and sqlite.refresh(budget_s=60)
    assert len(rows_of(store)) == 110 and rows_of(store) == rows_of(sqlite)
    count = store._select(f"SELECT count() AS n FROM {TABLE} FINAL WHERE deleted = 0")[0]["n"]
    assert count == 110
    store.close()

    # a run on SQLite in between (its changes not tracked) drops the mirror's token: the table is filled again
    plain = TrajectoryIndex(path)
    assert plain.refresh(budget_s=60)
    assert plain.mirror_token() is None
    plain.close()
    again = ClickHouseStore(TrajectoryIndex(path, prune_deleted=True, track_changes=True), settings)
    assert again.refresh(budget_s=60)
    assert rows_of(again) == rows_of(sqlite)
    assert again.status()["store_pending"] == 0
    again.close()
    sqlite.close()
