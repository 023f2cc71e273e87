"""Spool: the SQLite store between ingest and export.

``store`` writes and dedupes spans and moves them pending → done/dead (held under a tail budget);
``query`` reads trajectories back; ``retention`` keeps the store within its size and age bounds.
"""
