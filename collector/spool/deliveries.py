"""Delivery cursors: what each destination still owes, when several exporters share one spool.

With one exporter the spool needs no cursor: a span's ``state`` says it all (pending → done or
dead), and that fast path and file format stay as they were. With two or more, a
``deliveries(exporter, seq)`` row says "this exporter has not yet taken this span". Ingest (or a
tail-based decision releasing held spans) writes one row per exporter; an exporter's answer
deletes its row (a permanent rejection also writes a dead letter keyed by span and exporter).
The span stays pending — not evictable, counted in the spool bound — until no row is left;
then it is done (or dead, when every destination rejected it).

Each exporter reads its own rows through the ``(exporter, seq)`` primary key, so a healthy
exporter's batch costs the same whatever another one owes. ``spool_meta`` remembers the
exporter set, so a restart with a changed set is reconciled: an added exporter owes every
pending span, a removed one owes nothing any more.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

import orjson

DELIVERIES_SCHEMA = """
CREATE TABLE IF NOT EXISTS deliveries (
    exporter TEXT NOT NULL,
    seq INTEGER NOT NULL,
    PRIMARY KEY (exporter, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS deliveries_seq ON deliveries(seq);
CREATE TABLE IF NOT EXISTS spool_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

PENDING, DONE, DEAD = 0, 1, 2


def _marks(n: int) -> str:
    return ",".join("?" * n)


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() is not None


def migrate_dead_letters(conn: sqlite3.Connection, legacy_exporter: str) -> None:
    """Spools from before fan-out key dead letters by span alone: rekey them by (span, exporter)."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(dead_letters)")}
    if "exporter" in columns:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("CREATE TABLE dead_letters_v2 (span_id TEXT NOT NULL, exporter TEXT NOT NULL, trace_id TEXT,"
                     " name TEXT, reason TEXT NOT NULL, failed_at REAL NOT NULL, PRIMARY KEY (span_id, exporter))")
        conn.execute("INSERT INTO dead_letters_v2 SELECT span_id, ?, trace_id, name, reason, failed_at FROM dead_letters",
                     (legacy_exporter,))
        conn.execute("DROP TABLE dead_letters")
        conn.execute("ALTER TABLE dead_letters_v2 RENAME TO dead_letters")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def reconcile(conn: sqlite3.Connection, exporters: Sequence[str]) -> None:
    """Brings the cursors in line with this run's exporters (one transaction, at open)."""
    multi = len(exporters) >= 2
    if not multi and not _has_table(conn, "deliveries"):
        return  # single-exporter spool, as ever
    conn.executescript(DELIVERIES_SCHEMA)
    conn.execute("BEGIN IMMEDIATE")
    try:
        row = conn.execute("SELECT value FROM spool_meta WHERE key = 'exporters'").fetchone()
        previous: list[str] = orjson.loads(row[0]) if row else []
        if multi:
            if len(previous) < 2:  # from single mode (or an old spool): every pending span is owed to all
                conn.execute("DELETE FROM deliveries")
                added, removed = list(exporters), []
            else:
                added = [e for e in exporters if e not in previous]
                removed = [e for e in previous if e not in exporters]
            for name in removed:
                conn.execute("DELETE FROM deliveries WHERE exporter = ?", (name,))
            for name in added:
                conn.execute("INSERT OR IGNORE INTO deliveries (exporter, seq) SELECT ?, seq FROM spans WHERE state = 0", (name,))
            # spans only a removed exporter still owed: nobody owes them now
            conn.execute("UPDATE spans SET state = ? WHERE state = 0 AND NOT EXISTS"
                         " (SELECT 1 FROM deliveries d WHERE d.seq = spans.seq)", (DONE,))
            conn.execute("INSERT OR REPLACE INTO spool_meta (key, value) VALUES ('exporters', ?)",
                         (orjson.dumps(list(exporters)).decode(),))
        else:  # back to one exporter (or none): what it already took is done, the fast path resumes
            if len(exporters) == 1 and exporters[0] in previous:
                conn.execute("UPDATE spans SET state = ? WHERE state = 0 AND NOT EXISTS"
                             " (SELECT 1 FROM deliveries d WHERE d.seq = spans.seq AND d.exporter = ?)", (DONE, exporters[0]))
            conn.execute("DELETE FROM deliveries")
            conn.execute("DELETE FROM spool_meta WHERE key = 'exporters'")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def owe_new(conn: sqlite3.Connection, exporters: Sequence[str], after_seq: int) -> int:
    """Every exporter owes the pending spans just inserted (seq > ``after_seq``); rows per exporter."""
    n = 0
    for name in exporters:
        n = conn.execute("INSERT INTO deliveries (exporter, seq) SELECT ?, seq FROM spans WHERE seq > ? AND state = 0",
                         (name, after_seq)).rowcount
    return n


def owe_held(conn: sqlite3.Connection, exporters: Sequence[str], trace_ids: Sequence[str]) -> int:
    """Every exporter owes the held spans of these kept trajectories (before they turn pending)."""
    n = 0
    for i in range(0, len(trace_ids), 500):
        chunk = list(trace_ids[i:i + 500])
        for name in exporters:
            added = conn.execute(f"INSERT OR IGNORE INTO deliveries (exporter, seq) SELECT ?, seq FROM spans"
                                 f" WHERE state = 3 AND trace_id IN ({_marks(len(chunk))})", (name, *chunk)).rowcount
        n += added
    return n


def owe_seqs(conn: sqlite3.Connection, exporters: Sequence[str], seqs: Sequence[int]) -> int:
    """Every exporter owes these spans (engine spans released from AWAITING); rows per exporter."""
    n = 0
    for i in range(0, len(seqs), 500):
        chunk = list(seqs[i:i + 500])
        for name in exporters:
            added = conn.execute(f"INSERT OR IGNORE INTO deliveries (exporter, seq) SELECT ?, seq FROM spans"
                                 f" WHERE seq IN ({_marks(len(chunk))})", (name, *chunk)).rowcount
        n += added
    return n


def next_owed(conn: sqlite3.Connection, exporter: str, limit: int) -> list[tuple[int, bytes, int | None, int | None]]:
    """This exporter's oldest owed spans, through its own primary-key range."""
    return conn.execute(
        "SELECT s.seq, s.payload, s.inputs_at, s.output_at FROM deliveries d JOIN spans s ON s.seq = d.seq"
        " WHERE d.exporter = ? ORDER BY d.seq LIMIT ?", (exporter, limit)).fetchall()


def settle(conn: sqlite3.Connection, exporters: Sequence[str], exporter: str, seqs: Sequence[int],
           dead_ids: set[str], keep: bool) -> tuple[int, int, int, int]:
    """Removes ``exporter``'s rows for ``seqs``; spans nobody owes any more become done (deleted
    when not ``keep``), or dead when every exporter dead-lettered them.

    Returns (rows removed, spans finished, their bytes, bytes deleted).
    """
    removed = 0
    finished: list[tuple[int, int, str]] = []
    for i in range(0, len(seqs), 500):
        chunk = list(seqs[i:i + 500])
        removed += conn.execute(f"DELETE FROM deliveries WHERE exporter = ? AND seq IN ({_marks(len(chunk))})",
                                (exporter, *chunk)).rowcount
        finished.extend(conn.execute(
            f"SELECT seq, nbytes, span_id FROM spans s WHERE state = 0 AND seq IN ({_marks(len(chunk))})"
            " AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.seq = s.seq)", chunk).fetchall())
    dead, done = [], []
    for seq, nbytes, span_id in finished:
        if span_id in dead_ids and conn.execute(
                f"SELECT COUNT(*) FROM dead_letters WHERE span_id = ? AND exporter IN ({_marks(len(exporters))})",
                (span_id, *exporters)).fetchone()[0] >= len(exporters):
            dead.append(seq)
        else:
            done.append((seq, nbytes))
    for i in range(0, len(dead), 500):
        chunk = dead[i:i + 500]
        conn.execute(f"UPDATE spans SET state = ? WHERE seq IN ({_marks(len(chunk))})", (DEAD, *chunk))
    done_seqs = [s for s, _ in done]
    for i in range(0, len(done_seqs), 500):
        chunk = done_seqs[i:i + 500]
        if keep:
            conn.execute(f"UPDATE spans SET state = ? WHERE seq IN ({_marks(len(chunk))})", (DONE, *chunk))
        else:
            conn.execute(f"DELETE FROM spans WHERE seq IN ({_marks(len(chunk))})", chunk)
    finished_bytes = sum(b for _, b, _ in finished)
    deleted_bytes = 0 if keep else sum(b for _, b in done)
    return removed, len(finished), finished_bytes, deleted_bytes


def owed_counts(conn: sqlite3.Connection, exporters: Sequence[str]) -> dict[str, int]:
    counts = dict(conn.execute("SELECT exporter, COUNT(*) FROM deliveries GROUP BY exporter").fetchall())
    return {name: counts.get(name, 0) for name in exporters}
