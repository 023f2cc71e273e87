"""The root span's attributes as rows of the trajectory index: what ``attr=`` filters on, on both read stores.

One row per scalar leaf reachable by object keys alone, ``(trace_id, "cfg.lr", "0.3")``, the text as
SQLite's ``CAST(… AS TEXT)`` spells the JSON value (``true``/``false``/``null`` spelt so; a float with 15
significant digits, so ``attr=cfg.lr=0.3`` matches ``0.30000000000000004``). Written when the index
folds the root, in its transaction, so that a filter is an indexed lookup instead of a scan of every
root's payload, it still answers once retention evicted the trajectory's spans (the trajectory stays
listed), and the ClickHouse store mirrors the same rows (viewer/mirror_columns.py). Leaves under an
array, keys a filter cannot spell (empty, or with characters other than letters, digits, ``_`` and
``-``) and attributes that are not an object give no row: no ``attr=`` can name them; of a key given
twice, the first value counts (as ``json_extract`` reads it).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterable

SCHEMA = """
CREATE TABLE IF NOT EXISTS root_attributes (
    traj INTEGER NOT NULL,  -- the trajectory's rowid in trajectories (a trace id twice a row would double the table)
    key TEXT NOT NULL,  -- dotted: "cfg.lr"
    value TEXT NOT NULL,
    PRIMARY KEY (traj, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS root_attributes_kv ON root_attributes(key, value);
"""
DROP = "DROP TABLE IF EXISTS root_attributes;"  # the filter over it: trajectory_filter.ATTRIBUTE_CLAUSE

_KEY = re.compile(r"[A-Za-z0-9_\-]+")
# a payload that is not JSON (none reaches the spool: validated and serialised at ingest) gives no rows, not an error
_LEAVES = ("SELECT id, parent, key, type, CASE type WHEN 'true' THEN 'true' WHEN 'false' THEN 'false' WHEN 'null'"
           " THEN 'null' WHEN 'object' THEN NULL WHEN 'array' THEN NULL ELSE CAST(atom AS TEXT) END"
           " FROM json_tree(IIF(json_valid(?1), ?1, '{}'), '$.attributes')")


def leaves(conn: sqlite3.Connection, payload: bytes | str) -> list[tuple[str, str]]:
    """The (dotted key, text) rows of one root payload's attributes."""
    text = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else payload
    paths: dict[int, str | None] = {}  # json_tree id -> dotted path of an object; None: not nameable
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for node, parent, key, kind, value in conn.execute(_LEAVES, (text,)):
        if parent is None:  # the attributes value itself
            paths[node] = "" if kind == "object" else None
            continue
        above = paths.get(parent)
        path = None if above is None or not isinstance(key, str) or not _KEY.fullmatch(key) else (
            f"{above}.{key}" if above else key)
        if kind == "object":
            paths[node] = path
        elif value is not None and path is not None and path not in seen:
            seen.add(path)
            out.append((path, value))
    return out


def note(conn: sqlite3.Connection, roots: Iterable[tuple[str, bytes]]) -> None:
    """Replaces the rows of each (trace_id, root payload); runs in the index's transaction, after its upsert."""
    for trace_id, payload in roots:
        row = conn.execute("SELECT rowid FROM trajectories WHERE trace_id = ?", (trace_id,)).fetchone()
        if row is None:
            continue
        conn.execute("DELETE FROM root_attributes WHERE traj = ?", (row[0],))
        conn.executemany("INSERT OR IGNORE INTO root_attributes (traj, key, value) VALUES (?, ?, ?)",
                         [(row[0], key, value) for key, value in leaves(conn, payload)])


def forget(conn: sqlite3.Connection, trace_ids: list[str]) -> None:
    """Drops the rows of trajectories about to leave the index (before their ``trajectories`` rows go)."""
    conn.execute(f"DELETE FROM root_attributes WHERE traj IN (SELECT rowid FROM trajectories WHERE trace_id IN"
                 f" ({','.join('?' * len(trace_ids))}))", trace_ids)


def of(conn: sqlite3.Connection, trace_ids: list[str]) -> dict[str, dict[str, str]]:
    """Each trajectory's rows as ``{dotted key: text}`` (empty: none)."""
    out: dict[str, dict[str, str]] = {t: {} for t in trace_ids}
    for i in range(0, len(trace_ids), 500):
        chunk = trace_ids[i:i + 500]
        for trace_id, key, value in conn.execute(
                "SELECT t.trace_id, a.key, a.value FROM trajectories t JOIN root_attributes a ON a.traj = t.rowid"
                f" WHERE t.trace_id IN ({','.join('?' * len(chunk))})", chunk):
            out[trace_id][key] = value
    return out
