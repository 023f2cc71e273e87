"""Spool: the durable SQLite file behind every acknowledgement, and the embedded local store.

A span is answered 2xx only after its row is committed (WAL; with ``synchronous=NORMAL`` a
commit survives a killed process, ``TRACECAR_SPOOL_SYNC=full`` also survives power loss).
Rows move pending → done (forwarded, or kept locally) or → dead (a permanent backend
rejection, kept with its reason). Under a tail-based budget rows start held (awaiting their
step's decision, see tracecar.collector.processors.sampling): a decision moves a kept trajectory's rows to
pending and deletes a dropped one's, in the same transaction as its ``trajectory_decisions``
rows, so budgets stay exact across restarts. ``span_id`` is unique, so a client's retry of a batch the
collector already took is dropped as a duplicate instead of being forwarded twice.
With several exporters, each has its own delivery cursor (:mod:`.deliveries`); a span stays
pending until every one of them took it or dead-lettered it.
All writes go through one connection on one thread; reads use their own connection.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ..types import Span
from . import deliveries
from .archive import COLUMNS as ARCHIVE_COLUMNS
from .archive import Fetched, SpanArchive, with_archived
from .full_payloads import DANGLING, REFS_MARK, conn_loader, full_rows, is_compact, spool_loader

PENDING, DONE, DEAD, HELD = 0, 1, 2, 3
# an engine span whose trajectory (so its project) is not known yet: stored, owed to no exporter
# (receivers.engine_hold); joined to its trajectory, or released as it is, later
AWAITING = 4

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
    sample_index,  -- no type on purpose: VERL's index is an int or a string, kept as sent
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
    payload BLOB NOT NULL,
    tokens INTEGER NOT NULL DEFAULT 0,
    inputs_at INTEGER,
    output_at INTEGER,
    token_arrays BLOB,  -- per-token logprobs/mask/entropy, packed (processors.token_arrays); NULL for most spans
    node TEXT  -- on a gateway: the node collector that forwarded the span (its X-Tracecar-Node); NULL elsewhere
);
CREATE INDEX IF NOT EXISTS spans_pending ON spans(seq) WHERE state = 0;
CREATE INDEX IF NOT EXISTS spans_trace ON spans(trace_id);
CREATE INDEX IF NOT EXISTS spans_roots ON spans(experiment, step, sample_index, rollout_n) WHERE parent_id IS NULL AND kind != 'annotation';
CREATE TABLE IF NOT EXISTS dead_letters (
    span_id TEXT NOT NULL,
    exporter TEXT NOT NULL,
    trace_id TEXT,
    name TEXT,
    reason TEXT NOT NULL,
    failed_at REAL NOT NULL,
    PRIMARY KEY (span_id, exporter)
);
CREATE INDEX IF NOT EXISTS spans_held ON spans(seq) WHERE state = 3;
CREATE TABLE IF NOT EXISTS trajectory_decisions (
    trace_id TEXT PRIMARY KEY,
    experiment TEXT,
    validate INTEGER NOT NULL,
    step INTEGER NOT NULL,
    round INTEGER NOT NULL,
    worker TEXT,
    sample_index,
    rollout_n INTEGER,
    keep INTEGER NOT NULL,
    rule TEXT,
    reason TEXT,
    reward REAL,
    has_error INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    truncated INTEGER NOT NULL DEFAULT 0,
    closed_by TEXT,
    decided_at REAL NOT NULL,
    policy_version INTEGER
);
CREATE INDEX IF NOT EXISTS trajectory_decisions_step ON trajectory_decisions(step, experiment, validate);
CREATE TABLE IF NOT EXISTS sample_decisions (
    budget_key TEXT NOT NULL,
    sample_index NOT NULL,
    keep INTEGER NOT NULL,
    PRIMARY KEY (budget_key, sample_index)
);
-- ids of spans deleted (forwarded with TRACECAR_KEEP_FORWARDED=false, evicted, sampled out): a
-- client's resend of one (its answer was lost) is still a duplicate, never forwarded again;
-- bounded by TRACECAR_FORGOTTEN_IDS_MAX (oldest first)
CREATE TABLE IF NOT EXISTS forgotten_spans (span_id TEXT PRIMARY KEY);
-- each trajectory's head-budget decision (sampling.head): its late annotations follow it, also
-- after a restart; bounded with the decision tables (TRACECAR_DECISIONS_MAX_ROWS)
CREATE TABLE IF NOT EXISTS trace_decisions (trace_id TEXT PRIMARY KEY, keep INTEGER NOT NULL);
-- trajectories some of whose spans retention moved to the archive (spool/archive.py) without their root
-- (the root was still to come): their readers look in the archive even once the root is here; bounded
-- with the decision tables (TRACECAR_DECISIONS_MAX_ROWS)
CREATE TABLE IF NOT EXISTS archived_partial (trace_id TEXT PRIMARY KEY);
-- spool facts: 'exporters' (spool.deliveries), 'stored_refs' (a span was stored as a prompt reference)
CREATE TABLE IF NOT EXISTS spool_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TRIGGER IF NOT EXISTS spans_forgotten AFTER DELETE ON spans BEGIN
    INSERT OR IGNORE INTO forgotten_spans (span_id) VALUES (OLD.span_id);
END;
"""


#: decisions under this budget key are a trajectory's head decision (sampling.head), kept in
#: ``trace_decisions`` (index = its trace id), not ``sample_decisions``
TRACE_DECISIONS = "\x00trace"


_COUNTS_SQL = (
    "SELECT COALESCE(SUM(state = 0), 0), COALESCE(SUM(CASE WHEN state = 0 THEN nbytes END), 0),"
    " COALESCE(SUM(nbytes), 0), COALESCE(SUM(state = 3), 0),"
    " COALESCE(SUM(CASE WHEN state = 3 THEN nbytes END), 0) FROM spans"
)


ARCHIVE_CHUNK = 100  # trajectories moved to the archive per insert (their payloads are read into memory)


class ArchiveFailed(Exception):
    """The archive refused a write during an eviction: that chunk and the rest stay in the spool. ``moved`` and
    ``spans`` say what earlier chunks moved (and deleted); ``__cause__`` is the archive's error."""

    def __init__(self, moved: int, spans: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.moved, self.spans = moved, spans


class SpoolFull(Exception):
    """The disk (or the configured bound) is full: answer 503 with Retry-After, store nothing."""


@dataclass
class SpoolRow:
    """One span ready to insert: its index columns, its payload, its size."""

    span: Span
    payload: bytes
    warnings: list[str] | None
    tokens: int = 0
    held: bool = False
    # Byte offsets of the serialised inputs/output inside ``payload`` (see pipeline.pack_payload):
    # the forwarder splices them into the backend request without parsing them again.
    inputs_at: int | None = None
    output_at: int | None = None
    token_arrays: bytes | None = None  # packed per-token arrays (processors.token_arrays), stored beside the payload
    awaiting: bool = False  # an engine span stored AWAITING its trajectory (receivers.engine_hold)
    refs: list[str] | None = None  # spans its payload refers to (stored prompt references, spool.full_payloads)
    local: bool = False  # stored done, owed to no exporter (a node's span of a trajectory it did not forward)
    node: str | None = None  # on a gateway: the node collector that forwarded it (receivers/forwarded.py)

    @property
    def size(self) -> int:
        """Bytes this row stores: its payload and its packed per-token arrays."""
        return len(self.payload) + (len(self.token_arrays) if self.token_arrays else 0)


@dataclass
class WriteResult:
    inserted: int
    duplicates: int
    duplicate_ids: list[str]


def _connect(path: Path, sync: str) -> sqlite3.Connection:
    fresh = not path.exists() or path.stat().st_size == 0
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30)
    if fresh:  # before WAL and the first table: lets eviction give pages back to the disk
        conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
    conn.execute("PRAGMA busy_timeout=30000")
    conn.execute("PRAGMA journal_size_limit=16777216")  # the WAL is trimmed back to 16 MiB after a checkpoint
    return conn


def _row_params(row: SpoolRow, state: int, now: float) -> tuple[Any, ...]:
    s = row.span
    get = s["attributes"].get  # the index columns read inline: this runs once per stored span
    # policy_version: what a fully-async (step -1) span is budgeted under (tail budgets per version)
    reward, validate, version = get("reward"), get("validate"), get("policy_version")
    experiment, step, index, rollout = get("experiment_name"), get("step"), get("sample_index"), get("rollout_n")
    arrays = row.token_arrays
    return (
        s["span_id"], s["trace_id"], s["parent_id"], s["name"], s["kind"], s["worker"],
        s.get("project"), s.get("entity"), experiment if type(experiment) in _KEYS else None,
        step if type(step) in _KEYS else None, index if type(index) in _KEYS else None,
        rollout if type(rollout) in _KEYS else None, None if validate is None else int(bool(validate)),
        s["start_time"], s["end_time"], int(s["exception"] is not None),
        reward if type(reward) in (int, float) else None,
        len(row.payload) + (len(arrays) if arrays else 0),
        HELD if row.held else AWAITING if row.awaiting else DONE if row.local else state, now,
        orjson.dumps(row.warnings).decode() if row.warnings else None, row.payload, row.tokens,
        row.inputs_at, row.output_at, version if type(version) is int and -(2**63) <= version < 2**63 else None, arrays,
        row.node,
    )


_KEYS = (int, str)  # the types an index column takes from attributes (an int or a string, kept as sent)


class Spool:
    """Thread-safe spool. Writes are serialised by a lock (callers run them in one executor)."""

    def __init__(self, path: Path, *, local_only: bool, sync: str = "normal", exporters: Sequence[str] = (),
                 routing: deliveries.Routing | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.local_only = local_only
        self.exporters = tuple(exporters)
        # exporters that share the spans, one owner a span (a node's several gateways), decided when owed
        self.routing = routing
        # two or more destinations: a delivery cursor each (the deliveries table), else the state column alone
        self.multi = len(self.exporters) >= 2 and not local_only
        self._write = _connect(path, sync)
        self._write.executescript(SCHEMA)
        columns = {name for _, name, *_ in self._write.execute("PRAGMA table_info(spans)")}
        if "tokens" not in columns:  # spools written before tail-based budgets
            self._write.execute("ALTER TABLE spans ADD COLUMN tokens INTEGER NOT NULL DEFAULT 0")
        for column in ("inputs_at", "output_at"):  # spools written before the splicing forwarder
            if column not in columns:
                self._write.execute(f"ALTER TABLE spans ADD COLUMN {column} INTEGER")
        if "policy_version" not in columns:  # spools written before tail budgets per policy version
            self._write.execute("ALTER TABLE spans ADD COLUMN policy_version INTEGER")
        decision_columns = {name for _, name, *_ in self._write.execute("PRAGMA table_info(trajectory_decisions)")}
        if "policy_version" not in decision_columns:
            self._write.execute("ALTER TABLE trajectory_decisions ADD COLUMN policy_version INTEGER")
        if "token_arrays" not in columns:  # spools written before the token view
            self._write.execute("ALTER TABLE spans ADD COLUMN token_arrays BLOB")
        if "node" not in columns:  # spools written before a gateway kept the forwarding node
            self._write.execute("ALTER TABLE spans ADD COLUMN node TEXT")
        # spools from before fan-out: dead letters rekeyed by (span, exporter), cursors reconciled
        deliveries.migrate_dead_letters(self._write, self.exporters[0] if len(self.exporters) == 1 else "")
        deliveries.reconcile(self._write, self.exporters if self.multi else self.exporters[:1], routing)
        self._owing = deliveries.owing_per_span(self.exporters, routing)
        self.owed: dict[str, int] = {}  # multi: spans each exporter still owes
        self._read = _connect(path, sync)
        # Local mode: called with the number of rows that just reached the store (state done)
        self.on_stored: Callable[[int], None] | None = None
        self._write_lock = threading.RLock()
        self._read_lock = threading.Lock()
        self._decision_read: sqlite3.Connection | None = None
        self._decision_lock = threading.Lock()
        self.pending_count = self.pending_bytes = self.stored_bytes = self.held_count = self.held_bytes = 0
        self.awaiting_count = self.awaiting_bytes = 0
        self.disk_full_at: float | None = None  # monotonic time of the last write refused for a full disk
        self._refs_marked = False  # spool_meta says 'stored_refs' (set by this process's first write of one)
        # where evicted trajectories go instead of being deleted, and where readers find them (spool/archive.py;
        # the ClickHouse store's span table, set by the viewer when TRACECAR_STORE=clickhouse); None: deleted
        self.archive: SpanArchive | None = None
        self.archived_generation = 0  # evictions into the archive committed by this process (Fetched's staleness)
        # the seq through which the read store has folded every span (set by the viewer; it may catch up first):
        # the size and age rules evict nothing past it (oldest_forwarded listed_only), so no trajectory leaves the
        # spool unlisted. None: no read store
        self.readers_through: Callable[[], int] | None = None
        self.recount()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction on the writer connection (under the write lock, re-entrant).

        Rolled back on any error; a full disk surfaces as :class:`SpoolFull` so ingest answers
        503 instead of 500 and nothing partial is stored.
        """
        with self._write_lock:
            conn = self._write
            try:
                conn.execute("BEGIN IMMEDIATE")
                yield conn
                conn.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                _rollback(conn)
                if "full" in str(exc).lower() or "disk" in str(exc).lower():
                    self.disk_full_at = time.monotonic()
                    raise SpoolFull(str(exc)) from None
                raise
            except BaseException:
                _rollback(conn)
                raise

    # ---- ingest --------------------------------------------------------------------------
    def write(self, rows: Sequence[SpoolRow], decisions: Iterable[tuple[str, int, bool]] = (),
              now: float | None = None, late: frozenset[str] | set[str] = frozenset()) -> WriteResult:
        """Commits new spans and sampling decisions in one transaction; known span ids are skipped.

        Rows marked ``held`` are stored held (awaiting a tail-based decision), the rest pending.
        ``late`` names spans of already decided, kept trajectories: their bytes and tokens are
        added to the trajectory's decision row in the same transaction (budgets stay exact).
        """
        state = DONE if self.local_only else PENDING
        now = time.time() if now is None else now
        marking = False
        with self._write_lock:
            with self._transaction() as conn:
                known = self._existing_ids(conn, [r.span["span_id"] for r in rows])
                fresh = [r for r in rows if r.span["span_id"] not in known]
                if any(r.refs for r in fresh):
                    self._check_refs(conn, fresh)
                    if not self._refs_marked:  # once per process: what lets a start without references skip the scan
                        conn.execute("INSERT OR IGNORE INTO spool_meta (key, value) VALUES ('stored_refs', '1')")
                        marking = True
                last_seq = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM spans").fetchone()[0] if self.multi else 0
                conn.executemany(
                    "INSERT INTO spans (span_id, trace_id, parent_id, name, kind, worker, project, entity,"
                    " experiment, step, sample_index, rollout_n, validate, start_time, end_time, has_error, reward,"
                    " nbytes, state, received_at, warnings, payload, tokens, inputs_at, output_at, policy_version, token_arrays, node)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    [_row_params(r, state, now) for r in fresh],
                )
                owed = deliveries.owe_new(conn, self.exporters, last_seq, self.routing) if self.multi and fresh else {}
                per_sample: list[tuple[str, Any, int]] = []
                per_trace: list[tuple[Any, int]] = []
                for k, i, keep in decisions:
                    if k == TRACE_DECISIONS:
                        per_trace.append((i, int(keep)))
                    else:
                        per_sample.append((k, i, int(keep)))
                conn.executemany("INSERT OR IGNORE INTO sample_decisions (budget_key, sample_index, keep) VALUES (?,?,?)",
                                 per_sample)
                conn.executemany("INSERT OR IGNORE INTO trace_decisions (trace_id, keep) VALUES (?,?)", per_trace)
                if late:
                    conn.executemany(
                        "UPDATE trajectory_decisions SET nbytes = nbytes + ?, tokens = tokens + ? WHERE trace_id = ?",
                        [(r.size, r.tokens, r.span["trace_id"]) for r in fresh if r.span["span_id"] in late],
                    )
            self._refs_marked = self._refs_marked or marking  # committed
            new_bytes = sum(r.size for r in fresh)
            held = [r for r in fresh if r.held or r.awaiting]  # neither is pending (nor stored for good, locally)
            local = [r for r in fresh if r.local and not (r.held or r.awaiting)] if state == PENDING else []
            awaiting = [r for r in fresh if r.awaiting and not r.held]
            self.awaiting_count += len(awaiting)
            self.awaiting_bytes += sum(r.size for r in awaiting)
            held_bytes = sum(r.size for r in held)
            self.stored_bytes += new_bytes
            self.held_count += len(held) - len(awaiting)
            self.held_bytes += held_bytes - sum(r.size for r in awaiting)
            if state == PENDING:
                self.pending_count += len(fresh) - len(held) - len(local)
                self.pending_bytes += new_bytes - held_bytes - sum(r.size for r in local)
                self._owe(owed)
            elif self.on_stored is not None and len(fresh) > len(held):
                self.on_stored(len(fresh) - len(held))
        duplicate_ids = [r.span["span_id"] for r in rows if r.span["span_id"] in known]
        return WriteResult(inserted=len(fresh), duplicates=len(duplicate_ids), duplicate_ids=duplicate_ids)

    @staticmethod
    def _existing_ids(conn: sqlite3.Connection, ids: list[str]) -> set[str]:
        found: set[str] = set()
        for i in range(0, len(ids), 400):  # twice the ids in one statement: within SQLite's 999 variables
            chunk = ids[i:i + 400]
            marks = ",".join("?" * len(chunk))
            found.update(
                sid for (sid,) in conn.execute(
                    f"SELECT span_id FROM spans WHERE span_id IN ({marks})"
                    f" UNION ALL SELECT span_id FROM forgotten_spans WHERE span_id IN ({marks})", chunk + chunk
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

    def load_trace_decision(self, trace_id: str) -> bool | None:
        """A trajectory's persisted head-budget decision, or None. On a connection of its own: the
        sampler asks from the event loop, and the shared read connection may be held by a long
        viewer query."""
        with self._decision_lock:
            if self._decision_read is None:
                self._decision_read = _connect(self.path, "normal")
            row = self._decision_read.execute("SELECT keep FROM trace_decisions WHERE trace_id = ?", (trace_id,)).fetchone()
        return None if row is None else bool(row[0])

    # ---- held spans and tail-based decisions (tracecar.collector.processors.sampling) ---------------
    def release(self, kept: Sequence[str], dropped: Sequence[str], decisions: Sequence[tuple[Any, ...]] = (),
                patches: Sequence[tuple[str, bytes]] = (), local: Sequence[str] = ()) -> tuple[int, int, int]:
        """One decision, in one transaction: held rows of ``kept`` traces become pending (done
        in local mode) with ``patches`` (span_id, new payload) applied, those of ``local`` traces
        done (stored here, owed to no exporter: a node's trajectories that are not candidates), those
        of ``dropped`` traces are deleted, and the ``trajectory_decisions`` rows are recorded.

        Returns (spans released, spans dropped, bytes dropped).
        """
        target = DONE if self.local_only else PENDING
        with self._write_lock:
            with self._transaction() as conn:
                delta_bytes = 0
                for span_id, payload in patches:
                    old = conn.execute("SELECT nbytes FROM spans WHERE span_id = ? AND state = 3", (span_id,)).fetchone()
                    if old is None:
                        continue
                    size = len(payload) + conn.execute("SELECT COALESCE(LENGTH(token_arrays), 0) FROM spans WHERE span_id = ?",
                                                       (span_id,)).fetchone()[0]
                    conn.execute("UPDATE spans SET payload = ?, nbytes = ?, inputs_at = NULL, output_at = NULL"
                                 " WHERE span_id = ?", (payload, size, span_id))
                    delta_bytes += size - old[0]
                owed = deliveries.owe_held(conn, self.exporters, kept, self.routing) if self.multi and target == PENDING else {}
                moved, moved_bytes = _apply_to_held(conn, kept, "UPDATE spans SET state = ?", (target,))
                gone, gone_bytes = _apply_to_held(conn, dropped, "DELETE FROM spans", ())
                stayed, stayed_bytes = _apply_to_held(conn, local, "UPDATE spans SET state = ?", (DONE,))
                conn.executemany(
                    "INSERT OR REPLACE INTO trajectory_decisions (trace_id, experiment, validate, step, round, worker,"
                    " sample_index, rollout_n, keep, rule, reason, reward, has_error, nbytes, tokens, truncated,"
                    " closed_by, decided_at, policy_version) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    decisions,
                )
            self.held_bytes += delta_bytes
            self.stored_bytes += delta_bytes - gone_bytes
            self.held_count -= moved + gone + stayed
            self.held_bytes -= moved_bytes + gone_bytes + stayed_bytes
            if target == PENDING:
                self.pending_count += moved
                self.pending_bytes += moved_bytes
                self._owe(owed)
            elif self.on_stored is not None and moved:
                self.on_stored(moved)
        return moved, gone, gone_bytes

    def held_rows(self) -> list[tuple[Any, ...]]:
        """Index columns of every held span, oldest first: what a restart rebuilds its summaries from."""
        with self._read_lock:
            return self._read.execute(
                "SELECT span_id, trace_id, parent_id, kind, worker, experiment, validate, step, sample_index,"
                " rollout_n, has_error, reward, nbytes, tokens, received_at, start_time, policy_version FROM spans"
                " WHERE state = 3 ORDER BY seq"
            ).fetchall()

    def held_payloads(self, trace_ids: Sequence[str], roots_only: bool) -> list[tuple[str, str, bytes]]:
        """(span_id, trace_id, payload) of held spans of these traces (only their roots, or all)."""
        out: list[tuple[str, str, bytes]] = []
        extra = " AND span_id = trace_id" if roots_only else ""
        with self._read_lock:
            for i in range(0, len(trace_ids), 500):
                chunk = list(trace_ids[i:i + 500])
                out.extend(self._read.execute(
                    f"SELECT span_id, trace_id, payload FROM spans WHERE state = 3{extra}"
                    f" AND trace_id IN ({','.join('?' * len(chunk))}) ORDER BY seq", chunk
                ))
        return out

    def decided_usage(self, trace_id: str) -> tuple[Any, ...] | None:
        """(experiment, validate, step, policy version, trajectory bytes, step kept bytes, step kept
        tokens) of a decided trajectory."""
        with self._read_lock:
            row = self._read.execute(
                "SELECT experiment, validate, step, policy_version, nbytes FROM trajectory_decisions WHERE trace_id = ?",
                (trace_id,),
            ).fetchone()
            if row is None:
                return None
            kept_bytes, kept_tokens = self._read.execute(
                "SELECT COALESCE(SUM(nbytes), 0), COALESCE(SUM(tokens), 0) FROM trajectory_decisions"
                " WHERE step = ? AND experiment IS ? AND validate = ? AND policy_version IS ? AND keep = 1",
                (row[2], row[0], row[1], row[3]),
            ).fetchone()
        return (row[0], bool(row[1]), row[2], row[3], row[4], kept_bytes, kept_tokens)

    def trace_verdict(self, trace_id: str) -> bool | None:
        """Whether a decided trajectory was kept; None if it was never decided."""
        with self._read_lock:
            row = self._read.execute("SELECT keep FROM trajectory_decisions WHERE trace_id = ?", (trace_id,)).fetchone()
        return None if row is None else bool(row[0])

    def trace_seen_unheld(self, trace_id: str) -> bool:
        """True if spans of this trace are stored but not held (it was never under a tail budget)."""
        with self._read_lock:
            return self._read.execute("SELECT 1 FROM spans WHERE trace_id = ? AND state NOT IN (3, 4) LIMIT 1",
                                      (trace_id,)).fetchone() is not None

    def step_last_round(self, experiment: Any, validate: bool, step: int, policy_version: int | None = None) -> int:
        with self._read_lock:
            row = self._read.execute(
                "SELECT MAX(round) FROM trajectory_decisions WHERE step = ? AND experiment IS ? AND validate = ?"
                " AND policy_version IS ?",
                (step, experiment, int(validate), policy_version),
            ).fetchone()
        return row[0] or 0

    def step_decisions(self, experiment: Any, validate: bool | None, step: int,
                       policy_version: int | None = None, *, any_version: bool = True) -> list[dict[str, Any]]:
        """The decision records of one step (every round), kept ones first.

        A fully-async step (-1) is budgeted per policy version: ``any_version=False`` reads one
        version's records (``policy_version``, None for the trajectories that had none).
        """
        sql = ("SELECT trace_id, experiment, validate, step, policy_version, round, worker, sample_index, rollout_n,"
               " keep, rule, reason, reward, has_error, nbytes, tokens, truncated, closed_by, decided_at"
               " FROM trajectory_decisions WHERE step = ? AND experiment IS ?")
        params: list[Any] = [step, experiment]
        if validate is not None:
            sql += " AND validate = ?"
            params.append(int(validate))
        if not any_version:
            sql += " AND policy_version IS ?"
            params.append(policy_version)
        return self.query(sql + " ORDER BY keep DESC, sample_index, rollout_n, trace_id", params)

    def latest_decided_steps(self) -> list[tuple[Any, str, int, int | None]]:
        """(experiment, worker, step, highest policy version) of each worker's decided steps: where
        each worker had got to (the caller takes the highest)."""
        with self._read_lock:
            return self._read.execute(
                "SELECT experiment, worker, step, MAX(policy_version) FROM trajectory_decisions"
                " GROUP BY experiment, worker, step"
            ).fetchall()

    # ---- forwarding ----------------------------------------------------------------------
    def _owe(self, rows: dict[str, int]) -> None:
        for name, n in rows.items():
            self.owed[name] = self.owed.get(name, 0) + n

    def next_pending(self, limit: int, exporter: str | None = None) -> list[tuple[int, bytes, int | None, int | None]]:
        """Oldest pending spans first (of ``exporter``'s cursor, with several), so each trace is
        delivered in arrival order.

        Rows are (seq, payload, inputs_at, output_at); the offsets are None for payloads that
        were rewritten after ingest (tail-based decisions) or written by an older version.
        """
        with self._read_lock:
            if self.multi:
                rows = deliveries.next_owed(self._read, self._cursor(exporter), limit)
            else:
                rows = self._read.execute(
                    "SELECT seq, payload, inputs_at, output_at FROM spans WHERE state = 0 ORDER BY seq LIMIT ?", (limit,)
                ).fetchall()
        if not any(is_compact(r[1]) for r in rows):
            return rows
        full = full_rows([(p, a, b) for _, p, a, b in rows], spool_loader(self.query))  # stored prompt references, rebuilt
        return [(r[0], *f) for r, f in zip(rows, full)]  # type: ignore[misc]

    def _cursor(self, exporter: str | None) -> str:
        if exporter not in self.exporters:
            raise ValueError(f"no delivery cursor for exporter {exporter!r} (configured: {', '.join(self.exporters)})")
        return exporter

    def mark_forwarded(self, seqs: Sequence[int], keep: bool, exporter: str | None = None) -> None:
        if self.multi:
            self._settle(self._cursor(exporter), seqs, (), keep)
            return
        self._finish(seqs, keep=keep)

    def mark_dead(self, dead: Sequence[tuple[int, str, str, str, str]], exporter: str | None = None,
                  keep: bool = True) -> None:
        """Moves permanently rejected spans to the dead-letter table with the backend's reason."""
        if not dead:
            return
        if self.multi:
            self._settle(self._cursor(exporter), [d[0] for d in dead], dead, keep)
            return
        now = time.time()
        name = exporter or (self.exporters[0] if self.exporters else "")
        with self._write_lock:
            with self._transaction() as conn:
                self._insert_dead(conn, name, dead, now)
                n, nbytes = self._set_state(conn, [d[0] for d in dead], DEAD)
            self._pending_done(n, nbytes, deleted=False)

    @staticmethod
    def _insert_dead(conn: sqlite3.Connection, exporter: str, dead: Sequence[tuple[int, str, str, str, str]], now: float) -> None:
        conn.executemany(
            "INSERT OR REPLACE INTO dead_letters (span_id, exporter, trace_id, name, reason, failed_at) VALUES (?,?,?,?,?,?)",
            [(sid, exporter, tid, name, reason, now) for _, sid, tid, name, reason in dead],
        )

    def _settle(self, exporter: str, seqs: Sequence[int], dead: Sequence[tuple[int, str, str, str, str]], keep: bool) -> None:
        """Several exporters: this one's answer for ``seqs``; spans nobody owes any more leave pending."""
        if not seqs:
            return
        with self._write_lock:
            with self._transaction() as conn:
                if dead:
                    self._insert_dead(conn, exporter, dead, time.time())
                removed, n, nbytes, deleted = deliveries.settle(
                    conn, self.exporters, exporter, seqs, {d[1] for d in dead}, keep, self._owing)
            self.owed[exporter] = self.owed.get(exporter, 0) - removed
            self.pending_count -= n
            self.pending_bytes -= nbytes
            self.stored_bytes -= deleted

    def _finish(self, seqs: Sequence[int], keep: bool) -> None:
        if not seqs:
            return
        with self._write_lock:
            with self._transaction() as conn:
                if keep:
                    n, nbytes = self._set_state(conn, seqs, DONE)
                else:
                    n, nbytes = self._pending_of(conn, seqs)
                    for i in range(0, len(seqs), 500):
                        chunk = seqs[i:i + 500]
                        conn.execute(f"DELETE FROM spans WHERE state = 0 AND seq IN ({','.join('?' * len(chunk))})", chunk)
            self._pending_done(n, nbytes, deleted=not keep)

    def _pending_done(self, n: int, nbytes: int, *, deleted: bool) -> None:
        """Counters follow a COMMIT, never precede it: a rolled-back transaction changes none."""
        self.pending_count -= n
        self.pending_bytes -= nbytes
        if deleted:
            self.stored_bytes -= nbytes

    def _set_state(self, conn: sqlite3.Connection, seqs: Sequence[int], state: int) -> tuple[int, int]:
        """Moves pending rows to ``state``; returns (rows, bytes) it moved, for after the commit."""
        n, nbytes = self._pending_of(conn, seqs)
        for i in range(0, len(seqs), 500):
            chunk = seqs[i:i + 500]
            conn.execute(f"UPDATE spans SET state = ? WHERE state = 0 AND seq IN ({','.join('?' * len(chunk))})", (state, *chunk))
        return n, nbytes

    @staticmethod
    def _pending_of(conn: sqlite3.Connection, seqs: Sequence[int]) -> tuple[int, int]:
        n = nbytes = 0
        for i in range(0, len(seqs), 500):
            chunk = seqs[i:i + 500]
            c, b = conn.execute(
                f"SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM spans WHERE state = 0 AND seq IN ({','.join('?' * len(chunk))})",
                chunk,
            ).fetchone()
            n, nbytes = n + c, nbytes + b
        return n, nbytes

    def expand_stored_refs(self, chunk: int = 200) -> int:
        """Rewrites every span stored as a prompt reference whole; returns how many.

        Why: a spool written with references (``TRACECAR_STORE_PROMPT_REFS``) and reopened where
        they are off — ``TRACECAR_KEEP_FORWARDED=false`` deletes a forwarded span a later turn still
        names, a tail budget deletes the spans of a trajectory it drops — would leave those later
        references dangling. Rebuilt at start, in seq order (a reference names an earlier span), so
        every reader sees the very bytes a store without references holds."""
        done, after = 0, 0
        with self._write_lock:
            if self._write.execute("SELECT 1 FROM spool_meta WHERE key = 'stored_refs'").fetchone() is None:
                return 0  # never stored one: no scan of the whole file at every start
            while True:
                rows = self._write.execute(
                    "SELECT seq, payload, inputs_at, output_at FROM spans WHERE seq > ? AND instr(payload, ?) > 0"
                    " ORDER BY seq LIMIT ?", (after, REFS_MARK, chunk)).fetchall()
                if not rows:
                    break
                after = rows[-1][0]
                full = full_rows([(p, i, o) for _, p, i, o in rows], conn_loader(self._write, "spans"))
                changed = [(payload, len(payload or b"") - len(old), i, o, seq)
                           for (seq, old, _, _), (payload, i, o) in zip(rows, full) if payload is not None and payload != old]
                with self._transaction() as conn:
                    conn.executemany("UPDATE spans SET payload = ?, nbytes = nbytes + ?, inputs_at = ?, output_at = ?"
                                     " WHERE seq = ?", changed)
                done += len(changed)
            with self._transaction() as conn:
                conn.execute("DELETE FROM spool_meta WHERE key = 'stored_refs'")
            self._refs_marked = False
            self.recount()
        return done

    def recount(self) -> None:
        """Counters re-derived from SQL (after a failed write, so a drift can never outlive it)."""
        with self._write_lock:
            (self.pending_count, self.pending_bytes, self.stored_bytes, self.held_count,
             self.held_bytes) = self._write.execute(_COUNTS_SQL).fetchone()
            self.awaiting_count, self.awaiting_bytes = self._write.execute(
                "SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM spans WHERE state = 4").fetchone()
            if self.multi:
                self.owed = deliveries.owed_counts(self._write, self.exporters)

    def owed_count(self, exporter: str) -> int:
        """Spans ``exporter`` has still to take (with one exporter: every pending span)."""
        return self.owed.get(exporter, 0) if self.multi else self.pending_count

    # ---- engine spans awaiting their trajectory (receivers.engine_hold) ------------------------
    def awaiting_traces(self) -> dict[str, int]:
        """trace_id -> spans AWAITING their trajectory (what a restart rebuilds the hold from)."""
        with self._read_lock:
            return dict(self._read.execute("SELECT trace_id, COUNT(*) FROM spans WHERE state = 4 GROUP BY trace_id").fetchall())

    def trajectory_state(self, trace_id: str, engine_worker_prefix: str) -> int | None:
        """The state of a stored span of this trajectory that is not an engine span (HELD under a
        tail budget, else pending or later), or None when none is stored."""
        with self._read_lock:
            row = self._read.execute(
                "SELECT MIN(state = 3) FROM spans WHERE trace_id = ? AND state != 4 AND kind != 'annotation'"
                " AND (worker IS NULL OR worker NOT LIKE ?)", (trace_id, engine_worker_prefix + "%")).fetchone()
        return None if row is None or row[0] is None else HELD if row[0] else PENDING

    def settle_awaiting(self, trace_id: str, target: int | None,
                        patch: Callable[[dict[str, Any]], tuple[tuple[Any, ...], bytes, int, int]] | None) -> int:
        """The AWAITING spans of one trajectory, in one transaction: to ``target`` (PENDING, or HELD
        to share a tail decision), each payload and its index columns rewritten by ``patch`` first
        when given (returns (trace_id, parent_id, worker, project, entity, experiment, step,
        sample_index, rollout_n, validate), payload, inputs_at, output_at: an engine span joined by
        its request id moves to its call's trace); ``target=None`` deletes them (their trajectory
        was dropped by a budget). Returns the spans settled."""
        if self.local_only:
            target = DONE if target is not None else None
        with self._write_lock:
            with self._transaction() as conn:
                rows = conn.execute("SELECT seq, payload, nbytes, token_arrays FROM spans WHERE trace_id = ? AND state = 4",
                                    (trace_id,)).fetchall()
                before = sum(r[2] for r in rows)
                after = 0
                seqs = [r[0] for r in rows]
                if target is None:
                    conn.executemany("DELETE FROM spans WHERE seq = ?", [(q,) for q in seqs])
                else:
                    for seq, payload, nbytes, arrays in rows:
                        if patch is not None:
                            columns, payload, inputs_at, output_at = patch(orjson.loads(payload))
                            nbytes = len(payload) + (len(arrays) if arrays else 0)
                            conn.execute("UPDATE spans SET trace_id = ?, parent_id = ?, worker = ?, project = ?, entity = ?,"
                                         " experiment = ?, step = ?,"
                                         " sample_index = ?, rollout_n = ?, validate = ?, payload = ?, nbytes = ?,"
                                         " inputs_at = ?, output_at = ? WHERE seq = ?",
                                         (*columns, payload, nbytes, inputs_at, output_at, seq))
                        after += nbytes
                        conn.execute("UPDATE spans SET state = ? WHERE seq = ?", (target, seq))
                owed = deliveries.owe_seqs(conn, self.exporters, seqs, self.routing) if self.multi and target == PENDING else {}
            self.awaiting_count -= len(rows)
            self.awaiting_bytes -= before
            self.stored_bytes += after - before
            if target == PENDING:
                self.pending_count += len(rows)
                self.pending_bytes += after
                self._owe(owed)
            elif target == HELD:
                self.held_count += len(rows)
                self.held_bytes += after
            elif target == DONE and self.on_stored is not None and rows:
                self.on_stored(len(rows))
        return len(rows)

    def oldest_awaiting(self, limit: int, before: float | None = None) -> list[str]:
        """Trace ids of the oldest AWAITING spans (received before ``before``), oldest first."""
        where = " AND received_at < ?" if before is not None else ""
        params: tuple[Any, ...] = (before, limit) if before is not None else (limit,)
        with self._read_lock:
            return [t for (t,) in self._read.execute(
                f"SELECT trace_id FROM spans WHERE state = 4{where} GROUP BY trace_id ORDER BY MIN(seq) LIMIT ?", params)]

    # ---- retention of forwarded spans -----------------------------------------------------
    def used_bytes(self) -> int:
        """Bytes of the store file in use: its pages minus the free list (new rows reuse freed pages).

        The WAL beside it is checkpointed by SQLite every ~4 MiB and trimmed to 16 MiB.
        """
        with self._read_lock:
            page_size = self._read.execute("PRAGMA page_size").fetchone()[0]
            pages = self._read.execute("PRAGMA page_count").fetchone()[0]
            free = self._read.execute("PRAGMA freelist_count").fetchone()[0]
        return (pages - free) * page_size

    def oldest_forwarded(self, limit: int, before: float | None = None, *, listed_only: bool = False) -> list[tuple[str, int, int]]:
        """(trace_id, spans, bytes) of the trajectories whose spans are all forwarded, oldest last arrival first.

        ``listed_only``: only those whose every span the read store has folded (``readers_through``), so that
        no trajectory leaves the spool before it is listed."""
        having = ""
        params: list[Any] = [DONE, DONE]
        if before is not None:
            having, params = having + " AND MAX(received_at) < ?", [*params, before]
        if listed_only and self.readers_through is not None:
            having, params = having + " AND MAX(seq) <= ?", [*params, self.readers_through()]
        params.append(limit)
        with self._read_lock:
            return self._read.execute(
                "SELECT trace_id, COUNT(*), SUM(nbytes) FROM spans GROUP BY trace_id"
                f" HAVING MIN(state) = ? AND MAX(state) = ?{having} ORDER BY MAX(received_at) LIMIT ?", params,
            ).fetchall()

    def evict(self, trace_ids: Sequence[str], to_archive: bool = True) -> tuple[int, int]:
        """Deletes these trajectories whole, if every span of each is still forwarded (done); with an
        archive (and ``to_archive``), moves them there first (:meth:`_archive_and_delete`).

        Returns (trajectories, spans) deleted. A trajectory that gained a pending span since it
        was chosen is left alone, so no trajectory is ever half evicted.
        """
        if not trace_ids:
            return 0, 0
        if self.archive is not None and to_archive:
            return self._archive_and_delete(self.archive, trace_ids)
        with self._write_lock:
            with self._transaction() as conn:
                ids = list(trace_ids)
                busy: set[str] = set()
                for i in range(0, len(ids), 500):
                    chunk = ids[i:i + 500]
                    busy.update(t for (t,) in conn.execute(
                        f"SELECT DISTINCT trace_id FROM spans WHERE state != ? AND trace_id IN ({','.join('?' * len(chunk))})",
                        (DONE, *chunk)))
                ids = [t for t in ids if t not in busy]
                n, nbytes = _delete_counted(conn, "trace_id", ids)
            self.stored_bytes -= nbytes
        return len(ids), n

    def _archive_and_delete(self, archive: SpanArchive, trace_ids: Sequence[str]) -> tuple[int, int]:
        """Writes the done trajectories among ``trace_ids`` to the archive, then deletes them from the spool,
        ``ARCHIVE_CHUNK`` trajectories at a time (one archive insert each: bounded memory).

        The archive's write comes first and outside the write lock (ingest goes on meanwhile). When it fails,
        nothing of that chunk is deleted: :class:`ArchiveFailed` carries what earlier chunks moved. A trajectory
        that changed since its rows were read (a span arrived, one not yet forwarded) is left whole in the spool,
        as :meth:`evict` leaves a busy one (its archived copy collapses with the next). A trajectory whose
        archived rows had no root is marked in ``archived_partial`` so that its readers still look in the archive
        once the root is here.
        """
        ids = list(trace_ids)
        moved = spans = 0
        for i in range(0, len(ids), ARCHIVE_CHUNK):
            chunk = ids[i:i + ARCHIVE_CHUNK]
            found = self.query(f"SELECT {', '.join(ARCHIVE_COLUMNS)}, state FROM spans WHERE trace_id IN"
                               f" ({','.join('?' * len(chunk))}) ORDER BY seq", chunk)
            busy = {r["trace_id"] for r in found if r["state"] != DONE}
            rows = [r for r in found if r["trace_id"] not in busy]
            if not rows:
                continue
            try:
                archive.keep(rows)
            except Exception as exc:  # noqa: BLE001 - any archive failure: this chunk stays, the caller counts it
                raise ArchiveFailed(moved, spans, exc) from exc
            del found
            taken: dict[str, set[int]] = {}
            for r in rows:
                taken.setdefault(r["trace_id"], set()).add(r["seq"])
            rootless = {r["trace_id"] for r in rows} - {r["trace_id"] for r in rows
                                                         if r["parent_id"] is None and r["kind"] != "annotation"}
            done, n = self._delete_archived(taken, rootless)
            moved, spans = moved + done, spans + n
        return moved, spans

    def _delete_archived(self, taken: dict[str, set[int]], rootless: set[str]) -> tuple[int, int]:
        """Deletes the archived trajectories whose spool rows are still exactly the archived ones, all done (one
        that changed meanwhile stays whole); marks those archived without their root. Returns (trajectories,
        rows) deleted."""
        with self._write_lock:
            with self._transaction() as conn:
                ids = list(taken)
                now: dict[str, set[int]] = {}
                changed: set[str] = set()
                for i in range(0, len(ids), 500):
                    chunk = ids[i:i + 500]
                    for trace_id, seq, state in conn.execute(
                            f"SELECT trace_id, seq, state FROM spans WHERE trace_id IN ({','.join('?' * len(chunk))})", chunk):
                        now.setdefault(trace_id, set()).add(seq)
                        if state != DONE:
                            changed.add(trace_id)
                # still exactly (a subset of) the archived rows, all done; none left: another eviction took it
                gone = [t for t in ids if t in now and t not in changed and now[t] <= taken[t]]
                n, nbytes = _delete_counted(conn, "seq", [seq for t in gone for seq in now.get(t, ())])
                conn.executemany("INSERT OR IGNORE INTO archived_partial (trace_id) VALUES (?)",
                                 [(t,) for t in gone if t in rootless])
                # before the commit: a reader that sees these rows gone sees the new count too, and reads the archive
                # again rather than use rows it fetched before them (Fetched)
                self.archived_generation += 1
            self.stored_bytes -= nbytes
        return len(gone), n

    def may_be_archived(self, trace_id: str) -> bool:
        """Whether some of this trajectory's spans may be in the archive (see spool/archive.py): an indexed
        lookup or two; False without an archive. (A trajectory without its root in the spool — evicted, still
        running, or unknown — may be.)"""
        if self.archive is None:
            return False
        if not self.query("SELECT 1 AS x FROM spans WHERE trace_id = ? AND parent_id IS NULL AND kind != 'annotation' LIMIT 1",
                          [trace_id]):
            return True
        return bool(self.query("SELECT 1 AS x FROM archived_partial WHERE trace_id = ?", [trace_id]))

    def with_archive(self, trace_id: str, rows: list[dict[str, Any]], fetched: Fetched | None = None) -> list[dict[str, Any]]:
        """The spool's ``rows`` of one trajectory (with ``seq``, ``span_id``, ``start_time``), read just before, and,
        when it may have been archived, its archived spans not among them, in the spool's order. The archive is
        read after the spool (a span moved meanwhile was archived before it was deleted: found either way);
        ``fetched``: the archived rows of a page of trajectories read at once (:meth:`archived_of`), used while no
        eviction happened since (else read again). Raises what the archive raises (a reader's 503)."""
        archive = self.archive
        if archive is None or not self.may_be_archived(trace_id):
            return rows
        if fetched is not None and fetched.generation == self.archived_generation and trace_id in fetched.rows:
            return with_archived(rows, fetched.rows[trace_id])
        return with_archived(rows, archive.spans_of([trace_id]))

    def archived_of(self, trace_ids: Sequence[str]) -> Fetched | None:
        """The archived rows of those of ``trace_ids`` that may have been archived: one archive read for a page of
        trajectories (an export's) instead of one each; None without an archive."""
        archive = self.archive
        if archive is None:
            return None
        generation = self.archived_generation
        wanted = [t for t in trace_ids if self.may_be_archived(t)]
        out: dict[str, list[dict[str, Any]]] = {t: [] for t in wanted}
        for row in archive.spans_of(wanted) if wanted else ():
            out[row["trace_id"]].append(row)
        return Fetched(out, generation)

    def trim_decisions(self, max_rows: int) -> dict[str, int]:
        """Deletes the oldest sampling-decision rows above ``max_rows`` per table (5 % more, so
        trimming is rare); returns the rows deleted per table.

        These tables only grow (one row per sampled index or decided trajectory); the oldest rows
        are of steps long closed, whose late spans no longer come.
        """
        return self._trim(("sample_decisions", "trajectory_decisions", "trace_decisions", "archived_partial"), max_rows)

    def trim_forgotten(self, max_rows: int) -> int:
        """Deletes the oldest ids of deleted spans above ``max_rows`` (see ``forgotten_spans``)."""
        return self._trim(("forgotten_spans",), max_rows).get("forgotten_spans", 0)

    def _trim(self, tables: tuple[str, ...], max_rows: int) -> dict[str, int]:
        deleted: dict[str, int] = {}
        with self._write_lock:
            for table in tables:
                (count,) = self._write.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
                excess = count - max_rows
                if excess <= 0:
                    continue
                excess += max_rows // 20
                with self._transaction() as conn:
                    cutoff = conn.execute(f"SELECT rowid FROM {table} ORDER BY rowid LIMIT 1 OFFSET ?",
                                          (min(excess, count) - 1,)).fetchone()
                    if cutoff is None:
                        continue
                    deleted[table] = conn.execute(f"DELETE FROM {table} WHERE rowid <= ?", cutoff).rowcount
        return deleted

    def checkpoint(self) -> bool:
        """Moves the WAL into the main file and truncates it, giving its space back to the disk."""
        with self._write_lock:
            try:
                busy = self._write.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            except sqlite3.Error:
                return False
        return not busy

    def shrink(self) -> None:
        """Returns the free pages to the disk (spools created with incremental auto-vacuum), then the WAL."""
        with self._write_lock:
            try:
                self._write.executescript("PRAGMA incremental_vacuum;")  # executescript steps it to the end
            except sqlite3.Error:
                pass
        self.checkpoint()

    @staticmethod
    def _check_refs(conn: sqlite3.Connection, fresh: Sequence[SpoolRow]) -> None:
        """Every span a stored reference names is in this write or stored in the same trajectory
        (the ingest path made sure; a trajectory evicted meanwhile is the one way to miss): a miss
        is counted and logged (spool.full_payloads.DANGLING), never silent."""
        batch = {r.span["span_id"]: r.span["trace_id"] for r in fresh}
        wanted = sorted({ref for r in fresh for ref in r.refs or () if ref not in batch})
        found: dict[str, str] = {}
        for i in range(0, len(wanted), 500):
            chunk = wanted[i:i + 500]
            found.update(conn.execute(f"SELECT span_id, trace_id FROM spans WHERE span_id IN ({','.join('?' * len(chunk))})",
                                      chunk).fetchall())
        for r in fresh:
            trace = r.span["trace_id"]
            missing = [ref for ref in r.refs or () if batch.get(ref, found.get(ref)) != trace]
            if missing:
                DANGLING.hit("write", len(missing), f"span {r.span['span_id']!r} of trajectory {trace!r} refers to "
                             f"{missing[:3]}, not stored")

    # ---- reading -------------------------------------------------------------------------
    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        with self._read_lock:
            cur = self._read.execute(sql, params)
            cols = [c[0] for c in cur.description or ()]
            return [dict(zip(cols, row)) for row in cur.fetchall()]

    def dead_letters(self, limit: int = 100, exporter: str | None = None) -> list[dict[str, Any]]:
        where, params = ("WHERE exporter = ? ", (exporter,)) if exporter is not None else ("", ())
        return self.query("SELECT span_id, exporter, trace_id, name, reason, failed_at FROM dead_letters "
                          f"{where}ORDER BY failed_at DESC LIMIT ?", (*params, limit))

    def dead_count(self, exporter: str | None = None) -> int:
        if exporter is not None:
            return self.query("SELECT COUNT(*) AS n FROM dead_letters WHERE exporter = ?", (exporter,))[0]["n"]
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
        with self._decision_lock:
            if self._decision_read is not None:
                self._decision_read.close()
                self._decision_read = None


def _delete_counted(conn: sqlite3.Connection, column: str, values: Sequence[Any]) -> tuple[int, int]:
    """Deletes the spans whose ``column`` is one of ``values`` (500 a statement); returns (rows, their bytes)."""
    n = nbytes = 0
    for i in range(0, len(values), 500):
        chunk = list(values[i:i + 500])
        marks = ",".join("?" * len(chunk))
        c, b = conn.execute(f"SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM spans WHERE {column} IN ({marks})", chunk).fetchone()
        conn.execute(f"DELETE FROM spans WHERE {column} IN ({marks})", chunk)
        n, nbytes = n + c, nbytes + b
    return n, nbytes


def _apply_to_held(conn: sqlite3.Connection, trace_ids: Sequence[str], statement: str,
                   params: tuple[Any, ...]) -> tuple[int, int]:
    """Runs ``statement`` on the held rows of ``trace_ids`` (in chunks); returns (rows, bytes) it hit."""
    rows = nbytes = 0
    for i in range(0, len(trace_ids), 500):
        chunk = list(trace_ids[i:i + 500])
        where = f" WHERE state = 3 AND trace_id IN ({','.join('?' * len(chunk))})"
        n, size = conn.execute(f"SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM spans{where}", chunk).fetchone()
        conn.execute(statement + where, (*params, *chunk))
        rows, nbytes = rows + n, nbytes + size
    return rows, nbytes


def _rollback(conn: sqlite3.Connection) -> None:
    try:
        conn.execute("ROLLBACK")
    except sqlite3.Error:
        pass
