"""Where retention moves evicted trajectories instead of deleting them, and where readers find them again.

With ``TRACECAR_STORE=clickhouse`` the SQLite spool is the queue and the recent past; ClickHouse
holds the job (a gateway's tens of millions of spans do not fit one SQLite file). So when
retention evicts a forwarded trajectory (``TRACECAR_STORE_MAX_BYTES``, ``_MAX_AGE_S``, a full
disk), its spans are first written to the archive (the ClickHouse store's ``spans`` table,
viewer/clickhouse_spans.py), exactly as the spool stored them (payload with its prompt references,
packed token arrays), and deleted from the spool only once the archive took them: a failed
archive write evicts nothing (counted, logged), so no detail is ever lost to a bound.

Readers of one trajectory (its tree, tokens, truth, group diffs, export) take the spool's rows
and, when the trajectory may have been archived, the archive's: every span once (the spool's row
wins), in the spool's order (start time, then arrival). "May have been archived" is cheap and
exact: the spool has no root span of the trace (all of it, or its root, left), or the trace is
marked in ``archived_partial`` (some spans were archived while its root was still to come, or
stayed behind). A trajectory never evicted costs readers one indexed lookup, not an archive query.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

#: the spool's columns an archived span keeps (the readers' and the archive's shared row shape)
COLUMNS = ("seq", "span_id", "trace_id", "parent_id", "name", "kind", "start_time", "payload", "token_arrays")


class SpanArchive(Protocol):
    """The archive's two operations (viewer/clickhouse_spans.py implements them on ClickHouse)."""

    describe: str  # what a log line names: "the ClickHouse store (chDB)"

    def keep(self, rows: Sequence[dict[str, Any]]) -> None:
        """Stores these spool rows (``COLUMNS``), one insert; raises when it could not (nothing is then evicted).

        Idempotent: rows written again after a crash between the archive's write and the spool's delete
        are collapsed (same trace id and seq)."""
        ...

    def spans_of(self, trace_ids: Sequence[str]) -> list[dict[str, Any]]:
        """Every archived row of these trajectories (``COLUMNS`` and ``state``), each once."""
        ...

    def trim(self, max_bytes: int) -> int:
        """Drops the oldest archived spans while the archive is above ``max_bytes``; returns the bytes dropped."""
        ...

    def trace_ids_matching(self, fragment: str, suffix: bool, limit: int) -> list[str]:
        """Archived trajectory ids ending (``suffix``) or starting with ``fragment``, at most ``limit``."""
        ...


@dataclass
class Fetched:
    """The archived rows of a page of trajectories read at once, by trace id (each one that may have been archived,
    rows or none), and the spool's eviction count when they were read: stale once another eviction happened."""

    rows: dict[str, list[dict[str, Any]]]
    generation: int


def _order(row: dict[str, Any]) -> tuple[bool, float, int]:
    """The spool's ``ORDER BY start_time, seq`` (SQLite puts NULL first)."""
    start = row.get("start_time")
    return (start is not None, start if start is not None else 0.0, row["seq"])


def with_archived(rows: list[dict[str, Any]], archived: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The spool's rows of a trajectory and its archived rows not in the spool, in the spool's order."""
    if not archived:
        return rows
    present = {r["span_id"] for r in rows}
    merged = rows + [a for a in archived if a["span_id"] not in present]
    merged.sort(key=_order)
    return merged
