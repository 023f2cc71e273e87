"""The span archive on ClickHouse: where retention moves evicted trajectories with ``TRACECAR_STORE=clickhouse``.

The spool (SQLite) keeps the recent past and the queue; this table keeps every span retention
evicted, as the spool stored it (spool/archive.py says when readers look here). One row per span
in a ``ReplacingMergeTree`` ordered by ``(trace_id, seq)``: a trajectory is one range of the
primary key (a reader's lookup reads a granule or two), and a row written again after a crash
between this insert and the spool's delete is read once (reads take each ``seq`` once; the engine
collapses the copies when it merges the part, within an hour's partition). The payload (JSON,
with its stored prompt references) and the packed token arrays are ZSTD-compressed columns; the
arrays are binary, so they travel as base64 text (JSON rows), as does a payload that is not UTF-8
(never written by the pipeline; kept whole all the same). Partitioned by the hour of eviction:
what ``TRACECAR_STORE_ARCHIVE_MAX_BYTES`` drops, oldest first.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import orjson

from ..spool.archive import COLUMNS
from ..spool.store import DONE  # an archived span was forwarded (done) when evicted: its readers' forward_state
from .clickhouse_store import ClickHouseStore, _Params

TABLE = "spans"  # in the store's database, beside ``trajectories``
SCHEMA = """
CREATE TABLE IF NOT EXISTS {table} (
    trace_id String,
    seq Int64,
    span_id String,
    parent_id Nullable(String),
    name String,
    kind LowCardinality(String),
    start_time Nullable(Float64),
    payload String CODEC(ZSTD(3)),
    token_arrays Nullable(String) CODEC(ZSTD(3)),
    archived_at DateTime DEFAULT now()
) ENGINE = ReplacingMergeTree
PARTITION BY toStartOfInterval(archived_at, INTERVAL {partition_s} SECOND)
ORDER BY (trace_id, seq)
SETTINGS index_granularity = 1024
"""
PARTITION_S = 3600  # an hour of evictions a partition: what TRACECAR_STORE_ARCHIVE_MAX_BYTES drops, oldest first
_BINARY = "b64:"  # a payload kept as base64 (a JSON payload starts with "{")


class ClickHouseSpanArchive:
    """:class:`~tracecar.collector.spool.archive.SpanArchive` on the ClickHouse store's engine (chDB or a server)."""

    def __init__(self, store: ClickHouseStore, partition_s: int = PARTITION_S) -> None:
        self.store = store
        self.table = f"{store.database}.{TABLE}"
        self.describe = f"the ClickHouse store ({store.engine_name})"
        store.run(SCHEMA.format(table=self.table, partition_s=int(partition_s)))

    def keep(self, rows: Sequence[dict[str, Any]]) -> None:
        self.store.insert_into(self.table, [_row_in(r) for r in rows])

    def spans_of(self, trace_ids: Sequence[str]) -> list[dict[str, Any]]:
        bind = _Params()
        found = self.store.select(f"SELECT {', '.join(COLUMNS)} FROM {self.table} WHERE trace_id IN {bind(list(trace_ids))}"
                                  " ORDER BY trace_id, seq LIMIT 1 BY trace_id, seq", bind)
        return [_row_out(r) for r in found]

    def trim(self, max_bytes: int) -> int:
        """Drops the oldest partitions (an hour of evictions each) while the table is above ``max_bytes`` on disk,
        never the newest; returns the bytes dropped. A trajectory archived in one insert leaves whole; one archived
        in pieces (spans moved before its root arrived) may lose its earlier pieces an hour before the rest."""
        bind = _Params()
        database, table = self.table.split(".", 1)
        parts = self.store.select(f"SELECT partition_id, sum(bytes_on_disk) AS b FROM system.parts WHERE database = {bind(database)}"
                                  f" AND table = {bind(table)} AND active GROUP BY partition_id ORDER BY min(min_time), partition_id",
                                  bind)
        total = sum(int(p["b"]) for p in parts)
        dropped = 0
        for part in parts[:-1]:
            if total - dropped <= max_bytes:
                break
            partition = str(part["partition_id"])
            if not partition.isdigit():  # an hour's start as a number: spelt into the SQL (servers before 23.10 bind none here)
                continue
            self.store.run(f"ALTER TABLE {self.table} DROP PARTITION ID '{partition}'")
            dropped += int(part["b"])
        return dropped

    def trace_ids_matching(self, fragment: str, suffix: bool, limit: int) -> list[str]:
        """Archived trajectory ids that end (``suffix``) or start with ``fragment``: ``tracecar show …000000e7``."""
        bind = _Params()
        test = f"endsWith(trace_id, {bind(fragment)})" if suffix else f"startsWith(trace_id, {bind(fragment)})"
        return [r["trace_id"] for r in self.store.select(
            f"SELECT DISTINCT trace_id FROM {self.table} WHERE {test} LIMIT {int(limit)}", bind)]


def _row_in(row: dict[str, Any]) -> bytes:
    payload: bytes = row["payload"]
    try:
        text = payload.decode()
    except UnicodeDecodeError:
        text = _BINARY + base64.b64encode(payload).decode()
    arrays = row["token_arrays"]
    return orjson.dumps({**{k: row[k] for k in COLUMNS[:7]}, "payload": text,
                         "token_arrays": base64.b64encode(arrays).decode() if arrays is not None else None})


def _row_out(row: dict[str, Any]) -> dict[str, Any]:
    text: str = row["payload"]
    row["payload"] = base64.b64decode(text[len(_BINARY):]) if text.startswith(_BINARY) else text.encode()
    if row["token_arrays"] is not None:
        row["token_arrays"] = base64.b64decode(row["token_arrays"])
    if row["start_time"] is not None:  # ClickHouse writes a whole Float64 without its ".0": the spool's float again
        row["start_time"] = float(row["start_time"])
    row["state"] = DONE
    return row
