"""The root span's attributes as rows of the trajectory index: what ``attr=`` filters on, on both read stores.

One row per scalar leaf reachable by object keys alone, ``(traj, "cfg.lr", "0.3")`` (``traj``: the
trajectory's rowid), the text as SQLite's ``CAST(… AS TEXT)`` spells the JSON value (``true``,
``false`` and ``null`` spelt so; a float with 15 significant digits, so ``attr=cfg.lr=0.3`` matches
``0.30000000000000004``). Written when the index folds the root, in its transaction, so that a
filter is an indexed lookup instead of a scan of every root's payload, it still answers once
retention evicted the trajectory's spans (the trajectory stays listed), and the ClickHouse store
mirrors the same rows (viewer/mirror_columns.py). Leaves under an array, keys a filter cannot spell
(empty, or with characters other than letters, digits, ``_`` and ``-``) and attributes that are not
an object give no row: no ``attr=`` can name them. Taken from the root as the index parsed it (no
second parse); only a float's text is asked of SQLite.
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any

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
_INT64 = (-(2**63), 2**63)


def _text(conn: sqlite3.Connection, value: Any) -> str:
    """A scalar as SQLite's ``CAST(json_extract(...) AS TEXT)`` spells it (a float or an integer past int64 by
    SQLite itself: 15 significant digits)."""
    if value is True or value is False:
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return value
    if isinstance(value, int) and _INT64[0] <= value < _INT64[1]:
        return str(value)
    return str(conn.execute("SELECT CAST(? AS TEXT)", (float(value),)).fetchone()[0])


def leaves(conn: sqlite3.Connection, attributes: Any) -> list[tuple[str, str]]:
    """The (dotted key, text) rows of a root's parsed attributes (the index parsed the root already)."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[dict[Any, Any], str]] = [(attributes, "")] if isinstance(attributes, dict) else []
    while stack:
        mapping, prefix = stack.pop()
        for key, value in mapping.items():
            if not isinstance(key, str) or not _KEY.fullmatch(key):
                continue
            path = f"{prefix}.{key}" if prefix else key
            if isinstance(value, dict):
                stack.append((value, path))
            elif not isinstance(value, list):
                out.append((path, _text(conn, value)))
    return out


def note(conn: sqlite3.Connection, roots: list[tuple[str, Any]]) -> None:
    """Replaces the rows of each (trace_id, parsed attributes); runs in the index's transaction, after its upsert
    (one statement of each kind for the whole chunk)."""
    roots = list(dict(roots).items())  # two roots of one trace in a chunk: the last, as the index's row (root_seq)
    if not roots:
        return
    rowids: dict[str, int] = {}
    for i in range(0, len(roots), 500):
        chunk = [trace_id for trace_id, _ in roots[i:i + 500]]
        rowids.update(conn.execute(f"SELECT trace_id, rowid FROM trajectories WHERE trace_id IN ({','.join('?' * len(chunk))})",
                                   chunk).fetchall())
    conn.executemany("DELETE FROM root_attributes WHERE traj = ?", [(r,) for r in rowids.values()])
    conn.executemany("INSERT OR IGNORE INTO root_attributes (traj, key, value) VALUES (?, ?, ?)",
                     [(rowids[trace_id], key, value) for trace_id, attributes in roots if trace_id in rowids
                      for key, value in leaves(conn, attributes)])


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
