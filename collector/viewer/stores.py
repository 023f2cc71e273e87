"""Opens the read store ``TRACECAR_STORE`` names (collector/read_store.py): the read APIs' one seam."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..read_store import ReadStore
from ..settings import CollectorSettings
from .index import TrajectoryIndex


def open_read_store(spool_path: Path, settings: CollectorSettings, *, prune_deleted: bool,
                    on_error: Callable[[], None] = lambda: None) -> ReadStore:
    """The store ``TRACECAR_STORE`` names, over the spool at ``spool_path``; ``on_error`` counts each statement
    the ClickHouse store's engine refused."""
    index = TrajectoryIndex(spool_path, prune_deleted=prune_deleted, track_changes=settings.store == "clickhouse")
    if settings.store == "clickhouse":
        from .clickhouse_store import ClickHouseStore  # imports chDB: only when asked for

        return ClickHouseStore(index, settings, on_error=on_error)
    return index
