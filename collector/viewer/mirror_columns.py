"""The columns a mirror (the ClickHouse store) needs to answer ``attr=`` and the training-truth filters itself.

Read from the trajectory index's connection (the spool attached as ``spool``) when the mirror takes
a batch of changed trajectories, so that each value means exactly what the index's own filters
read (trajectory_filter.ATTRIBUTE_CLAUSE, truth_filter.where_clauses):

* ``attributes``: the root span's attributes flattened to ``{"a.b": text}``, one entry per scalar
  leaf reachable by object keys alone (what ``attr=a.b=text`` can name), the text as the index's
  clause spells it (SQLite's own ``CAST(... AS TEXT)`` of the JSON value; ``true``/``false``/``null``),
  so a float compares with the same 15 digits on both stores. Leaves under an array, and keys a
  filter cannot spell (empty, or with characters other than letters, digits, ``_`` and ``-``),
  are left out: no ``attr=`` can match them on either store.
* the truth table's filter columns (``drift_checked``, ``drift_turns``, ``fate``, ``refill``,
  ``tt_mismatch``, ``lp_max``) and the numeric reward components.
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any

_KEY = re.compile(r"[A-Za-z0-9_\-]+")
_LEAVES = ("SELECT t.trace_id, j.id, j.parent, j.key, j.type, CASE j.type WHEN 'true' THEN 'true' WHEN 'false' THEN 'false'"
           " WHEN 'null' THEN 'null' WHEN 'object' THEN NULL WHEN 'array' THEN NULL ELSE CAST(j.atom AS TEXT) END"
           " FROM trajectories t JOIN spool.spans a ON a.seq = t.root_seq,"
           " json_tree(CAST(a.payload AS TEXT), '$.attributes') j WHERE t.trace_id IN ({marks})")
TRUTH = ("drift_checked", "drift_turns", "fate", "refill", "tt_mismatch", "lp_max")
_NO_TRUTH = {"drift_checked": None, "drift_turns": None, "fate": None, "refill": 0, "tt_mismatch": None, "lp_max": None}
_CHUNK = 500


def root_attributes(conn: sqlite3.Connection, trace_ids: list[str]) -> dict[str, dict[str, str]]:
    """Each trajectory's root attributes as ``{dotted key: text}`` (see the module docstring)."""
    out: dict[str, dict[str, str]] = {t: {} for t in trace_ids}
    for i in range(0, len(trace_ids), _CHUNK):
        chunk = trace_ids[i:i + _CHUNK]
        paths: dict[tuple[str, int], str | None] = {}  # (trace, json_tree id) -> dotted path; None: not nameable
        for trace_id, node, parent, key, kind, text in conn.execute(_LEAVES.format(marks=",".join("?" * len(chunk))), chunk):
            if parent is None:  # the attributes object itself
                paths[(trace_id, node)] = ""
                continue
            above = paths.get((trace_id, parent))
            path = None if above is None or not isinstance(key, str) or not _KEY.fullmatch(key) else (
                f"{above}.{key}" if above else key)
            paths[(trace_id, node)] = path if kind == "object" else None if kind == "array" else path
            if text is not None and path is not None:
                out[trace_id][path] = text
    return out


def truth_columns(conn: sqlite3.Connection, trace_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Each trajectory's truth filter columns and numeric reward components (absent: no truth row, none)."""
    out: dict[str, dict[str, Any]] = {t: {**_NO_TRUTH, "reward_components": {}} for t in trace_ids}
    for i in range(0, len(trace_ids), _CHUNK):
        chunk = trace_ids[i:i + _CHUNK]
        marks = ",".join("?" * len(chunk))
        for trace_id, *values in conn.execute(
                "SELECT trace_id, drift_checked, drift_turns, fate, refill_of IS NOT NULL, tt_mismatch, lp_max FROM truth"
                f" WHERE trace_id IN ({marks})", chunk):
            out[trace_id].update(zip(TRUTH, values))
        for trace_id, key, value in conn.execute(
                f"SELECT trace_id, key, value FROM reward_components WHERE trace_id IN ({marks}) AND value IS NOT NULL", chunk):
            out[trace_id]["reward_components"][key] = float(value)
    return out
