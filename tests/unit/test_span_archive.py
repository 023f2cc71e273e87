"""The span archive on a real spool and real chDB: what retention evicts moves to ClickHouse, whole and once.

Pins the edges the end-to-end test (tests/test_span_archive.py) cannot choose: a trajectory whose spans were
archived before its root arrived, an archive that refuses a write (nothing deleted, counted), a row written twice
(a crash between the archive's insert and the spool's delete), payloads that are not UTF-8, and retention never
evicting what the read store has not listed yet.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from tracecar.collector.metrics import Metrics
from tracecar.collector.settings import CollectorSettings
from tracecar.collector.spool.query import get_trajectory
from tracecar.collector.spool.retention import Retention
from tracecar.collector.spool.store import ArchiveFailed, Spool, SpoolRow
from tracecar.collector.spool.trace_ids import resolve
from tracecar.collector.viewer.clickhouse_spans import ClickHouseSpanArchive
from tracecar.collector.viewer.clickhouse_store import ClickHouseStore
from tracecar.collector.viewer.index import TrajectoryIndex

pytestmark = pytest.mark.timeout(120)


def span(trace: str, sid: str, parent: str | None, start: float, kind: str = "op", **extra: Any) -> dict[str, Any]:
    return {"span_id": sid, "trace_id": trace, "parent_id": parent, "name": "AsyncLLMServerManager.generate" if parent else "agent_loop",
            "kind": kind, "worker": "w0", "start_time": start, "end_time": start + 1, "attributes": {"step": 1, "sample_index": 0, "rollout_n": 0},
            "inputs": {"prompt_ids": [1, 2, 3]}, "output": {"response_ids": [4, 5]}, "exception": None, **extra}


def rows(*spans: dict[str, Any]) -> list[SpoolRow]:
    return [SpoolRow(s, orjson.dumps(s), None) for s in spans]


@pytest.fixture
def stores(tmp_path: Path) -> Any:
    spool = Spool(tmp_path / "spool.sqlite3", local_only=True, sync="normal")
    settings = CollectorSettings(data_dir=tmp_path, backend="local", store="clickhouse")
    store = ClickHouseStore(TrajectoryIndex(spool.path, tmp_path / "index.sqlite3", track_changes=True), settings)
    spool.archive = ClickHouseSpanArchive(store)
    yield spool, store
    store.close()
    spool.close()


def _ids(tree: dict[str, Any]) -> list[str]:
    out, stack = [], [tree["root"]]
    while stack:
        node = stack.pop()
        out.append(node["span_id"])
        stack += node["children"]
    return sorted(out + [a["span_id"] for a in tree["annotations"]])


def test_a_trajectory_archived_before_its_root_arrived_reads_whole_once_it_has(stores: Any) -> None:
    spool, _ = stores
    spool.write(rows(span("t1", "c1", "t1", 1.0), span("t1", "c2", "t1", 2.0)))
    assert spool.evict(["t1"]) == (1, 2)  # the children were done (stored) and old: moved, the root still to come
    assert spool.query("SELECT COUNT(*) AS n FROM spans")[0]["n"] == 0
    spool.write(rows(span("t1", "t1", None, 0.5)))  # the root, after its children left the spool
    assert spool.may_be_archived("t1")  # marked: the root is here, its children are not
    tree = get_trajectory(spool, "t1")
    assert tree is not None and _ids(tree) == ["c1", "c2", "t1"]
    assert [c["span_id"] for c in tree["root"]["children"]] == ["c1", "c2"]  # in start order, under their root
    assert all(not c.get("parent_missing") for c in tree["root"]["children"])
    # a trajectory never evicted costs no archive read: its root is in the spool and it is not marked
    spool.write(rows(span("t2", "t2", None, 0.0), span("t2", "d1", "t2", 1.0)))
    assert not spool.may_be_archived("t2")


def test_a_refused_archive_write_deletes_nothing_and_is_counted(stores: Any) -> None:
    spool, _ = stores
    spool.write(rows(span("t3", "t3", None, 0.0), span("t3", "e1", "t3", 1.0)))

    class Refusing:
        describe = "the ClickHouse store (chDB)"

        def keep(self, rows: Any) -> None:
            raise RuntimeError("Code: 243. DB::Exception: Cannot reserve 1.00 MiB, not enough space. (NOT_ENOUGH_SPACE)")

    real, spool.archive = spool.archive, Refusing()
    with pytest.raises(ArchiveFailed):
        spool.evict(["t3"])
    assert spool.query("SELECT COUNT(*) AS n FROM spans WHERE trace_id = 't3'")[0]["n"] == 2  # nothing lost
    metrics = Metrics()
    retention = Retention(spool, metrics, max_bytes=None, max_age_s=1e-3, evict_on_disk_full=False)
    time.sleep(0.01)
    retention.apply()  # the age rule picks t3; the archive refuses: counted, kept
    assert metrics.store_archive_failures._value.get() == 1
    assert spool.query("SELECT COUNT(*) AS n FROM spans WHERE trace_id = 't3'")[0]["n"] == 2
    spool.archive = real
    retention._age_checked = 0.0
    retention.apply()  # the archive is back: moved, counted
    assert spool.query("SELECT COUNT(*) AS n FROM spans WHERE trace_id = 't3'")[0]["n"] == 0
    assert metrics.store_archived_spans._value.get() == 2
    assert _ids(get_trajectory(spool, "t3") or {"root": {"span_id": "", "children": []}, "annotations": []}) == ["e1", "t3"]


def test_rows_written_twice_read_once_and_binary_payloads_and_token_arrays_survive(stores: Any) -> None:
    spool, _ = stores
    root = span("t4", "t4", None, 0.0)
    child = span("t4", "f1", "t4", 1.0, output={"response_ids": [4, 5], "text": "数字 🙂"})
    spool.write([*rows(root), SpoolRow(child, orjson.dumps(child), None, token_arrays=b"\x00\xff\x80packed")])
    found = spool.query("SELECT seq, span_id, trace_id, parent_id, name, kind, start_time, payload, token_arrays FROM spans")
    spool.archive.keep(found)  # as if a crash came between this write and the spool's delete: written again below
    assert spool.evict(["t4"]) == (1, 2)
    archived = spool.archive.spans_of(["t4"])
    assert [r["span_id"] for r in archived] == ["t4", "f1"]  # each seq once
    assert {r["span_id"]: (r["payload"], r["token_arrays"]) for r in archived} == {
        r["span_id"]: (r["payload"], r["token_arrays"]) for r in found}  # byte for byte
    spool.archive.keep([{**found[0], "payload": b"\xff\xfe not utf-8", "seq": 10**9}])  # kept whole all the same
    assert any(r["payload"] == b"\xff\xfe not utf-8" for r in spool.archive.spans_of(["t4"]))
    spool.write(rows(span("abcdef0123", "abcdef0123", None, 0.0)))
    assert spool.evict(["abcdef0123"]) == (1, 1)
    assert resolve(spool, "…ef0123").trace_id == "abcdef0123" and resolve(spool, "abcdef01").trace_id == "abcdef0123"


def test_retention_evicts_only_what_the_read_store_has_listed(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.sqlite3", local_only=True, sync="normal")
    index = TrajectoryIndex(spool.path, tmp_path / "index.sqlite3")
    try:
        spool.write(rows(span("t5", "t5", None, 0.0)))
        assert index.refresh(budget_s=30)
        spool.write(rows(span("t6", "t6", None, 0.0)))  # not folded yet
        spool.readers_through = lambda: int(index.status()["indexed_seq"])  # no catch-up: t6 stays unlisted
        assert [t for t, _, _ in spool.oldest_forwarded(10, listed_only=True)] == ["t5"]
        assert {t for t, _, _ in spool.oldest_forwarded(10)} == {"t5", "t6"}  # a full disk's rule takes any
    finally:
        index.close()
        spool.close()


def test_a_trajectory_that_changes_while_it_is_archived_stays_whole_in_the_spool(stores: Any) -> None:
    """A span of the trajectory arrives while the archive takes its rows (outside the spool's lock): the trajectory
    is not deleted at all (never half evicted: a later turn stored as a reference to an archived one would dangle
    for the forwarder); the next eviction takes it whole."""
    spool, _ = stores
    spool.write(rows(span("t7", "t7", None, 0.0), span("t7", "g1", "t7", 1.0)))
    real = spool.archive

    class Racing:
        describe = real.describe

        def keep(self, taken: Any) -> None:
            real.keep(taken)
            spool.write(rows(span("t7", "g2", "t7", 2.0)))  # committed between the archive's insert and the delete

    spool.archive = Racing()
    assert spool.evict(["t7"]) == (0, 0)
    assert sorted(r["span_id"] for r in spool.query("SELECT span_id FROM spans WHERE trace_id = 't7'")) == ["g1", "g2", "t7"]
    spool.archive = real
    assert spool.evict(["t7"]) == (1, 3)
    assert _ids(get_trajectory(spool, "t7") or {}) == ["g1", "g2", "t7"]


def test_archive_rows_read_for_a_page_before_an_eviction_are_read_again(stores: Any) -> None:
    """An export reads a page's archived rows at once; a trajectory evicted after that read (here: still running,
    its root to come) is read again, not left out."""
    spool, _ = stores
    spool.write(rows(span("t8", "h1", "t8", 1.0), span("t8", "h2", "t8", 2.0)))
    fetched = spool.archived_of(["t8"])
    assert fetched is not None and fetched.rows == {"t8": []}  # no root here: it may be archived; nothing is yet
    assert spool.evict(["t8"]) == (1, 2)
    tree = get_trajectory(spool, "t8", archived=fetched)
    assert tree is not None and _ids(tree) == ["h1", "h2", "t8"]  # the missing root shown as such, both spans there


def test_a_held_trajectory_released_is_not_evicted_before_the_index_folds_it(tmp_path: Path) -> None:
    """Held spans (awaiting a tail decision) pass the index's watermark unfolded; once released and done they must
    not reach the archive before the index lists them: the listed seq stops below the lowest span it still holds."""
    spool = Spool(tmp_path / "spool.sqlite3", local_only=True, sync="normal")
    index = TrajectoryIndex(spool.path, tmp_path / "index.sqlite3")
    try:
        spool.write([SpoolRow(s, orjson.dumps(s), None, held=True) for s in (span("h9", "h9", None, 0.0),
                                                                            span("h9", "k1", "h9", 1.0))])
        spool.write(rows(span("n1", "n1", None, 0.0)))  # a later, plain trajectory
        assert index.refresh(budget_s=30)
        spool.release(["h9"], [])  # kept: done now, not yet re-read by the index
        spool.readers_through = index.listed_through  # no catch-up: what the index has listed
        assert [t for t, _, _ in spool.oldest_forwarded(10, listed_only=True)] == []  # n1 waits behind h9 too
        assert index.refresh(budget_s=30, all_held=True)
        assert {t for t, _, _ in spool.oldest_forwarded(10, listed_only=True)} == {"h9", "n1"}
        assert index.summary("h9") is not None  # listed before it may leave
    finally:
        index.close()
        spool.close()


def test_the_archive_bound_drops_the_oldest_partitions_whole_and_counts_them(tmp_path: Path) -> None:
    """TRACECAR_STORE_ARCHIVE_MAX_BYTES: above it retention drops the oldest partitions of archived spans (an hour each;
    a second here), never the newest, each trajectory whole (archived in one insert); counted and logged."""
    spool = Spool(tmp_path / "spool.sqlite3", local_only=True, sync="normal")
    settings = CollectorSettings(data_dir=tmp_path, backend="local", store="clickhouse")
    store = ClickHouseStore(TrajectoryIndex(spool.path, tmp_path / "index.sqlite3", track_changes=True), settings)
    try:
        spool.archive = ClickHouseSpanArchive(store, partition_s=1)
        for n in range(3):
            trace = f"b{n}"
            spool.write(rows(span(trace, trace, None, 0.0), *(span(trace, f"{trace}-{i}", trace, 1.0 + i,
                                                                  blob="x" * 4000 + str(i)) for i in range(20))))
            assert spool.evict([trace]) == (1, 21)
            time.sleep(1.1)  # the next trajectory in the next partition
        metrics = Metrics()
        retention = Retention(spool, metrics, max_bytes=None, max_age_s=None, evict_on_disk_full=False,
                              archive_max_bytes=1)
        retention.apply()
        assert metrics.store_archive_dropped_bytes._value.get() > 0
        assert [len(spool.archive.spans_of([f"b{n}"])) for n in range(3)] == [0, 0, 21]  # the newest kept whole
        assert get_trajectory(spool, "b0") is None and _ids(get_trajectory(spool, "b2") or {})[0] == "b2"
    finally:
        store.close()
        spool.close()
