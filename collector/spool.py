"""Spool: the durable SQLite file behind every acknowledgement, and the embedded local store.

A span is answered 2xx only after its row is committed (WAL; with ``synchronous=NORMAL`` a
commit survives a killed process, ``TRACECAR_SPOOL_SYNC=full`` also survives power loss).
Rows move pending → done (forwarded, or kept locally) or → dead (a permanent backend
rejection, kept with its reason). ``span_id`` is unique, so a client's retry of a batch the
collector already took is dropped as a duplicate instead of being forwarded twice.
All writes go through one connection on one thread; reads use their own connection.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import orjson

PENDING, DONE, DEAD = 0, 1, 2

SCHEMA = """
CREATE TABLE IF NOT EXISTS spans (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    span_id TEXT NOT NULL UNIQUE,
    trace_id TEXT NOT NULL,
    parent_id TEXT,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    worker TEXT,
    project TEXT,
    entity TEXT,
    experiment TEXT,
    step INTEGER,
    sample_index INTEGER,
    rollout_n INTEGER,
    validate INTEGER,
    start_time REAL,
    end_time REAL,
    has_error INTEGER NOT NULL DEFAULT 0,
    reward REAL,
    nbytes INTEGER NOT NULL,
    state INTEGER NOT NULL,
    received_at REAL NOT NULL,
    warnings TEXT,
    payload BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS spans_pending ON spans(seq) WHERE state = 0;
CREATE INDEX IF NOT EXISTS spans_trace ON spans(trace_id);
CREATE INDEX IF NOT EXISTS spans_roots ON spans(experiment, step, sample_index, rollout_n) WHERE parent_id IS NULL AND kind != 'annotation';
CREATE TABLE IF NOT EXISTS dead_letters (
    span_id TEXT PRIMARY KEY,
    trace_id TEXT,
    name TEXT,
    reason TEXT NOT NULL,
    failed_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS sample_decisions (
    budget_key TEXT NOT NULL,
    sample_index INTEGER NOT NULL,
    keep INTEGER NOT NULL,
    PRIMARY KEY (budget_key, sample_index)
);
"""


class SpoolFull(Exception):
    """The disk (or the configured bound) is full: answer 503 with Retry-After, store nothing."""


@dataclass
class SpoolRow:
    """One span ready to insert: its index columns, its payload, its size."""

    span: dict[str, Any]
    payload: bytes
    warnings: list[str] | None


@dataclass
class WriteResult:
    inserted: int
    duplicates: int
    duplicate_ids: list[str]


def _connect(path: Path, sync: str) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
    conn.execute("PRAGMA busy_timeout=30000")
    return conn


def _attr(span: dict[str, Any], key: str) -> Any:
    value = span["attributes"].get(key)
    return value if type(value) in (int, str) else None


def _row_params(row: SpoolRow, state: int, now: float) -> tuple[Any, ...]:
    s = row.span
    attrs = s["attributes"]
    reward = attrs.get("reward")
    validate = attrs.get("validate")
    return (
        s["span_id"], s["trace_id"], s["parent_id"], s["name"], s["kind"], s["worker"],
        s.get("project"), s.get("entity"), _attr(s, "experiment_name"), _attr(s, "step"),
        _attr(s, "sample_index"), _attr(s, "rollout_n"), None if validate is None else int(bool(validate)),
        s["start_time"], s["end_time"], int(s["exception"] is not None),
        reward if type(reward) in (int, float) else None,
        len(row.payload), state, now,
        orjson.dumps(row.warnings).decode() if row.warnings else None, row.payload,
    )


class Spool:
    """Thread-safe spool. Writes are serialised by a lock (callers run them in one executor)."""

    def __init__(self, path: Path, *, local_only: bool, sync: str = "normal") -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.local_only = local_only
        self._write = _connect(path, sync)
        self._write.executescript(SCHEMA)
        self._read = _connect(path, sync)
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self.pending_count, self.pending_bytes, self.stored_bytes = self._write.execute(
            "SELECT COALESCE(SUM(state = 0), 0), COALESCE(SUM(CASE WHEN state = 0 THEN nbytes END), 0),"
            " COALESCE(SUM(nbytes), 0) FROM spans"
        ).fetchone()

    # ---- ingest --------------------------------------------------------------------------
    def write(self, rows: Sequence[SpoolRow], decisions: Iterable[tuple[str, int, bool]] = ()) -> WriteResult:
        """Commits new spans and sampling decisions in one transaction; known span ids are skipped."""
        state = DONE if self.local_only else PENDING
        now = time.time()
        with self._write_lock:
            conn = self._write
            try:
                conn.execute("BEGIN IMMEDIATE")
                known = self._existing_ids(conn, [r.span["span_id"] for r in rows])
                fresh = [r for r in rows if r.span["span_id"] not in known]
                conn.executemany(
                    "INSERT INTO spans (span_id, trace_id, parent_id, name, kind, worker, project, entity,"
                    " experiment, step, sample_index, rollout_n, validate, start_time, end_time, has_error, reward,"
                    " nbytes, state, received_at, warnings, payload) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    [_row_params(r, state, now) for r in fresh],
                )
                conn.executemany(
                    "INSERT OR IGNORE INTO sample_decisions (budget_key, sample_index, keep) VALUES (?,?,?)",
                    [(k, i, int(keep)) for k, i, keep in decisions],
                )
                conn.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                _rollback(conn)
                if "full" in str(exc).lower() or "disk" in str(exc).lower():
                    raise SpoolFull(str(exc)) from None
                raise
            except BaseException:
                _rollback(conn)
                raise
            new_bytes = sum(len(r.payload) for r in fresh)
            self.stored_bytes += new_bytes
            if state == PENDING:
                self.pending_count += len(fresh)
                self.pending_bytes += new_bytes
        duplicate_ids = [r.span["span_id"] for r in rows if r.span["span_id"] in known]
        return WriteResult(inserted=len(fresh), duplicates=len(duplicate_ids), duplicate_ids=duplicate_ids)

    @staticmethod
    def _existing_ids(conn: sqlite3.Connection, ids: list[str]) -> set[str]:
        found: set[str] = set()
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            found.update(
                sid for (sid,) in conn.execute(
                    f"SELECT span_id FROM spans WHERE span_id IN ({','.join('?' * len(chunk))})", chunk
                )
            )
        return found

    def load_decisions(self, budget_key: str) -> dict[int, bool]:
        with self._read_lock:
            return {
                i: bool(k) for i, k in self._read.execute(
                    "SELECT sample_index, keep FROM sample_decisions WHERE budget_key = ?", (budget_key,)
                )
            }

    # ---- forwarding ----------------------------------------------------------------------
    def next_pending(self, limit: int) -> list[tuple[int, bytes]]:
        """Oldest pending spans first, so each trace is delivered in arrival order."""
        with self._read_lock:
            return self._read.execute(
                "SELECT seq, payload FROM spans WHERE state = 0 ORDER BY seq LIMIT ?", (limit,)
            ).fetchall()

    def mark_forwarded(self, seqs: Sequence[int], keep: bool) -> None:
        self._finish(seqs, keep=keep)

    def mark_dead(self, dead: Sequence[tuple[int, str, str, str, str]]) -> None:
        """Moves permanently rejected spans to the dead-letter table with the backend's reason."""
        if not dead:
            return
        now = time.time()
        with self._write_lock:
            conn = self._write
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany(
                    "INSERT OR REPLACE INTO dead_letters (span_id, trace_id, name, reason, failed_at) VALUES (?,?,?,?,?)",
                    [(sid, tid, name, reason, now) for _, sid, tid, name, reason in dead],
                )
                self._set_state(conn, [d[0] for d in dead], DEAD)
                conn.execute("COMMIT")
            except BaseException:
                _rollback(conn)
                raise

    def _finish(self, seqs: Sequence[int], keep: bool) -> None:
        if not seqs:
            return
        with self._write_lock:
            conn = self._write
            conn.execute("BEGIN IMMEDIATE")
            try:
                if keep:
                    self._set_state(conn, seqs, DONE)
                else:
                    self._account(conn, seqs, deleting=True)
                    for i in range(0, len(seqs), 500):
                        chunk = seqs[i:i + 500]
                        conn.execute(f"DELETE FROM spans WHERE seq IN ({','.join('?' * len(chunk))})", chunk)
                conn.execute("COMMIT")
            except BaseException:
                _rollback(conn)
                raise

    def _set_state(self, conn: sqlite3.Connection, seqs: Sequence[int], state: int) -> None:
        self._account(conn, seqs)
        for i in range(0, len(seqs), 500):
            chunk = seqs[i:i + 500]
            conn.execute(f"UPDATE spans SET state = ? WHERE state = 0 AND seq IN ({','.join('?' * len(chunk))})", (state, *chunk))

    def _account(self, conn: sqlite3.Connection, seqs: Sequence[int], deleting: bool = False) -> None:
        for i in range(0, len(seqs), 500):
            chunk = seqs[i:i + 500]
            n, nbytes = conn.execute(
                f"SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM spans WHERE state = 0 AND seq IN ({','.join('?' * len(chunk))})",
                chunk,
            ).fetchone()
            self.pending_count -= n
            self.pending_bytes -= nbytes
            if deleting:
                self.stored_bytes -= nbytes

    # ---- reading -------------------------------------------------------------------------
    def query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._read_lock:
            cur = self._read.execute(sql, params)
            cols = [c[0] for c in cur.description or ()]
            return [dict(zip(cols, row)) for row in cur.fetchall()]  # type: ignore[misc]

    def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        return self.query("SELECT span_id, trace_id, name, reason, failed_at FROM dead_letters ORDER BY failed_at DESC LIMIT ?", (limit,))

    def dead_count(self) -> int:
        return self.query("SELECT COUNT(*) AS n FROM dead_letters")[0]["n"]

    def size_bytes(self) -> int:
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += os.path.getsize(str(self.path) + suffix)
            except OSError:
                pass
        return total

    def close(self) -> None:
        with self._write_lock:
            try:
                self._write.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass
            self._write.close()
        with self._read_lock:
            self._read.close()


def _rollback(conn: sqlite3.Connection) -> None:
    try:
        conn.execute("ROLLBACK")
    except sqlite3.Error:
        pass
