"""The columns a mirror (the ClickHouse store) needs to answer ``attr=`` and the training-truth filters itself.

Read from the trajectory index when the mirror takes a batch of changed trajectories, so that each
value means exactly what the index's own filters read: the root's attributes as the index keeps them
for ``attr=`` (viewer/root_attributes.py: ``{"cfg.lr": "0.3"}``), and the truth table's filter
columns (``drift_checked``, ``drift_turns``, ``fate``, ``refill``, ``tt_mismatch``, ``lp_max``) and the
numeric reward components, which truth_filter.where_clauses reads.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from . import root_attributes

TRUTH = ("drift_checked", "drift_turns", "fate", "refill", "tt_mismatch", "lp_max")
_NO_TRUTH = {"drift_checked": None, "drift_turns": None, "fate": None, "refill": 0, "tt_mismatch": None, "lp_max": None}
_CHUNK = 500


def attributes(conn: sqlite3.Connection, trace_ids: list[str]) -> dict[str, dict[str, str]]:
    """Each trajectory's root attributes, ``{dotted key: text}``."""
    return root_attributes.of(conn, trace_ids)


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
