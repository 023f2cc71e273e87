"""The ClickHouse store's cursor: batches, deletions and a table that missed changes (real spool, real chDB)."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from tests.support.clickhouse_http import ClickHouseHttp
from tracecar.collector.settings import CollectorSettings
from tracecar.collector.spool.store import Spool, SpoolRow
from tracecar.collector.trajectory_filter import TrajectoryFilter
from tracecar.collector.viewer.clickhouse_store import ClickHouseStore
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


@pytest.fixture(params=["chdb", "server"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str | None]:
    """Embedded chDB (no URL), and a ClickHouse server over HTTP (tests/support/clickhouse_http.py): the same store."""
    if request.param == "chdb":
        yield None
        return
    server = ClickHouseHttp(tmp_path / "clickhouse-server")
    try:
        yield server.url(database="unit_store")
    finally:
        server.stop()


def test_batches_deletions_and_a_missed_change_refill(tmp_path: Path, store_url: str | None) -> None:
    """Names with a quote, a backslash and a tab, and the deletions' array parameter, on both transports."""
    path = tmp_path / "spool.sqlite3"
    ids = spool_of(path, 120)
    settings = CollectorSettings(data_dir=tmp_path, backend="local", store="clickhouse", store_batch_rows=25, store_url=store_url)
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
    count = store._select(f"SELECT count() AS n FROM {store.table} FINAL WHERE deleted = 0")[0]["n"]
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


def _late_span(path: Path, trace_id: str, n: int) -> None:
    """One more tool call in a stored trajectory: its row changes (span_count + 1)."""
    spool = Spool(path, local_only=True, sync="normal")
    span = {"trace_id": trace_id, "span_id": f"{trace_id}late{n}", "parent_id": f"{trace_id}r", "name": "CalculatorTool.execute",
            "kind": "op", "worker": "bench", "project": "p", "entity": None, "attributes": {}, "exception": None,
            "start_time": 1_700_000_000.0, "end_time": 1_700_000_000.1, "inputs": {}, "output": {"result": 2}}
    spool.write([SpoolRow(span, orjson.dumps(span), None)])
    spool.close()


def test_a_wall_clock_stepping_back_never_lets_an_older_row_win(tmp_path: Path, monkeypatch: object) -> None:
    """Row versions come from the store, not the wall clock: after the clock steps back an hour (NTP, a VM
    restored), a changed trajectory's new row still replaces the old one, in this run and after a restart."""
    import time as _time

    path = tmp_path / "spool.sqlite3"
    ids = spool_of(path, 6)
    settings = CollectorSettings(data_dir=tmp_path, backend="local", store="clickhouse", store_batch_rows=100)
    store = ClickHouseStore(TrajectoryIndex(path, track_changes=True), settings)
    assert store.refresh(budget_s=60)
    spans = {r["trace_id"]: r["span_count"] for r in rows_of(store)}
    real = _time.time_ns
    monkeypatch.setattr(_time, "time_ns", lambda: real() - 3600 * 10**9)  # type: ignore[attr-defined]
    _late_span(path, ids[0], 1)
    assert store.refresh(budget_s=60)
    assert {r["trace_id"]: r["span_count"] for r in rows_of(store)}[ids[0]] == spans[ids[0]] + 1
    store.close()
    again = ClickHouseStore(TrajectoryIndex(path, track_changes=True), settings)  # restart-safe: versions go on from the table's
    _late_span(path, ids[0], 2)
    assert again.refresh(budget_s=60)
    assert {r["trace_id"]: r["span_count"] for r in rows_of(again)}[ids[0]] == spans[ids[0]] + 2
    again.close()


def test_caught_up_when_the_spools_last_rows_were_deleted(tmp_path: Path) -> None:
    """The spool's newest trajectory deleted before the index read it (a dropped trajectory): the index has
    read every row there is, so it is caught up — not forever ``behind_spans`` the deleted rows."""
    path = tmp_path / "spool.sqlite3"
    ids = spool_of(path, 4)
    spool = Spool(path, local_only=True, sync="normal")
    assert spool.evict(ids[-1:])[0] == 1
    spool.close()
    index = TrajectoryIndex(path)
    assert index.refresh(budget_s=60)
    state = index.status()
    assert state["caught_up"] and state["behind_spans"] == 0, state
    index.close()
    settings = CollectorSettings(data_dir=tmp_path, backend="local", store="clickhouse")
    store = ClickHouseStore(TrajectoryIndex(path, track_changes=True), settings)
    assert store.refresh(budget_s=60)
    assert store.status()["caught_up"] and len(rows_of(store)) == 3
    store.close()


def spool_of_roots(tmp_path: Path, seed: int, n: int, root_attributes: Callable[[int], dict[str, object]]) -> Path:
    """A local spool of ``n`` trajectories whose roots carry ``root_attributes(t)`` too; its path."""
    path = tmp_path / "spool.sqlite3"
    spool = Spool(path, local_only=True, sync="normal")
    rng = random.Random(seed)
    rows = []
    for t in range(n):
        spans = trajectory(rng, t, 16)
        root = next(s for s in spans if s["parent_id"] is None and s["kind"] == "trajectory")
        root["attributes"] = {**root["attributes"], **root_attributes(t)}
        rows += [SpoolRow(s, orjson.dumps(s), None) for s in spans]
    spool.write(rows)
    spool.close()
    return path


def test_a_table_from_before_inclusion_probability_gets_the_column_and_its_values(tmp_path: Path) -> None:
    """An older release's table (no inclusion_probability column) and index (version 8): opening them adds the
    column, and the index's rebuild refills the table, so the stamped chances are listed."""
    path = spool_of_roots(tmp_path, 5, 3, lambda t: {"kept_because": "fill", "inclusion_probability": 0.25})
    settings = CollectorSettings(data_dir=tmp_path, backend="local", store="clickhouse")
    store = ClickHouseStore(TrajectoryIndex(path, track_changes=True), settings)
    assert store.refresh(budget_s=60)
    assert [r["inclusion_probability"] for r in rows_of(store)] == [0.25] * 3
    store._run(f"ALTER TABLE {store.table} DROP COLUMN inclusion_probability")  # as an older release made it
    store.index._db().execute("UPDATE meta SET value = '8' WHERE key = 'version'")
    store.close()
    again = ClickHouseStore(TrajectoryIndex(path, track_changes=True), settings)
    assert again.refresh(budget_s=60)
    assert [r["inclusion_probability"] for r in rows_of(again)] == [0.25] * 3
    again.close()


def test_attr_and_truth_filters_answer_from_clickhouse_what_the_index_answers(tmp_path: Path, store_url: str | None) -> None:
    """A table filled by the previous release (no attributes or truth columns; index version 10): opening it adds
    the columns, and the index's rebuild fills the table again, so ``attr=`` and ``where=`` answer from ClickHouse
    what the index answers; keys no filter can spell (with a dot, a space) and leaves under arrays are left out; a
    trajectory whose spans retention evicted stays listed and still matches its attributes on both stores."""
    path = tmp_path / "spool.sqlite3"
    spool = Spool(path, local_only=True, sync="normal")
    rng = random.Random(7)
    rows, ids = [], []
    for t in range(6):
        spans = trajectory(rng, t, 16)
        root = next(s for s in spans if s["parent_id"] is None and s["kind"] == "trajectory")
        root["attributes"] = {**root["attributes"], "source": ("a", "b")[t % 2], "cfg": {"lr": 0.1 + 0.2, "n-k": t},
                              "x.y": 1, "sp ace": 2, "list": [{"deep": 1}], "none": None}
        note = {**root, "span_id": f"{root['span_id']}-note", "kind": "annotation", "name": "score",
                "attributes": {"reward_extra_info": {"acc": t % 2}}, "inputs": None, "output": None}
        rows += [SpoolRow(s, orjson.dumps(s), None) for s in [*spans, note]]
        ids.append(root["trace_id"])
    spool.write(rows)
    spool.close()
    settings = CollectorSettings(data_dir=tmp_path, backend="local", store="clickhouse", store_url=store_url)
    sqlite = TrajectoryIndex(path, tmp_path / "plain.sqlite3")
    assert sqlite.refresh(budget_s=60)
    store = ClickHouseStore(TrajectoryIndex(path, track_changes=True), settings)
    assert store.refresh(budget_s=60)
    flat = store._select(f"SELECT attributes FROM {store.table} FINAL WHERE deleted = 0 LIMIT 1")[0]["attributes"]
    assert flat["cfg.lr"] == "0.3" and flat["none"] == "null" and "x.y" not in flat and "sp ace" not in flat
    assert not any(k.startswith("list") for k in flat)
    store._run(f"ALTER TABLE {store.table} DROP INDEX attribute_values")
    for column in ("attributes", "reward_components", "fate", "refill", "drift_checked", "drift_turns", "tt_mismatch", "lp_max"):
        store._run(f"ALTER TABLE {store.table} DROP COLUMN {column}")  # as the previous release made it
    store.index._db().execute("UPDATE meta SET value = '10' WHERE key = 'version'")  # and its index
    store.close()
    again = ClickHouseStore(TrajectoryIndex(path, track_changes=True), settings)
    assert again.refresh(budget_s=60)

    def check() -> None:
        for flt in ({"attributes": (("source", "a"),)}, {"attributes": (("cfg.lr", "0.3"), ("cfg.n-k", "4"))},
                    {"attributes": (("none", "null"),)}, {"reward_where": "acc=1"},
                    {"reward_where": "acc<1", "attributes": (("source", "a"),)}):
            assert rows_of(again, **flt) == rows_of(sqlite, **flt) and rows_of(again, **flt), flt
        for flt in ({"attributes": (("x.y", "1"),)}, {"attributes": (("list", "x"),)}, {"attributes": (("cfg", "x"),)},
                    {"attributes": (("list.0.deep", "1"),)}, {"attributes": (("cfg.lr", "0.30000000000000004"),)}):
            assert rows_of(again, **flt) == rows_of(sqlite, **flt) == [], flt

    check()
    spool = Spool(path, local_only=True, sync="normal")
    spool.evict(ids[:2])  # retention: the spans go, the trajectories stay listed (no prune: keep_forwarded)
    spool.close()
    assert again.refresh(budget_s=60) and sqlite.refresh(budget_s=60)
    check()
    assert {r["trace_id"] for r in rows_of(again, attributes=(("source", "a"),))} >= {ids[0]}
    again.close()
    sqlite.close()


def test_a_table_with_plain_attribute_keys_gets_dictionary_keys_and_answers_the_same(tmp_path: Path,
                                                                                    store_url: str | None) -> None:
    """Tables of c09d988–10b3ca3 keyed the attributes with plain strings: opening one alters it (a mutation, no
    refill, not waited for), and ``attr=`` answers what it answered before."""
    path = spool_of_roots(tmp_path, 11, 4, lambda t: {"source": ("a", "b")[t % 2]})
    settings = CollectorSettings(data_dir=tmp_path, backend="local", store="clickhouse", store_url=store_url)
    store = ClickHouseStore(TrajectoryIndex(path, track_changes=True), settings)
    assert store.refresh(budget_s=60)
    before = rows_of(store, attributes=(("source", "a"),))
    assert len(before) == 2
    store._run(f"ALTER TABLE {store.table} MODIFY COLUMN attributes Map(String, String) CODEC(ZSTD(3))")
    store.close()
    again = ClickHouseStore(TrajectoryIndex(path, track_changes=True), settings)
    database, table = again.table.split(".")
    (column,) = again._select(f"SELECT type FROM system.columns WHERE database = '{database}' AND table = '{table}'"
                              " AND name = 'attributes'")
    assert column["type"] == "Map(LowCardinality(String), String)"
    assert again.refresh(budget_s=60) and rows_of(again, attributes=(("source", "a"),)) == before
    # a server that refuses the change (before ~25.11 a column a skip index reads cannot be altered): the store
    # starts anyway, with plain keys, and answers the same
    again._run(f"ALTER TABLE {again.table} MODIFY COLUMN attributes Map(String, String) CODEC(ZSTD(3))")
    again._run(f"ALTER TABLE {again.table} MODIFY SETTING alter_column_secondary_index_mode = 'compatibility'")
    again.close()
    refused = ClickHouseStore(TrajectoryIndex(path, track_changes=True), settings)
    (column,) = refused._select(f"SELECT type FROM system.columns WHERE database = '{database}' AND table = '{table}'"
                                " AND name = 'attributes'")
    assert column["type"] == "Map(String, String)"
    assert refused.refresh(budget_s=60) and rows_of(refused, attributes=(("source", "a"),)) == before
    refused.close()


def test_a_server_url_maps_to_clickhouse_connects_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """TLS by the scheme, the port or ?secure=true (clickhouse-connect itself reads only the port), the user and
    password decoded, no session (threads query at once), no retries (TRACECAR_STORE_TIMEOUT_S bounds a statement),
    the URL's options passed on; a failure is one line without the password, in either form."""
    import clickhouse_connect

    from tracecar.collector.read_store import StoreStartError
    from tracecar.collector.viewer.clickhouse_transport import Server

    seen: list[dict] = []

    def fake(**kwargs: object) -> object:
        seen.append(kwargs)
        raise ConnectionError("refused for u:p%40ss and u:p@ss")

    monkeypatch.setattr(clickhouse_connect, "get_client", fake)
    for url, tls, port in (("https://u:p%40ss@db.example/tracecar", True, 8443), ("clickhouse://u:p%40ss@db:8443/x", True, 8443),
                           ("clickhouse://u:p%40ss@db:8123/x?secure=true&compress=true", True, 8123),
                           ("http://u:p%40ss@db:9000", False, 9000)):
        with pytest.raises(StoreStartError) as caught:
            Server(url, 7.5)
        assert "p@ss" not in str(caught.value) and "p%40ss" not in str(caught.value), caught.value
        assert "refused" in str(caught.value) and f"db{'.example' if 'example' in url else ''}:{port}" in str(caught.value)
        got = seen[-1]
        assert (got["interface"], got["secure"], got["port"]) == ("https" if tls else "http", tls, port), (url, got)
        assert (got["username"], got["password"]) == ("u", "p@ss")
        assert got["autogenerate_session_id"] is False and got["query_retries"] == 0
        assert got["connect_timeout"] == got["send_receive_timeout"] == 7.5
        assert got["compress"] == ("true" if "compress=true" in url else False)
