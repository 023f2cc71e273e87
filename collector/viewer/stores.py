"""Opens the read store ``TRACECAR_STORE`` names (collector/read_store.py): the read APIs' one seam."""

from __future__ import annotations

from pathlib import Path

from ..read_store import ReadStore
from ..settings import CollectorSettings
from .index import TrajectoryIndex


def open_read_store(spool_path: Path, settings: CollectorSettings, *, prune_deleted: bool) -> ReadStore:
    """The store ``TRACECAR_STORE`` names, over the spool at ``spool_path``."""
    index = TrajectoryIndex(spool_path, prune_deleted=prune_deleted, track_changes=settings.store == "clickhouse")
    if settings.store == "clickhouse":
        from .clickhouse_store import ClickHouseStore  # imports chDB: only when asked for

        return ClickHouseStore(index, settings)
    return index
