"""Delivery cursors: what each destination still owes, when several exporters share one spool.

With one exporter the spool needs no cursor: a span's ``state`` says it all (pending → done or
dead), and that fast path and file format stay as they were. With two or more, a
``deliveries(exporter, seq)`` row says "this exporter has not yet taken this span". Ingest (or a
tail-based decision releasing held spans) writes one row per exporter; an exporter's answer
deletes its row (a permanent rejection also writes a dead letter keyed by span and exporter).
The span stays pending — not evictable, counted in the spool bound — until no row is left;
then it is done (or dead, when every destination rejected it).

Exporters that share the spans (a node's several gateways, :class:`Routing`) owe each span once
between them: its one owner, decided when it is owed and kept as that row, so no later read,
restart or eviction can send it to a second gateway, or to none.

Each exporter reads its own rows through the ``(exporter, seq)`` primary key, so a healthy
exporter's batch costs the same whatever another one owes. ``spool_meta`` remembers the
exporter set, so a restart with a changed set is reconciled: an added exporter owes every
pending span (an added gateway, its share of what the old gateways still owed), a removed one
owes nothing any more.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

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


class Routing(Protocol):
    """Exporters that share the spans between them, one owner a span (a node's several gateways:
    exporters/gateway_route.py). The owner is decided when the span is owed, and kept as its row."""

    routed: frozenset[str]

    def owners(self, conn: sqlite3.Connection, rows: Sequence[tuple[Any, ...]]) -> list[str]:
        """The owner's name for each of ``rows`` (the columns of :data:`OWED_COLUMNS`), in order."""
        ...


# what a routing decides an owner from: a stepless annotation's payload carries its trajectory's route
OWED_COLUMNS = ("seq, trace_id, kind, experiment, validate, step,"
                " CASE WHEN step IS NULL AND kind = 'annotation' THEN payload END")
# spool_meta: the gateway cursors' rows name one owner a span (spools of 6489206–6a1227e owed every span to each)
ONE_GATEWAY_A_SPAN = "gateway_rows_one_owner"


def owing_per_span(exporters: Sequence[str], routing: Routing | None) -> int:
    """How many exporters owe each span: all of them, the sharing ones counting as one."""
    shared = sum(1 for name in exporters if routing is not None and name in routing.routed)
    return len(exporters) - shared + (1 if shared else 0)


def reconcile(conn: sqlite3.Connection, exporters: Sequence[str], routing: Routing | None = None) -> None:
    """Brings the cursors in line with this run's exporters (one transaction, at open).

    A node's gateway cursors (``gateway``, ``gateway@HOST:PORT``: :func:`is_gateway_cursor`) owe each
    span once between them; when their set changed, what the old ones still owed is owed again, once,
    to its gateway in the new set (what an old one already took stays taken)."""
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
                added, removed, gateways_before = list(exporters), [], []
            else:
                added = [e for e in exporters if e not in previous]
                removed = [e for e in previous if e not in exporters]
                gateways_before = [p for p in previous if is_gateway_cursor(p)]
            for name in removed:
                if not is_gateway_cursor(name):
                    conn.execute("DELETE FROM deliveries WHERE exporter = ?", (name,))
            for name in added:
                if not is_gateway_cursor(name):
                    conn.execute("INSERT OR IGNORE INTO deliveries (exporter, seq) SELECT ?, seq FROM spans WHERE state = 0", (name,))
            one_owner = conn.execute("SELECT 1 FROM spool_meta WHERE key = ?", (ONE_GATEWAY_A_SPAN,)).fetchone() is not None
            _regate(conn, routing, gateways_before, [e for e in exporters if is_gateway_cursor(e)], one_owner)
            # spans only a removed exporter still owed: nobody owes them now
            conn.execute("UPDATE spans SET state = ? WHERE state = 0 AND NOT EXISTS"
                         " (SELECT 1 FROM deliveries d WHERE d.seq = spans.seq)", (DONE,))
            conn.execute("INSERT OR REPLACE INTO spool_meta (key, value) VALUES ('exporters', ?)",
                         (orjson.dumps(list(exporters)).decode(),))
            conn.execute("INSERT OR REPLACE INTO spool_meta (key, value) VALUES (?, '1')", (ONE_GATEWAY_A_SPAN,))
        else:  # back to one exporter (or none): what it already took is done, the fast path resumes
            if len(exporters) == 1 and exporters[0] in previous:
                conn.execute("UPDATE spans SET state = ? WHERE state = 0 AND NOT EXISTS"
                             " (SELECT 1 FROM deliveries d WHERE d.seq = spans.seq AND d.exporter = ?)", (DONE, exporters[0]))
            conn.execute("DELETE FROM deliveries")
            conn.execute("DELETE FROM spool_meta WHERE key IN ('exporters', ?)", (ONE_GATEWAY_A_SPAN,))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def is_gateway_cursor(name: str) -> bool:
    """A node's gateway cursor, of this run or an earlier one: ``gateway`` alone, ``gateway@HOST:PORT`` of several."""
    return name == "gateway" or name.startswith("gateway@")


def _regate(conn: sqlite3.Connection, routing: Routing | None, before: list[str], now: list[str], one_owner: bool) -> None:
    """The gateway cursors' rows after a restart (inside reconcile's transaction)."""
    if not now:  # no gateway any more: nothing is owed to one
        for name in before:
            conn.execute("DELETE FROM deliveries WHERE exporter = ?", (name,))
        return
    if not before:  # no gateway before (or from single mode): every pending span, to its gateway
        _owe_gateways(conn, routing, now, "state = 0", ())
        return
    if not one_owner and len(before) >= 2 and routing is not None and set(before) == set(now):
        _keep_owners_rows(conn, routing, before)  # a spool of 6489206–6a1227e: every gateway owed every span
        return
    if set(before) == set(now):
        return
    marks = _marks(len(before))
    seqs = [r[0] for r in conn.execute(f"SELECT DISTINCT seq FROM deliveries WHERE exporter IN ({marks})", before)]
    conn.execute(f"DELETE FROM deliveries WHERE exporter IN ({marks})", before)
    for i in range(0, len(seqs), 400):
        chunk = seqs[i:i + 400]
        _owe_gateways(conn, routing, now, f"state = 0 AND seq IN ({_marks(len(chunk))})", chunk)


def _owe_gateways(conn: sqlite3.Connection, routing: Routing | None, gateways: list[str], where: str,
                  params: Sequence[Any]) -> None:
    if routing is not None:
        _owe_routed(conn, routing, where, params)
    else:  # one gateway
        conn.execute(f"INSERT OR IGNORE INTO deliveries (exporter, seq) SELECT ?, seq FROM spans WHERE {where}",
                     (gateways[0], *params))


def _keep_owners_rows(conn: sqlite3.Connection, routing: Routing, gateways: list[str]) -> None:
    """Rows left by read-time routing (each gateway owed each span, the others passed over it): each span keeps
    its owner's row, or none when its owner took it already."""
    marks = _marks(len(gateways))
    seqs = [r[0] for r in conn.execute(f"SELECT DISTINCT seq FROM deliveries WHERE exporter IN ({marks})", gateways)]
    for i in range(0, len(seqs), 400):
        chunk = seqs[i:i + 400]
        rows = conn.execute(f"SELECT {OWED_COLUMNS} FROM spans WHERE seq IN ({_marks(len(chunk))})", chunk).fetchall()
        conn.executemany(f"DELETE FROM deliveries WHERE seq = ? AND exporter != ? AND exporter IN ({marks})",
                         [(r[0], name, *gateways) for r, name in zip(rows, routing.owners(conn, rows))])


def _owe_routed(conn: sqlite3.Connection, routing: Routing, where: str, params: Sequence[Any]) -> Counter[str]:
    """Each matching span, not yet owed to a sharing exporter, owed to its owner alone."""
    names = sorted(routing.routed)
    rows = conn.execute(f"SELECT {OWED_COLUMNS} FROM spans WHERE {where} AND NOT EXISTS (SELECT 1 FROM deliveries d"
                        f" WHERE d.seq = spans.seq AND d.exporter IN ({_marks(len(names))}))", (*params, *names)).fetchall()
    if not rows:
        return Counter()
    owners = routing.owners(conn, rows)
    conn.executemany("INSERT INTO deliveries (exporter, seq) VALUES (?, ?)", zip(owners, (r[0] for r in rows)))
    return Counter(owners)


def _owe(conn: sqlite3.Connection, exporters: Sequence[str], routing: Routing | None, where: str,
         params: Sequence[Any]) -> dict[str, int]:
    """Rows for the spans matching ``where``: one per exporter, the sharing ones' to the owner alone."""
    routed = routing.routed if routing is not None else frozenset()
    counts: dict[str, int] = {}
    for name in exporters:
        if name not in routed:
            counts[name] = conn.execute(f"INSERT OR IGNORE INTO deliveries (exporter, seq) SELECT ?, seq FROM spans"
                                        f" WHERE {where}", (name, *params)).rowcount
    if routing is not None and routed & set(exporters):
        counts.update(_owe_routed(conn, routing, where, params))
    return counts


def _add(total: dict[str, int], more: dict[str, int]) -> None:
    for name, n in more.items():
        total[name] = total.get(name, 0) + n


def owe_new(conn: sqlite3.Connection, exporters: Sequence[str], after_seq: int,
            routing: Routing | None = None) -> dict[str, int]:
    """The exporters owe the pending spans just inserted (seq > ``after_seq``); rows per exporter."""
    return _owe(conn, exporters, routing, "seq > ? AND state = 0", (after_seq,))


def owe_held(conn: sqlite3.Connection, exporters: Sequence[str], trace_ids: Sequence[str],
             routing: Routing | None = None) -> dict[str, int]:
    """The exporters owe the held spans of these kept trajectories (before they turn pending)."""
    return _owe_in(conn, exporters, routing, "state = 3 AND trace_id", trace_ids)


def owe_seqs(conn: sqlite3.Connection, exporters: Sequence[str], seqs: Sequence[int],
             routing: Routing | None = None) -> dict[str, int]:
    """The exporters owe these spans (engine spans released from AWAITING); rows per exporter."""
    return _owe_in(conn, exporters, routing, "seq", seqs)


def _owe_in(conn: sqlite3.Connection, exporters: Sequence[str], routing: Routing | None, column: str,
            values: Sequence[Any]) -> dict[str, int]:
    """:func:`_owe` of the spans whose ``column`` is one of ``values``, 400 at a time (the routing binds its
    names beside them: within SQLite's oldest limit of 999 variables)."""
    total: dict[str, int] = {}
    for i in range(0, len(values), 400):
        chunk = list(values[i:i + 400])
        _add(total, _owe(conn, exporters, routing, f"{column} IN ({_marks(len(chunk))})", chunk))
    return total


def next_owed(conn: sqlite3.Connection, exporter: str, limit: int) -> list[tuple[int, bytes, int | None, int | None]]:
    """This exporter's oldest owed spans, through its own primary-key range."""
    return conn.execute(
        "SELECT s.seq, s.payload, s.inputs_at, s.output_at FROM deliveries d JOIN spans s ON s.seq = d.seq"
        " WHERE d.exporter = ? ORDER BY d.seq LIMIT ?", (exporter, limit)).fetchall()


def settle(conn: sqlite3.Connection, exporters: Sequence[str], exporter: str, seqs: Sequence[int],
           dead_ids: set[str], keep: bool, owing: int | None = None) -> tuple[int, int, int, int]:
    """Removes ``exporter``'s rows for ``seqs``; spans nobody owes any more become done (deleted
    when not ``keep``), or dead when every exporter that owed them (``owing`` of them: see
    :func:`owing_per_span`) dead-lettered them.

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
                (span_id, *exporters)).fetchone()[0] >= (len(exporters) if owing is None else owing):
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
