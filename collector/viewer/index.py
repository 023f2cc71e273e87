"""Trajectory index: one row per trajectory, so the viewer lists, sorts and pages fast.

The spool stores spans; a trajectory's reward lives in a later annotation span, its turn and
tool-call counts in its children's payloads. Sorting a million spans' worth of trajectories by
such derived values in SQL means aggregating every trajectory per page view, so the viewer
keeps this summary instead, with an index per sort key.

It lives in its own SQLite file next to the spool (``viewer-index.sqlite3``), written only by
the viewer, so the spool's single writer (ingest) never waits on it; the spool is attached
read-only. It is caught up incrementally by ``seq``: a span's ``seq`` is assigned in commit
order, so "everything above the watermark" is exactly what is new. A stored span changes in
place only while it is *held* (state 3, awaiting a tail-based sampling decision, which then
writes ``kept_because`` into the root or deletes the trajectory), so held spans are not indexed
until released: their seqs wait in the ``held`` table and are re-read once their state moves.
Engine spans awaiting their trajectory (state 4, ``receivers.engine_hold``: rewritten, perhaps moved
to another trace, when it comes) wait there the same way.
Spans deleted after forwarding (``keep_forwarded=false``) are pruned. Catching up happens on
demand (each viewer request, bounded in time, then a background thread if there is a
backlog), so an unused viewer costs nothing. The file is a cache: it is rebuilt when its
version changes or the spool under it was replaced.
"""

from __future__ import annotations

import builtins  # TrajectoryIndex.list shadows the builtin in its class
import logging
import math
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from ..loudness import BackgroundFailures
from ..query_params import INT64_MAX, INT64_MIN
from ..shape import is_engine_payload, is_tool, token_counts, token_output
from ..spool.full_payloads import conn_loader, full_spans, is_compact, with_rows
from ..trajectory_filter import TrajectoryFilter
from . import mirror_columns, root_attributes, search, truth

log = logging.getLogger("tracecar.collector.viewer")

# 3: sample_index untyped; 4: engine spans never make a turn an aggregate; 5: what the trainer did; 6: previews;
# 7: tool calls are real calls only (shape.is_tool); 8: training truth (viewer/truth.py); 9: inclusion_probability;
# 10: node (a gateway's forwarding node collector); 11: the root's attributes as rows (root_attributes.py)
INDEX_VERSION = "11"
ROOT = "root_seq IS NOT NULL"  # every query names it, so the partial indexes apply

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value);
CREATE TABLE IF NOT EXISTS trajectories (
    trace_id TEXT PRIMARY KEY,
    root_seq INTEGER,
    name TEXT,
    experiment TEXT,
    step INTEGER,
    sample_index,
    rollout_n INTEGER,
    validate INTEGER,
    worker TEXT,
    node TEXT,  -- on a gateway: the node collector that forwarded the root (spool spans.node); NULL elsewhere
    start_time REAL,
    end_time REAL,
    duration REAL,
    kept_because TEXT,
    inclusion_probability REAL,  -- a uniform draw's chance (k/n), stamped on the root with kept_because
    root_reward REAL,
    ann_reward REAL,
    ann_seq INTEGER,
    reward REAL,
    span_count INTEGER NOT NULL DEFAULT 0,
    has_error INTEGER NOT NULL DEFAULT 0,
    turns INTEGER NOT NULL DEFAULT 0,
    tool_calls INTEGER NOT NULL DEFAULT 0,
    tool_errors INTEGER NOT NULL DEFAULT 0,
    prompt_tokens INTEGER,
    response_tokens INTEGER NOT NULL DEFAULT 0,
    advantage REAL,  -- what the trainer did, from annotations (client.annotate): the latest value of each wins
    trained INTEGER,
    filtered_by TEXT,
    policy_version INTEGER,
    trained_on_version INTEGER
);
CREATE TABLE IF NOT EXISTS llm_calls (
    span_id TEXT PRIMARY KEY,
    trace_id TEXT NOT NULL,
    prompt_tokens INTEGER,
    response_tokens INTEGER
);
CREATE INDEX IF NOT EXISTS llm_calls_trace ON llm_calls(trace_id);
CREATE TABLE IF NOT EXISTS parents (parent_id TEXT PRIMARY KEY) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS held (seq INTEGER PRIMARY KEY);
-- trajectories changed since a mirror (viewer/clickhouse_store.py) last took them: its durable cursor
CREATE TABLE IF NOT EXISTS changed (trace_id TEXT PRIMARY KEY) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS traj_overview ON trajectories(experiment, validate, step, reward, kept_because, trace_id, root_seq) WHERE {ROOT};
CREATE INDEX IF NOT EXISTS traj_filter ON trajectories(experiment, step, sample_index, rollout_n) WHERE {ROOT};
CREATE INDEX IF NOT EXISTS traj_step ON trajectories(step) WHERE {ROOT};
CREATE INDEX IF NOT EXISTS traj_start ON trajectories(start_time) WHERE {ROOT};
CREATE INDEX IF NOT EXISTS traj_reward ON trajectories(reward) WHERE {ROOT};
CREATE INDEX IF NOT EXISTS traj_turns ON trajectories(turns) WHERE {ROOT};
CREATE INDEX IF NOT EXISTS traj_duration ON trajectories(duration) WHERE {ROOT};
CREATE INDEX IF NOT EXISTS traj_kept ON trajectories(kept_because) WHERE {ROOT};
CREATE INDEX IF NOT EXISTS traj_root_seq ON trajectories(root_seq) WHERE {ROOT};
CREATE INDEX IF NOT EXISTS traj_trained ON trajectories(trained, filtered_by) WHERE {ROOT};
CREATE INDEX IF NOT EXISTS traj_advantage ON trajectories(advantage) WHERE {ROOT};
"""

SORTS = {
    "start": "start_time", "reward": "reward", "turns": "turns", "duration": "duration", "step": "step",
    "sample_index": "sample_index", "rollout_n": "rollout_n", "tools": "tool_calls", "tokens": "response_tokens",
    "spans": "span_count", "advantage": "advantage",
}
NOT_NULL = {"turns", "tool_calls", "response_tokens", "span_count"}
COLUMNS = ("trace_id, name, experiment, step, sample_index, rollout_n, validate, worker, node, start_time, end_time, duration,"
           " kept_because, inclusion_probability, reward, span_count, has_error, turns, tool_calls, tool_errors,"
           " prompt_tokens, response_tokens, advantage, trained, filtered_by, policy_version, trained_on_version")
TRAINER_KEYS = ("advantage", "trained", "filtered_by", "policy_version", "trained_on_version")
_TRAINER_TYPES = {"advantage": (int, float), "trained": (bool,), "filtered_by": (str,), "policy_version": (int,),
                  "trained_on_version": (int,)}
_TRAINER_UPDATE = ("UPDATE trajectories SET " + ", ".join(f"{k} = COALESCE(?, {k})" for k in TRAINER_KEYS)
                   + " WHERE trace_id = ?")

_UPSERT = """
INSERT INTO trajectories (trace_id, root_seq, name, experiment, step, sample_index, rollout_n, validate, worker,
    start_time, end_time, duration, kept_because, inclusion_probability, root_reward, node, ann_seq, ann_reward, span_count,
    has_error, tool_calls, tool_errors)
VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)
ON CONFLICT(trace_id) DO UPDATE SET
    root_seq = COALESCE(excluded.root_seq, root_seq),
    name = IIF(excluded.root_seq IS NULL, name, excluded.name),
    experiment = IIF(excluded.root_seq IS NULL, experiment, excluded.experiment),
    step = IIF(excluded.root_seq IS NULL, step, excluded.step),
    sample_index = IIF(excluded.root_seq IS NULL, sample_index, excluded.sample_index),
    rollout_n = IIF(excluded.root_seq IS NULL, rollout_n, excluded.rollout_n),
    validate = IIF(excluded.root_seq IS NULL, validate, excluded.validate),
    worker = IIF(excluded.root_seq IS NULL, worker, excluded.worker),
    node = IIF(excluded.root_seq IS NULL, node, excluded.node),
    start_time = IIF(excluded.root_seq IS NULL, start_time, excluded.start_time),
    end_time = IIF(excluded.root_seq IS NULL, end_time, excluded.end_time),
    duration = IIF(excluded.root_seq IS NULL, duration, excluded.duration),
    kept_because = IIF(excluded.root_seq IS NULL, kept_because, excluded.kept_because),
    inclusion_probability = IIF(excluded.root_seq IS NULL, inclusion_probability, excluded.inclusion_probability),
    root_reward = IIF(excluded.root_seq IS NULL, root_reward, excluded.root_reward),
    ann_reward = IIF(COALESCE(excluded.ann_seq, -1) > COALESCE(ann_seq, -1), excluded.ann_reward, ann_reward),
    ann_seq = MAX(COALESCE(excluded.ann_seq, -1), COALESCE(ann_seq, -1)),
    span_count = span_count + excluded.span_count,
    has_error = MAX(has_error, excluded.has_error),
    tool_calls = tool_calls + excluded.tool_calls,
    tool_errors = tool_errors + excluded.tool_errors
"""

_DERIVE = """
UPDATE trajectories SET
    reward = COALESCE(root_reward, ann_reward),
    turns = (SELECT COUNT(*) FROM llm_calls c WHERE c.trace_id = trajectories.trace_id
             AND NOT EXISTS (SELECT 1 FROM parents p WHERE p.parent_id = c.span_id)),
    response_tokens = (SELECT COALESCE(SUM(c.response_tokens), 0) FROM llm_calls c WHERE c.trace_id = trajectories.trace_id
                       AND NOT EXISTS (SELECT 1 FROM parents p WHERE p.parent_id = c.span_id)),
    prompt_tokens = (SELECT MAX(c.prompt_tokens) FROM llm_calls c WHERE c.trace_id = trajectories.trace_id
                     AND NOT EXISTS (SELECT 1 FROM parents p WHERE p.parent_id = c.span_id))
WHERE trace_id = ?
"""

HELD = 3  # spool state of a span awaiting a tail-based sampling decision (tracecar.collector.processors.sampling)
AWAITING = 4  # an engine span awaiting its trajectory (receivers.engine_hold): rewritten in place, maybe re-keyed, later
_WAITING = (HELD, AWAITING)  # indexed once they move on, like held spans
_COLUMNS = """seq, span_id, trace_id, parent_id, name, kind, worker, experiment, step, sample_index, rollout_n, validate,
       start_time, end_time, has_error, reward, state, IIF(state IN (3, 4), NULL, payload), node, inputs_at"""
_SCAN = f"SELECT {_COLUMNS} FROM spool.spans WHERE seq > ? ORDER BY seq LIMIT ?"


ListFilter = TrajectoryFilter  # the viewer's name for the one filter (trajectory_filter.py)


def root_where(flt: TrajectoryFilter) -> tuple[str, list[Any]]:
    """The filter over this index's ``trajectories``: root rows only (so the partial indexes apply)."""
    clauses, params = flt.where()
    return (f"{ROOT} AND {clauses}" if clauses else ROOT), params


class _Delta:
    __slots__ = ("root", "ann_seq", "ann_reward", "span_count", "has_error", "tool_calls", "tool_errors", "trainer")

    def __init__(self) -> None:
        self.trainer: dict[str, Any] = {}  # what the trainer did: the latest annotation's value per key
        self.root: tuple[Any, ...] | None = None
        self.ann_seq: int | None = None
        self.ann_reward: float | None = None
        self.span_count = self.has_error = self.tool_calls = self.tool_errors = 0

    def params(self, trace_id: str) -> tuple[Any, ...]:
        root = self.root or (None,) * 15
        return (trace_id, *root, self.ann_seq, self.ann_reward, self.span_count, self.has_error,
                self.tool_calls, self.tool_errors)


def _trainer_values(payload: bytes | None) -> dict[str, Any]:
    """What an annotation says the trainer did (advantage, trained, filtered_by, versions); parsed only if it may."""
    if not payload or not any(k.encode() in payload for k in ("advantage", "trained", "filtered_by", "_version")):
        return {}
    try:
        attrs = orjson.loads(payload).get("attributes") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return {}
    out: dict[str, Any] = {}
    for key in TRAINER_KEYS:
        value = attrs.get(key)
        if value is not None and type(value) in _TRAINER_TYPES[key] and not (key != "trained" and type(value) is bool):
            if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
                continue  # refused at ingest (validate.py); a spool from before that must not stop the index
            out[key] = int(value) if key == "trained" else value
    return out


def _label(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def _probability(value: Any) -> float | None:
    """A stamped inclusion probability, if it is one (a number in (0, 1]); anything else is not listed."""
    if type(value) in (int, float) and 0 < value <= 1:
        return float(value)
    return None


def _spool_uri(path: Path) -> str:
    return "file:" + urllib.parse.quote(str(path.resolve())) + "?mode=ro"


def _latest_seq(conn: sqlite3.Connection) -> int:
    """The highest seq the spool ever assigned (AUTOINCREMENT's counter never goes back)."""
    try:
        row = conn.execute("SELECT seq FROM spool.sqlite_sequence WHERE name = 'spans'").fetchone()
    except sqlite3.OperationalError:  # created with the spool's first row
        row = None
    return int(row[0]) if row else 0


def overview_of(rows: list[tuple[Any, ...]], experiment: str | None, validate: bool | None, bins: int,
                bounds: tuple[float, float] | None = None) -> dict[str, Any]:
    """The overview from ``(step, reward, kept_because, trace_id, tie-break)`` rows ordered by step, reward:
    shared by every read store (collector/read_store.py). ``bounds``: the histogram's reward range (several
    gateways' overviews binned alike, viewer/federation.py); default the rows' own."""
    by_step: dict[Any, list[tuple[Any, ...]]] = {}
    for row in rows:
        by_step.setdefault(row[0], []).append(row)
    scored = [r[1] for r in rows if r[1] is not None]
    low, high = bounds if bounds is not None else (min(scored), max(scored)) if scored else (0.0, 1.0)
    if high == low:
        low, high = low - 0.5, high + 0.5
    width = (high - low) / bins
    steps = []
    for step, group in by_step.items():
        rewards = [(r[1], r[3]) for r in group if r[1] is not None]
        values = [r for r, _ in rewards]
        # ties broken by rowid, as the list's reward sort does, so best/worst are its two ends
        scored_rows = [r for r in group if r[1] is not None]
        worst_row = min(scored_rows, key=lambda r: (r[1], r[4]), default=None)
        best_row = max(scored_rows, key=lambda r: (r[1], r[4]), default=None)
        kept: dict[str, int] = {}
        for r in group:
            if r[2] is not None:
                kept[r[2]] = kept.get(r[2], 0) + 1
        hist = [0] * bins
        for value in values:
            hist[max(0, min(bins - 1, int((value - low) / width)))] += 1
        entry: dict[str, Any] = {"step": step, "trajectories": len(group), "scored": len(values), "kept": kept, "hist": hist}
        if values:
            assert worst_row is not None and best_row is not None  # the rows of those values
            entry.update(
                mean=sum(values) / len(values), min=values[0], max=values[-1],
                p10=_quantile(values, 0.1), p25=_quantile(values, 0.25), p50=_quantile(values, 0.5),
                p75=_quantile(values, 0.75), p90=_quantile(values, 0.9),
                worst={"trace_id": worst_row[3], "reward": worst_row[1]},
                best={"trace_id": best_row[3], "reward": best_row[1]},
            )
        steps.append(entry)
    return {"experiment": experiment, "validate": validate, "trajectories": len(rows),
            "bin_edges": [low + i * width for i in range(bins + 1)],
            "rules": sorted({rule for s in steps for rule in s["kept"]}), "steps": steps}


def _quantile(ordered: list[float], q: float) -> float:
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class TrajectoryIndex:
    """Thread-safe; every method is blocking (callers run them with ``asyncio.to_thread``)."""

    def __init__(self, spool_path: Path, index_path: Path | None = None, *, prune_deleted: bool = False,
                 chunk_rows: int = 5000, chunk_bytes: int = 32 << 20, track_changes: bool = False) -> None:
        self.spool_path = spool_path
        # a mirror (the ClickHouse store) reads what changed from ``changed``; off, nothing is written there
        # and any mirror's token is dropped, so a mirror that missed changes starts again (see mirror_token)
        self.track_changes = track_changes
        self.index_path = index_path or spool_path.with_name("viewer-index.sqlite3")
        self.prune_deleted = prune_deleted  # the spool deletes forwarded spans (keep_forwarded=false)
        self.chunk_rows = chunk_rows
        self.chunk_bytes = chunk_bytes
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._watermark = 0
        self._caught_up_at = -1
        self._cache: dict[Any, Any] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self._catch_up_failures = BackgroundFailures()  # per request at most: logged rate-limited
        self._pruned_at = 0.0
        self._held_checked_at = 0.0
        self._indexed_since_analyze = 0
        self._indexed_at_analyze = 0
        self._recent_turns = truth.RecentTurns()  # the last turns' ids, for the next turn's drift check

    # ---- lifecycle ---------------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            if self._closed:
                raise RuntimeError("trajectory index is closed")
            try:
                self._conn = self._open()
            except sqlite3.OperationalError:  # locked, unreadable spool...: not the cache's fault
                raise
            except sqlite3.DatabaseError as exc:  # a damaged cache ("not a database", "malformed"): start again
                log.warning("viewer index unreadable, rebuilding", extra={"event": "viewer_index_rebuild", "reason": str(exc)})
                for suffix in ("", "-wal", "-shm"):
                    Path(str(self.index_path) + suffix).unlink(missing_ok=True)
                self._conn = self._open()
        return self._conn

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect("file:" + urllib.parse.quote(str(self.index_path.resolve())), isolation_level=None,
                               check_same_thread=False, timeout=30, uri=True)
        try:
            return self._prepare(conn)
        except BaseException:
            conn.close()
            raise

    def _prepare(self, conn: sqlite3.Connection) -> sqlite3.Connection:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=OFF")  # a cache: a torn write means a rebuild, not a loss
        conn.execute("ATTACH DATABASE ? AS spool", (_spool_uri(self.spool_path),))
        conn.executescript(SCHEMA)
        conn.executescript(search.SCHEMA)
        conn.executescript(truth.SCHEMA)
        conn.executescript(root_attributes.SCHEMA)
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        watermark = int(meta.get("watermark") or 0)
        if meta.get("version") != INDEX_VERSION or not self._same_spool(conn, watermark, meta.get("watermark_span")):
            conn.executescript("DROP TABLE trajectories; DROP TABLE llm_calls; DROP TABLE parents; DROP TABLE held;"
                               " DELETE FROM meta;" + search.DROP + truth.DROP + root_attributes.DROP)
            conn.executescript(SCHEMA)
            conn.executescript(search.SCHEMA)
            conn.executescript(truth.SCHEMA)
            conn.executescript(root_attributes.SCHEMA)
            conn.execute("INSERT INTO meta (key, value) VALUES ('version', ?)", (INDEX_VERSION,))
            watermark = 0
        if not self.track_changes:
            conn.execute("DELETE FROM meta WHERE key = 'mirror'")
            conn.execute("DELETE FROM changed")
        self._watermark = watermark
        return conn

    @staticmethod
    def _same_spool(conn: sqlite3.Connection, watermark: int, span_id: Any) -> bool:
        """False when the spool under the index is not the one it indexed (seq restarted)."""
        if watermark == 0:
            return True
        row = conn.execute("SELECT span_id FROM spool.spans WHERE seq = ?", (watermark,)).fetchone()
        if row is not None:
            return row[0] == span_id
        return _latest_seq(conn) >= watermark  # the row was deleted (forwarded, or sampled out): same spool

    def close(self) -> None:
        self._closed = True
        thread = self._thread
        if thread is not None:
            thread.join(timeout=10)
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # ---- catching up -------------------------------------------------------------------------
    def refresh(self, budget_s: float = 0.3, *, all_held: bool = False) -> bool:
        """Indexes new spans for up to ``budget_s``; True when the index has caught up.

        ``all_held``: also re-read every held span now (not only those below the spool's oldest
        held one, with the rest every few seconds), so a step decided just now is listed: for
        the API, whose callers list right after a decision. Bounded by the spool's held spans.
        """
        deadline = time.monotonic() + budget_s
        with self._lock:
            conn = self._db()
            while True:
                if not self._step(conn):
                    break
                if time.monotonic() >= deadline:
                    return False
            self._released(conn, everything=all_held or time.monotonic() - self._held_checked_at > 5)
            if self.prune_deleted and time.monotonic() - self._pruned_at > 10:
                self._prune(conn)
            self._analyze(conn)
            return True

    def catching_up(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def catch_up_in_background(self) -> None:
        """Starts (once at a time) a thread that indexes the backlog, then exits."""
        with self._lock:
            if self._closed or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self._catch_up, name="tracecar-viewer-index", daemon=True)
            self._thread.start()

    def _catch_up(self) -> None:
        try:
            while not self._closed and not self.refresh(0.1):
                time.sleep(0.005)  # let request threads take the lock between slices
        except Exception:  # noqa: BLE001 - a failed catch-up is retried by the next request
            self._catch_up_failures.failed("viewer_index", "viewer index catch-up failed; the next request retries it")

    def _step(self, conn: sqlite3.Connection) -> bool:
        """Indexes one chunk of new spans; False when there was nothing new."""
        cursor = conn.execute(_SCAN, (self._watermark, self.chunk_rows))
        rows, nbytes = [], 0
        for row in cursor:
            rows.append(row)
            nbytes += len(row[17] or b"")
            if nbytes >= self.chunk_bytes:
                break
        cursor.close()
        if not rows:
            return False
        held = [(r[0],) for r in rows if r[16] in _WAITING]
        self._apply(conn, [r for r in rows if r[16] not in _WAITING], add_held=held, watermark=(rows[-1][0], rows[-1][1]))
        return True

    def _released(self, conn: sqlite3.Connection, everything: bool) -> None:
        """Indexes held spans whose decision came (kept: now with ``kept_because``), forgets dropped ones.

        Cheap each time for the seqs below the spool's oldest held span (all decided); all of
        them at most every few seconds (steps of different experiments close out of order).
        """
        if everything:
            self._held_checked_at = time.monotonic()
            candidates = [r[0] for r in conn.execute("SELECT seq FROM held")]
        else:
            oldest = conn.execute("SELECT MIN(seq) FROM spool.spans WHERE state IN (3, 4)").fetchone()[0]
            sql, params = ("SELECT seq FROM held", []) if oldest is None else ("SELECT seq FROM held WHERE seq < ?", [oldest])
            candidates = [r[0] for r in conn.execute(sql, params)]
        for i in range(0, len(candidates), 500):
            chunk = candidates[i:i + 500]
            rows = conn.execute(f"SELECT {_COLUMNS} FROM spool.spans WHERE seq IN ({','.join('?' * len(chunk))})", chunk).fetchall()
            still = {r[0] for r in rows if r[16] in _WAITING}
            done = [(seq,) for seq in chunk if seq not in still]
            if done:
                self._apply(conn, [r for r in rows if r[16] not in _WAITING], drop_held=done)

    def _apply(self, conn: sqlite3.Connection, rows: list[tuple[Any, ...]], *, add_held: Sequence[tuple[int]] = (),
               drop_held: Sequence[tuple[int]] = (), watermark: tuple[int, str] | None = None) -> None:
        deltas: dict[str, _Delta] = {}
        llm_rows: list[tuple[Any, ...]] = []
        texts: list[tuple[Any, ...]] = []
        parent_ids: set[str] = set()
        notes: list[tuple[str, int, bytes | None]] = []  # annotations: reward components (viewer/truth.py)
        turns: list[tuple[int, str, str, Any, tuple[list[int], list[int]]]] = []  # LLM calls with prompt ids: drift
        roots: list[tuple[str, Any]] = []  # (trace_id, the root's attributes): what attr= filters on
        full = self._full(conn, rows)
        for (seq, span_id, trace_id, parent_id, name, kind, worker, experiment, step, sample_index, rollout_n,
             validate, start, end, has_error, reward, _state, payload, node, inputs_at) in rows:
            delta = deltas.get(trace_id)
            if delta is None:
                delta = deltas[trace_id] = _Delta()
            if kind == "annotation":
                if reward is not None and (delta.ann_seq is None or seq > delta.ann_seq):
                    delta.ann_seq, delta.ann_reward = seq, reward
                delta.trainer.update(_trainer_values(payload))  # rows come in seq order: later notes win
                notes.append((trace_id, seq, payload))
                continue
            delta.span_count += 1
            delta.has_error = max(delta.has_error, has_error)
            if parent_id is not None and not is_engine_payload(payload):  # an engine span never makes a turn an aggregate
                parent_ids.add(parent_id)
            span = full.get(seq) or self._parse(payload, root=parent_id is None)
            if parent_id is None:
                duration = end - start if start is not None and end is not None else None
                attributes = (span or self._head(payload, inputs_at)).get("attributes") or {}
                kept = _label(attributes.get("kept_because"))
                delta.root = (seq, name, experiment, step, sample_index, rollout_n, validate, worker, start, end,
                              duration, kept, _probability(attributes.get("inclusion_probability")), reward, node)
                roots.append((trace_id, attributes))
            output = span.get("output")
            if token_output(kind, output) and isinstance(output, dict):
                prompt_tokens, response_tokens = token_counts(span)
                llm_rows.append((span_id, trace_id, prompt_tokens, response_tokens))
                ids = truth.turn_ids(span)
                if ids is not None:
                    turns.append((seq, span_id, trace_id, start, ids))
                texts.append((trace_id, start, output.get("prompt_text"), output.get("response_text")))
            elif is_tool(kind, name, output):
                delta.tool_calls += 1
                delta.tool_errors += has_error
        conn.execute("BEGIN")
        try:
            conn.executemany("INSERT OR IGNORE INTO parents (parent_id) VALUES (?)", [(p,) for p in parent_ids])
            conn.executemany("INSERT OR IGNORE INTO llm_calls (span_id, trace_id, prompt_tokens, response_tokens) "
                             "VALUES (?,?,?,?)", llm_rows)
            conn.executemany(_UPSERT, [d.params(t) for t, d in deltas.items()])
            conn.executemany(_DERIVE, [(t,) for t in deltas])
            conn.executemany(_TRAINER_UPDATE, [(*(d.trainer.get(k) for k in TRAINER_KEYS), t)
                                               for t, d in deltas.items() if d.trainer])
            search.note(conn, texts)
            truth.note_annotations(conn, notes)
            truth.note_turns(conn, sorted(turns), self._recent_turns)
            truth.compare_pending(conn, [t for t, _, _ in notes], [t[2] for t in turns])
            root_attributes.note(conn, roots)
            if self.track_changes:
                conn.executemany("INSERT OR IGNORE INTO changed (trace_id) VALUES (?)", [(t,) for t in deltas])
            conn.executemany("INSERT OR IGNORE INTO held (seq) VALUES (?)", add_held)
            conn.executemany("DELETE FROM held WHERE seq = ?", drop_held)
            if watermark is not None:
                conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                                 [("watermark", watermark[0]), ("watermark_span", watermark[1])])
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if watermark is not None:
            self._watermark = watermark[0]
        if rows:
            self._cache.clear()
            self._indexed_since_analyze += len(rows)

    def _analyze(self, conn: sqlite3.Connection) -> None:
        """Refreshes the planner's statistics each time the index has doubled (a few ms).

        Without them SQLite guesses, and e.g. counts one step's trajectories by scanning its
        whole experiment; with them every filter seeks its most selective index.
        """
        if self._indexed_since_analyze < max(5000, self._indexed_at_analyze):
            return
        conn.execute("PRAGMA analysis_limit=1000")
        conn.execute("ANALYZE main")
        self._indexed_at_analyze += self._indexed_since_analyze
        self._indexed_since_analyze = 0

    @staticmethod
    def _full(conn: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> dict[int, dict[str, Any]]:
        """The chunk's spans stored with prompt references, parsed and rebuilt whole (by seq)."""
        compact: dict[int, dict[str, Any]] = {}
        for row in rows:
            if is_compact(row[17]):
                try:
                    span = orjson.loads(row[17])
                except orjson.JSONDecodeError:
                    continue
                if isinstance(span, dict):
                    compact[row[0]] = span
        if compact:
            held = {row[1]: (row[2], row[17]) for row in rows if row[17]}
            full_spans(compact.values(), with_rows(held, conn_loader(conn)))
        return compact

    @staticmethod
    def _parse(payload: bytes | None, root: bool) -> dict[str, Any]:
        """Parses only payloads that can matter: token outputs and a root's ``kept_because``."""
        if not payload:
            return {}
        if b'"response_' not in payload and b'"token_ids"' not in payload and not (root and b"kept_because" in payload):
            return {}  # no token output (a tool is told by its name) and no rule: nothing to read
        try:
            span = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return {}
        return span if isinstance(span, dict) else {}

    @staticmethod
    def _head(payload: bytes | None, inputs_at: int | None) -> dict[str, Any]:
        """A root's fields before its inputs (its attributes: what attr= filters on), parsed without the inputs and
        output (a VERL agent loop's hold whole prompts and token ids); the whole payload where no offset is kept."""
        if not payload:
            return {}
        try:
            span = orjson.loads(payload[:inputs_at - len(b',"inputs":')] + b"}" if inputs_at else payload)
        except orjson.JSONDecodeError:
            return {}
        return span if isinstance(span, dict) else {}

    def _prune(self, conn: sqlite3.Connection) -> None:
        """Drops trajectories whose root the spool deleted after forwarding."""
        self._pruned_at = time.monotonic()
        gone = [r[0] for r in conn.execute(
            f"SELECT trace_id FROM trajectories WHERE {ROOT} AND NOT EXISTS (SELECT 1 FROM spool.spans s WHERE s.seq = root_seq)"
        )]
        if gone:
            conn.execute("BEGIN")
            for i in range(0, len(gone), 500):
                chunk = gone[i:i + 500]
                marks = ",".join("?" * len(chunk))
                root_attributes.forget(conn, chunk)
                conn.execute(f"DELETE FROM trajectories WHERE trace_id IN ({marks})", chunk)
                conn.execute(f"DELETE FROM llm_calls WHERE trace_id IN ({marks})", chunk)
                for table in truth.TABLES:
                    conn.execute(f"DELETE FROM {table} WHERE trace_id IN ({marks})", chunk)
            search.forget(conn, gone)
            if self.track_changes:
                conn.executemany("INSERT OR IGNORE INTO changed (trace_id) VALUES (?)", [(t,) for t in gone])
            conn.execute("COMMIT")
            self._cache.clear()

    def status(self) -> dict[str, Any]:
        with self._lock:
            conn = self._db()
            latest = _latest_seq(conn)
            held = conn.execute("SELECT COUNT(*) FROM held").fetchone()[0]
            # behind by the rows still there past the watermark, not by the counter: the spool's newest rows may
            # have been deleted before they were read (a dropped trajectory), and the counter never goes back
            newest = conn.execute("SELECT MAX(seq) FROM spool.spans").fetchone()[0] or 0
            behind = max(0, min(latest, newest) - self._watermark)
            return {"indexed_seq": self._watermark, "latest_seq": latest, "behind_spans": behind,
                    "caught_up": behind == 0, "held_spans": held}

    def listed_through(self) -> int:
        """The spool seq through which every span is folded into this index: the watermark, and below the lowest
        held span it still waits on (held spans pass the watermark unfolded, and are folded once released).
        Retention evicts into the archive nothing past it (viewer/routes.py)."""
        with self._lock:
            low = self._db().execute("SELECT MIN(seq) FROM held").fetchone()[0]
            return self._watermark if low is None else min(self._watermark, int(low) - 1)

    # ---- a mirror's cursor (viewer/clickhouse_store.py) -----------------------------------------
    def mirror_token(self) -> str | None:
        """The token a mirror last synced this index under; None after a rebuild or a run without tracking."""
        with self._lock:
            row = self._db().execute("SELECT value FROM meta WHERE key = 'mirror'").fetchone()
            return None if row is None else str(row[0])

    def restart_mirror(self, token: str) -> None:
        """Marks every trajectory changed under a new mirror token (the mirror emptied itself first)."""
        with self._lock:
            conn = self._db()
            conn.execute("BEGIN")
            try:
                conn.execute(f"INSERT OR IGNORE INTO changed (trace_id) SELECT trace_id FROM trajectories WHERE {ROOT}")
                conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('mirror', ?)", (token,))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def changed_rows(self, limit: int) -> tuple[builtins.list[dict[str, Any]], builtins.list[str]]:
        """Up to ``limit`` changed trajectories: (rooted rows with ``rid``, ``prompt``, ``response``, the root's flattened
        ``attributes`` and the truth filter columns (viewer/mirror_columns.py); ids gone or not rooted)."""
        with self._lock:
            conn = self._db()
            ids = [r[0] for r in conn.execute("SELECT trace_id FROM changed LIMIT ?", (limit,))]
            if not ids:
                return [], []
            marks = ",".join("?" * len(ids))
            rows = self._rows(conn, f"SELECT t.rowid AS rid, {', '.join('t.' + c.strip() for c in COLUMNS.split(','))},"
                                    f" p.prompt AS prompt, p.response AS response FROM trajectories t"
                                    f" LEFT JOIN previews p ON p.trace_id = t.trace_id"
                                    f" WHERE t.trace_id IN ({marks}) AND t.root_seq IS NOT NULL", ids)
            found = [r["trace_id"] for r in rows]
            attributes = mirror_columns.attributes(conn, found)
            truths = mirror_columns.truth_columns(conn, found)
            for row in rows:
                row["attributes"] = attributes[row["trace_id"]]
                row.update(truths[row["trace_id"]])
            rooted = set(found)
            return rows, [t for t in ids if t not in rooted]

    def forget_changed(self, trace_ids: builtins.list[str]) -> int:
        """Drops ids the mirror has taken (a later change marks them again); returns how many remain."""
        with self._lock:
            conn = self._db()
            conn.executemany("DELETE FROM changed WHERE trace_id = ?", [(t,) for t in trace_ids])
            return int(conn.execute("SELECT COUNT(*) FROM changed").fetchone()[0])

    def attach_truth(self, rows: builtins.list[dict[str, Any]], ground_truth: bool = False) -> None:
        """Training-truth columns for rows another store listed (the truth tables live in this index)."""
        with self._lock:
            truth.attach(self._db(), rows, ground_truth=ground_truth)

    def reward_component_keys(self) -> builtins.list[dict[str, Any]]:
        with self._lock:
            return truth.component_keys(self._db())

    # ---- queries -----------------------------------------------------------------------------
    def list_sql(self, flt: ListFilter, sort: str, descending: bool, nulls: bool) -> tuple[str, list[Any]]:
        """The page query for one segment: rows with the sort key set, or (``nulls``) without it."""
        column = SORTS.get(sort, "start_time")
        where, params = root_where(flt)
        direction = "DESC" if descending else "ASC"
        if column in NOT_NULL:
            order = f"{column} {direction}, rowid {direction}"
        elif nulls:
            where += f" AND {column} IS NULL"
            order = f"rowid {direction}"
        else:
            where += f" AND {column} IS NOT NULL"
            order = f"{column} {direction}, rowid {direction}"
        return f"SELECT {COLUMNS} FROM trajectories WHERE {where} ORDER BY {order} LIMIT ? OFFSET ?", params

    def list(self, flt: ListFilter, *, sort: str = "start", descending: bool = True, limit: int = 50,
             offset: int = 0, previews: bool = True) -> dict[str, Any]:
        """One page, trajectories without the sort key (e.g. not yet scored) last in either order."""
        with self._lock:
            conn = self._db()
            where, params = root_where(flt)
            total = conn.execute(f"SELECT COUNT(*) FROM trajectories WHERE {where}", params).fetchone()[0]
            sql, params = self.list_sql(flt, sort, descending, nulls=False)
            rows = self._rows(conn, sql, [*params, limit, offset])
            if len(rows) < limit and SORTS.get(sort, "start_time") not in NOT_NULL:
                with_key = offset + len(rows) if rows else self._count_with_key(conn, flt, sort)
                sql, params = self.list_sql(flt, sort, descending, nulls=True)
                rows += self._rows(conn, sql, [*params, limit - len(rows), max(0, offset - with_key)])
            if previews:
                search.attach(conn, rows)
            truth.attach(conn, rows)
        return {"total": total, "limit": limit, "offset": offset, "sort": sort,
                "order": "desc" if descending else "asc", "filters": flt.as_dict(), "trajectories": rows}

    def _count_with_key(self, conn: sqlite3.Connection, flt: ListFilter, sort: str) -> int:
        where, params = root_where(flt)
        return conn.execute(f"SELECT COUNT(*) FROM trajectories WHERE {where} AND {SORTS.get(sort, 'start_time')} IS NOT NULL",
                            params).fetchone()[0]

    @staticmethod
    def _rows(conn: sqlite3.Connection, sql: str, params: builtins.list[Any]) -> builtins.list[dict[str, Any]]:
        cursor = conn.execute(sql, params)
        names = [c[0] for c in cursor.description]
        out = []
        for values in cursor.fetchall():
            row = dict(zip(names, values))
            row["validate"] = None if row["validate"] is None else bool(row["validate"])
            row["has_error"] = bool(row["has_error"])
            if "trained" in row:
                row["trained"] = None if row["trained"] is None else bool(row["trained"])
            out.append(row)
        return out

    def step_counts(self, flt: ListFilter) -> dict[str, Any]:
        """Counts over a selection (one step, for /v1/health?step=): errors, scored, kept by rule, the trainer's."""
        where, params = root_where(flt)
        with self._lock:
            conn = self._db()
            n, spans, errors, scored, trained, dropped = conn.execute(
                f"SELECT COUNT(*), COALESCE(SUM(span_count), 0), COALESCE(SUM(has_error), 0), COUNT(reward),"
                f" COALESCE(SUM(trained = 1), 0), COALESCE(SUM(trained = 0), 0) FROM trajectories WHERE {where}",
                params).fetchone()
            kept = dict(conn.execute(f"SELECT kept_because, COUNT(*) FROM trajectories WHERE {where}"
                                     " AND kept_because IS NOT NULL GROUP BY kept_because", params).fetchall())
            filtered = dict(conn.execute(f"SELECT filtered_by, COUNT(*) FROM trajectories WHERE {where}"
                                         " AND filtered_by IS NOT NULL GROUP BY filtered_by", params).fetchall())
            found = self._step_truth(conn, where, params)
        return {"trajectories": n, "spans": spans, "with_error": errors, "scored": scored, "kept_by_rule": kept,
                "trainer": {"trained": trained, "dropped": dropped, "filtered_by": filtered}, **found}

    @staticmethod
    def _step_truth(conn: sqlite3.Connection, where: str, params: builtins.list[Any]) -> dict[str, Any]:
        return {"drift": truth.step_truth(conn, where, params), "fates": truth.step_fates(conn, where, params),
                "trainer_vs_rollout": truth.step_trainer(conn, where, params)}

    def step_truth_counts(self, flt: ListFilter) -> dict[str, Any]:
        """The training-truth part of :meth:`step_counts` (drift, fates, trainer vs rollout): its tables live here."""
        where, params = root_where(flt)
        with self._lock:
            return self._step_truth(self._db(), where, params)

    def summary(self, trace_id: str) -> dict[str, Any] | None:
        with self._lock:
            conn = self._db()
            rows = self._rows(conn, f"SELECT {COLUMNS} FROM trajectories WHERE trace_id = ?", [trace_id])
            truth.attach(conn, rows)
        return rows[0] if rows else None

    def trainer_detail(self, trace_id: str) -> dict[str, Any] | None:
        with self._lock:
            return truth.trainer_detail(self._db(), trace_id)

    def truth_detail(self, trace_id: str) -> dict[str, Any]:
        """The trajectory's drift per compared turn (by span id), reward components and ground truth."""
        with self._lock:
            conn = self._db()
            found = truth.truth_of(conn, [trace_id]).get(trace_id, {})
            return {"turn_drift": truth.drift_of(conn, trace_id),
                    "reward_components": truth.components_of(conn, [trace_id]).get(trace_id, {}),
                    "ground_truth": found.get("ground_truth"), "drift_turns": found.get("drift_turns"),
                    "drift_checked": found.get("drift_checked"), "trainer": truth.trainer_detail(conn, trace_id)}

    def facets(self) -> dict[str, Any]:
        """Experiments (latest first) with their step range and train/validation counts; rules."""
        with self._lock:
            cached = self._cache.get("facets")
            if cached is not None:
                return cached
            conn = self._db()
            experiments: dict[Any, dict[str, Any]] = {}
            for experiment, validate, n, step_min, step_max in conn.execute(
                f"SELECT experiment, validate, COUNT(*), MIN(step), MAX(step) FROM trajectories WHERE {ROOT}"
                " GROUP BY experiment, validate"
            ):
                entry = experiments.setdefault(experiment, {"experiment": experiment, "trajectories": 0, "train": 0,
                                                            "validation": 0, "step_min": None, "step_max": None})
                entry["trajectories"] += n
                entry["validation" if validate else "train"] += n
                for key, value, pick in (("step_min", step_min, min), ("step_max", step_max, max)):
                    if value is not None:
                        entry[key] = value if entry[key] is None else pick(entry[key], value)
            latest = conn.execute(f"SELECT experiment FROM trajectories WHERE {ROOT} AND start_time IS NOT NULL"
                                  " ORDER BY start_time DESC LIMIT 1").fetchone()
            order = sorted(experiments.values(), key=lambda e: (latest is None or e["experiment"] != latest[0], str(e["experiment"])))
            rules = [{"rule": r, "trajectories": n} for r, n in conn.execute(
                f"SELECT kept_because, COUNT(*) FROM trajectories WHERE {ROOT} AND kept_because IS NOT NULL GROUP BY kept_because")]
            trainer = [{"trained": None if t is None else bool(t), "filtered_by": f, "trajectories": n} for t, f, n in conn.execute(
                f"SELECT trained, filtered_by, COUNT(*) FROM trajectories WHERE {ROOT} AND (trained IS NOT NULL"
                " OR filtered_by IS NOT NULL) GROUP BY trained, filtered_by")]
            nodes = [{"node": n, "trajectories": c} for n, c in conn.execute(
                f"SELECT node, COUNT(*) FROM trajectories WHERE {ROOT} AND node IS NOT NULL GROUP BY node ORDER BY node")]
            result = {"experiments": order, "kept_because": rules, "trainer": trainer, "nodes": nodes,
                      "reward_components": truth.component_keys(conn)}
            self._cache["facets"] = result
            return result

    @staticmethod
    def overview_sql(experiment: str | None, validate: bool | None) -> tuple[str, builtins.list[Any]]:
        sql = f"SELECT step, reward, kept_because, trace_id, rowid FROM trajectories WHERE {ROOT} AND experiment IS ?"
        params: list[Any] = [experiment]
        if validate is not None:
            sql += " AND validate = ?"
            params.append(int(validate))
        return sql + " ORDER BY step, reward", params

    def overview(self, experiment: str | None, validate: bool | None = False, bins: int = 12,
                 bounds: tuple[float, float] | None = None) -> dict[str, Any]:
        """Per step: reward distribution (quantiles, histogram), best and worst, kept per rule."""
        key = ("overview", experiment, validate, bins, bounds)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                return cached
            rows = self._db().execute(*self.overview_sql(experiment, validate)).fetchall()
        result = overview_of(rows, experiment, validate, bins, bounds)
        with self._lock:
            self._cache[key] = result
        return result


    def page_after(self, flt: ListFilter, after: int = 0, limit: int = 500) -> builtins.list[dict[str, Any]]:
        """Summaries in index order after the row ``after`` (the previous page's last ``cursor``).

        For walking a whole selection (export) with constant memory: a keyset page, so trajectories
        indexed meanwhile neither shift nor repeat rows. The table is walked by rowid (one pass over
        the summaries for the whole walk), not through a filter index that would re-sort per page.
        """
        where, params = root_where(flt)
        with self._lock:
            conn = self._db()
            rows = self._rows(conn, f"SELECT rowid AS cursor, {COLUMNS} FROM trajectories NOT INDEXED"
                                    f" WHERE {where} AND rowid > ? ORDER BY rowid LIMIT ?", [*params, after, limit])
            truth.attach(conn, rows, ground_truth=True)
            return rows
