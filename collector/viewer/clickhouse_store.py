"""The ClickHouse read store (``TRACECAR_STORE=clickhouse``): one wide row per trajectory, in embedded chDB or on a
ClickHouse server (``TRACECAR_STORE_URL``; the transports: clickhouse_transport.py).

Where one SQLite file stops being the right place to list, group, search and export a whole
job's trajectories (a gateway's tens of millions of spans), the read side moves to ClickHouse
(embedded chDB: ClickHouse's engine in-process, ``pip install 'tracecar[clickhouse]'``), as W&B
Weave's own trace server does. What it stores and how it is fed:

* **One wide row per trajectory** (``SCHEMA``): the promoted, typed columns every filter and sort
  reads (experiment, validate, step, sample index, rollout, worker, reward, kept rule, the
  trainer's values, turns, tokens, errors, times), the first prompt and last response (ZSTD) and
  their folded words, in a ``ReplacingMergeTree(version, deleted)`` ordered by
  ``(experiment, validate, step, trace_id)``: an experiment's steps and a step's groups are
  ranges; a token bloom filter and an ngram bloom filter over the words serve ``q=`` search.
* **Fed from the spool through the trajectory index, with its own cursor.** The SQLite index
  (viewer/index.py) already folds spans into a trajectory's row once (rewards from annotations,
  turns, tokens, previews) by the spool's ``seq``; with ``track_changes`` it also records each
  changed trajectory in ``changed``, in the same transaction. This store drains that table in
  batches of ``TRACECAR_STORE_BATCH_ROWS`` (one ``INSERT`` each, a newer ``version`` replacing
  the older row; a pruned trajectory becomes a ``deleted`` row), then forgets what it inserted.
  Versions count up from the table's highest (not the wall clock, which may step back).
  Nothing is parsed twice, and a restart resumes from what is left in ``changed``; a crash
  between the insert and the forget inserts the same rows again, which the engine collapses. A
  mirror token in both stores tells a ClickHouse table that missed changes (a rebuilt index, a
  run with ``TRACECAR_STORE=sqlite``): it is emptied and filled again.
* **What it answers**: lists (every sort, every filter, ``q=``), counts, facets, overview, a
  step's counts, export's keyset walk. ``attr=`` and the training-truth filters (``drift=``,
  ``where=``, ``fate=``, ``refill=``, ``trained_other=``, ``lp_delta_min=``) read columns the
  mirror takes with each row from the index (viewer/mirror_columns.py: the root's attributes as
  the index keeps them for its own ``attr=``, the truth table's filter columns, the numeric reward
  components); the index's version changed with them, so a table filled before is filled again.
  The truth tables themselves (drift per turn, the trainer's rows) stay in the index: their
  values are attached to the rows this store lists, and a step's truth counts come from there. Spans (a trajectory's tree, its
  tokens) are read from the spool for both stores; with this one, retention moves the trajectories it evicts into
  the same database's ``spans`` table (viewer/clickhouse_spans.py) and readers find them there.
"""

from __future__ import annotations

import builtins  # ClickHouseStore.list shadows the builtin in its class
import contextlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from .. import truth_filter
from ..loudness import RateLimited, describe_error
from ..read_store import StoreStartError, StoreUnavailable
from ..settings import CollectorSettings
from ..text_query import folded_words, query_words
from ..trajectory_filter import TEXT_EQUALS, TrajectoryFilter, sample_index_values
from .clickhouse_transport import Server, Transport, open_transport
from .index import NOT_NULL, SORTS, TrajectoryIndex, overview_of
from .search import previews_of

log = logging.getLogger("tracecar.collector.viewer.clickhouse")

TABLE = "trajectories"  # in the store's database (tracecar, or a server URL's)
META = "meta"
SCHEMA = """
CREATE TABLE IF NOT EXISTS {table} (
    rid Int64,
    trace_id String,
    name Nullable(String),
    experiment Nullable(String),
    validate Nullable(UInt8),
    step Nullable(Int64),
    sample_index_int Nullable(Int64),
    sample_index_str Nullable(String),
    rollout_n Nullable(Int64),
    worker Nullable(String),
    node Nullable(String),
    start_time Nullable(Float64),
    end_time Nullable(Float64),
    duration Nullable(Float64),
    kept_because Nullable(String),
    inclusion_probability Nullable(Float64),
    reward Nullable(Float64),
    span_count Int64,
    has_error UInt8,
    turns Int64,
    tool_calls Int64,
    tool_errors Int64,
    prompt_tokens Nullable(Int64),
    response_tokens Int64,
    advantage Nullable(Float64),
    trained Nullable(UInt8),
    filtered_by Nullable(String),
    policy_version Nullable(Int64),
    trained_on_version Nullable(Int64),
    prompt Nullable(String) CODEC(ZSTD(3)),
    response Nullable(String) CODEC(ZSTD(3)),
    words String CODEC(ZSTD(3)),
    attributes Map(LowCardinality(String), String) CODEC(ZSTD(3)),
    drift_checked Nullable(Int64),
    drift_turns Nullable(Int64),
    fate Nullable(String),
    refill UInt8,
    tt_mismatch Nullable(UInt8),
    lp_max Nullable(Float64),
    reward_components Map(String, Float64),
    version UInt64,
    deleted UInt8,
    INDEX words_tokens words TYPE tokenbf_v1(32768, 3, 0) GRANULARITY 4,
    INDEX words_ngrams words TYPE ngrambf_v1(3, 32768, 3, 0) GRANULARITY 4,
    INDEX trace_ids trace_id TYPE bloom_filter GRANULARITY 4,
    INDEX rid_range rid TYPE minmax GRANULARITY 1,  -- export's keyset walk (rid > cursor): rids grow with the steps
    INDEX reward_range reward TYPE minmax GRANULARITY 4,
    INDEX start_range start_time TYPE minmax GRANULARITY 4,
    INDEX kept_set kept_because TYPE set(64) GRANULARITY 4,
    INDEX attribute_values mapValues(attributes) TYPE bloom_filter GRANULARITY 4
) ENGINE = ReplacingMergeTree(version, deleted)
ORDER BY (experiment, validate, step, trace_id)
SETTINGS allow_nullable_key = 1
"""
# the list's columns, as the SQLite index answers them (index.COLUMNS), from this table's
SELECT = ("trace_id, name, experiment, step, sample_index_int, sample_index_str, rollout_n, validate, worker, node, start_time,"
          " end_time, duration, kept_because, inclusion_probability, reward, span_count, has_error, turns, tool_calls,"
          " tool_errors, prompt_tokens, response_tokens, advantage, trained, filtered_by, policy_version, trained_on_version")
FLOATS = ("start_time", "end_time", "duration", "reward", "advantage", "inclusion_probability")
# columns added since the table's first release: a table made before them gets each (its rows refill with the
# index, whose version changed with them: see _sync_token)
# the root's attributes: keys of a dictionary each (a job has a few dozen names), which halves the bytes an ``attr=``
# filter reads (245 against 110 MiB at 10 M spans; a table of c09d988–10b3ca3 is altered to it at start)
ATTRIBUTES_TYPE = "Map(LowCardinality(String), String)"
ADDED = ("inclusion_probability Nullable(Float64) AFTER kept_because", "node Nullable(String) AFTER worker",
         f"attributes {ATTRIBUTES_TYPE} CODEC(ZSTD(3))", "drift_checked Nullable(Int64)", "drift_turns Nullable(Int64)",
         "fate Nullable(String)", "refill UInt8", "tt_mismatch Nullable(UInt8)", "lp_max Nullable(Float64)",
         "reward_components Map(String, Float64)")
ADDED_INDEXES = ("attribute_values mapValues(attributes) TYPE bloom_filter GRANULARITY 4",)
READ_SETTINGS = " SETTINGS output_format_json_quote_64bit_integers = 0, output_format_json_quote_denormals = 0"
_PARAM_TYPES = {bool: "UInt8", int: "Int64", float: "Float64", str: "String"}


OWNER_FILE = "clickhouse-owner"  #: in the data dir: this collector's id in a server database's meta table


class StoreClaimed(StoreStartError):
    """A ClickHouse server database that another collector's store already uses: refused at start, in one line."""


class ClickHouseUnavailable(StoreUnavailable):
    """The engine refused a query or an insert (a full disk, a damaged part, a server down): every reader
    answers 503, naming this store."""


_CODE = re.compile(r"Code: (\d+)")
_NAME = re.compile(r"\(([A-Z][A-Z0-9_]+)\)\s*(?:\(version [^)]*\))?\s*$", re.MULTILINE)


def unavailable(exc: BaseException, engine: str = "chDB") -> ClickHouseUnavailable:
    """The engine's error as a reader may see it (``Code: 243 ... (NOT_ENOUGH_SPACE)`` → its name and code), and as
    the log should: the line with the code (chDB's first; clickhouse-connect's first names the server, the second the
    code), never what follows it (data paths, rows)."""
    lines = str(exc).splitlines() or [type(exc).__name__]
    first = next((line for line in lines if _CODE.search(line)), lines[0]).strip()[:300]
    code, name = _CODE.search(first), _NAME.search(first)
    what = " ".join(p for p in ((name.group(1) if name else None), (f"code {code.group(1)}" if code else None)) if p)
    return ClickHouseUnavailable("clickhouse", f"the ClickHouse store ({engine}) failed: {what or type(exc).__name__}", first)


def _sort_expr(sort: str, direction: str) -> str:
    column = SORTS.get(sort, "start_time")
    if column == "sample_index":  # SQLite's order of an untyped column: integers, then text (NULLs are their own segment)
        return (f"isNull(sample_index_int) {direction}, sample_index_int {direction}, sample_index_str {direction},"
                f" rid {direction}")
    return f"{column} {direction}, rid {direction}"


def _null_test(sort: str) -> str:
    column = SORTS.get(sort, "start_time")
    return "(sample_index_int IS NULL AND sample_index_str IS NULL)" if column == "sample_index" else f"{column} IS NULL"


class _Params:
    """Named, typed ``{pN:Type}`` placeholders, bound by the engine (a value is never spliced into the SQL);
    the values raw, as each transport passes them (clickhouse_transport.py)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def __call__(self, value: Any) -> str:
        name = f"p{len(self.values)}"
        if type(value) is list:  # an array of strings (trace ids)
            self.values[name] = [str(v) for v in value]
            return "{" + f"{name}:Array(String)" + "}"
        self.values[name] = int(value) if type(value) is bool else value
        kind = _PARAM_TYPES[type(value)]
        return "{" + f"{name}:{kind}" + "}"


def where(flt: TrajectoryFilter, bind: _Params) -> str:
    """The filter over this table, meaning what TrajectoryFilter.where() means over the index's ``trajectories``."""
    clauses = ["deleted = 0"]
    active = flt.active()
    if flt.experiment == "":
        clauses.append("experiment IS NULL")
    elif flt.experiment is not None:
        clauses.append(f"experiment = {bind(flt.experiment)}")
    for name in ("step", "rollout_n", *TEXT_EQUALS):
        if name in active:
            clauses.append(f"{name} = {bind(getattr(flt, name))}")
    if "sample_index" in active:
        assert flt.sample_index is not None
        ors = [f"sample_index_int = {bind(v)}" if type(v) is int else f"sample_index_str = {bind(v)}"
               for v in sample_index_values(flt.sample_index)]
        clauses.append("(" + " OR ".join(ors) + ")")
    for name, column, op in (("step_min", "step", ">="), ("step_max", "step", "<="),
                             ("reward_min", "reward", ">="), ("reward_max", "reward", "<=")):
        value = getattr(flt, name)
        if value is not None:
            clauses.append(f"{column} {op} {bind(float(value) if column == 'reward' else value)}")
    for name in ("validate", "has_error", "trained"):
        value = getattr(flt, name)
        if value is not None:
            clauses.append(f"{name} = {bind(bool(value))}")
    for key, value in flt.attributes or ():  # the root's scalar attribute, as text (viewer/mirror_columns.py)
        name = bind(key)
        clauses.append(f"mapContains(attributes, {name}) AND attributes[{name}] = {bind(value)}")
    clauses.extend(truth_where(flt, bind))
    words = query_words(flt.q) if flt.q else []
    for i, word in enumerate(words):  # every word, the last as a prefix (as FTS5's query in text_query.fts_query)
        if i == len(words) - 1:
            clauses.append(f"position(words, {bind(' ' + word)}) > 0")
        else:
            clauses.append(f"hasToken(words, {bind(word)})")
    return " AND ".join(clauses)


def _fate_is(fate: str, bind: _Params) -> str:
    return f"ifNull(fate, '') = {bind(fate)}"


def truth_where(flt: TrajectoryFilter, bind: _Params) -> builtins.list[str]:
    """The training-truth filters over this table's truth columns, meaning what truth_filter.where_clauses means over
    the index's truth tables (a trajectory without a truth row has NULLs here: no drift, no fate, no comparison)."""
    clauses = []
    if flt.trained_other is not None:
        clauses.append(f"tt_mismatch = {bind(bool(flt.trained_other))}")
    if flt.lp_delta_min is not None:
        clauses.append(f"lp_max >= {bind(float(flt.lp_delta_min))}")
    if flt.fate:
        evicted = _fate_is("evicted", bind)
        compared = "tt_mismatch IS NOT NULL"  # a trainer row was compared: it was trained on
        if flt.fate == "evicted":
            clauses.append(evicted)
        elif flt.fate == "trained":
            clauses.append(f"(ifNull(trained, 0) = 1 OR {_fate_is('trained', bind)} OR {compared}) AND NOT {evicted}")
        elif flt.fate == "filtered":
            clauses.append(f"(ifNull(trained, 1) = 0 OR {_fate_is('filtered', bind)}) AND NOT (ifNull(trained, 0) = 1"
                           f" OR {_fate_is('trained', bind)} OR {compared}) AND NOT {evicted}")
        else:  # not_reached
            clauses.append(f"trained IS NULL AND fate IS NULL AND NOT {compared}")
    if flt.refill is not None:
        clauses.append(f"refill = {bind(bool(flt.refill))}")
    if flt.drift is True:
        clauses.append("drift_turns > 0")
    elif flt.drift is False:
        clauses.append("drift_checked > 0 AND drift_turns = 0")
    for key, op, value in truth_filter.parse_where(flt.reward_where) if flt.reward_where else ():
        name = bind(key)
        clauses.append(f"mapContains(reward_components, {name}) AND reward_components[{name}] {op} {bind(value)}")
    return clauses


def _row_out(row: dict[str, Any]) -> dict[str, Any]:
    """A row as the SQLite index answers it (its types: bools, floats, the untyped sample index)."""
    si_int, si_str = row.pop("sample_index_int"), row.pop("sample_index_str")
    out: dict[str, Any] = {}
    for key in ("trace_id", "name", "experiment", "step"):
        out[key] = row[key]
    out["sample_index"] = si_int if si_int is not None else si_str
    for key, value in row.items():
        if key in out:
            continue
        if key in FLOATS and value is not None:
            value = float(value)
        elif key in ("validate", "trained"):
            value = None if value is None else bool(value)
        elif key == "has_error":
            value = bool(value)
        out[key] = value
    return out


class ClickHouseStore:
    """A :class:`~tracecar.collector.read_store.ReadStore` on ClickHouse (embedded chDB, or a server), fed from the
    trajectory index's changes."""

    def __init__(self, index: TrajectoryIndex, settings: CollectorSettings, path: Path | None = None,
                 on_error: Callable[[], None] = lambda: None) -> None:
        index.track_changes = True
        self.index = index
        self.batch_rows = settings.store_batch_rows
        self._on_error = on_error  # tracecar_store_errors_total{store="clickhouse"}
        self._engine: Transport = open_transport(settings, path)
        self.table: str = f"{self._engine.database}.{TABLE}"
        self.meta: str = f"{self._engine.database}.{META}"
        self._lock = threading.RLock()  # one drain at a time; queries run beside it (chDB sessions and the server client are thread-safe)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pending = 0
        self._synced = False
        self._version = 0  # the last row version inserted; from the table's own max at the first drain (_sync_token)
        self._cache: dict[Any, Any] = {}  # facets and overviews until the next insert, as the index caches them
        self._catch_up_failures = RateLimited()
        self._owner: str | None = None  # a server database's claim (this collector's id), checked again before a wipe
        try:
            self._run(f"CREATE DATABASE IF NOT EXISTS {self._engine.database}")
            self._run(f"CREATE TABLE IF NOT EXISTS {self.meta} (key String, value String, at DateTime64(6) DEFAULT now64(6))"
                      " ENGINE = ReplacingMergeTree(at) ORDER BY key")
            if isinstance(self._engine, Server):  # before any change to the table: it may be another collector's
                self._claim(Path(settings.data_dir))
            self._run(SCHEMA.format(table=self.table))
            for column in ADDED:
                self._run(f"ALTER TABLE {self.table} ADD COLUMN IF NOT EXISTS {column}")
            for skip_index in ADDED_INDEXES:
                self._run(f"ALTER TABLE {self.table} ADD INDEX IF NOT EXISTS {skip_index}")
            self._retype_attributes()
        except ClickHouseUnavailable as exc:  # e.g. a user that may not create tables, a full disk: one line at start
            self._engine.close()
            raise StoreStartError(f"{exc.public} while creating its tables: {exc}") from None
        except StoreStartError:
            self._engine.close()
            raise

    def _retype_attributes(self) -> None:
        """A table whose attributes' keys are plain strings gets dictionary keys: a mutation left to run in the
        background (``alter_sync = 0``: the start does not wait; reads go on, each part converted as it is read
        until rewritten). Best effort: both types answer the same, so a server that refuses it (before about
        25.11 ClickHouse forbids altering a column a skip index reads; a user without ALTER MODIFY) keeps the
        plain keys, and says so once."""
        database, table = self.table.split(".", 1)
        bind = _Params()
        found = self._select(f"SELECT type FROM system.columns WHERE database = {bind(database)} AND table = {bind(table)}"
                             " AND name = 'attributes'", bind)
        if not found or found[0]["type"] == ATTRIBUTES_TYPE:
            return
        try:
            self._run(f"ALTER TABLE {self.table} MODIFY COLUMN attributes {ATTRIBUTES_TYPE} CODEC(ZSTD(3))"
                      " SETTINGS alter_sync = 0")
        except ClickHouseUnavailable as exc:
            log.warning("clickhouse store: the attributes' keys stay plain strings (attr= reads more bytes): %s", exc.public,
                        extra={"event": "clickhouse_store_retype_skipped"})

    def _claim(self, data_dir: Path) -> None:
        """One collector per server database: the mirror (``_sync_token``) empties a table whose token is not its
        own, so a second collector on the same database would wipe the first one's rows, and each would refill
        in turn. The first collector to use a database writes its id (kept in its data dir) into the meta
        table; another one refuses to start (:class:`StoreClaimed`)."""
        id_file = data_dir / OWNER_FILE
        mine = id_file.read_text().strip() if id_file.exists() else ""
        if not mine:
            mine = uuid.uuid4().hex
            data_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(mine + "\n")
        if self._claimant() is None:
            self._run(f"INSERT INTO {self.meta} (key, value) VALUES ('owner', {{o:String}})", {"o": mine})
        self._owner = mine
        self._check_claim()  # two collectors claiming at once: the later row wins, the other one stops here

    def _claimant(self) -> str | None:
        found = self._select(f"SELECT value FROM {self.meta} FINAL WHERE key = 'owner'")
        return found[0]["value"] if found else None

    def _check_claim(self) -> None:
        """Refuses (StoreClaimed) when the server database is claimed by another collector."""
        if self._owner is not None and self._claimant() != self._owner:
            raise StoreClaimed(f"TRACECAR_STORE_URL: database {self._engine.database!r} on the ClickHouse server is "
                               "another collector's (give each collector its own database: clickhouse://…/NAME; a claim "
                               "whose collector lost its data dir is released with "
                               f"ALTER TABLE {self.meta} DELETE WHERE key = 'owner')")

    # ---- the engine ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _statement(self) -> Iterator[None]:
        """Any engine error (chDB and clickhouse-connect raise their own for any failed statement) counted and
        turned into ClickHouseUnavailable: a 503 for readers."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - every engine error is the store unavailable
            self._on_error()
            raise unavailable(exc, self._engine.describe) from None

    def _run(self, sql: str, params: dict[str, Any] | None = None) -> None:
        with self._statement():
            self._engine.execute(sql, params)

    def _select(self, sql: str, bind: _Params | None = None) -> builtins.list[dict[str, Any]]:
        with self._statement():
            data = self._engine.select(sql + READ_SETTINGS, bind.values if bind else {})
        return [orjson.loads(line) for line in data.splitlines() if line]

    def _insert(self, rows: builtins.list[dict[str, Any]]) -> None:
        if rows:
            with self._statement():
                self._engine.insert(self.table, b"\n".join(orjson.dumps(r) for r in rows))

    # ---- for the span archive (viewer/clickhouse_spans.py): its own table, the same engine and error handling --
    @property
    def database(self) -> str:
        return self._engine.database

    @property
    def engine_name(self) -> str:
        return self._engine.describe

    def run(self, sql: str, params: dict[str, Any] | None = None) -> None:
        self._run(sql, params)

    def select(self, sql: str, bind: _Params | None = None) -> builtins.list[dict[str, Any]]:
        return self._select(sql, bind)

    def insert_into(self, table: str, lines: builtins.list[bytes]) -> None:
        """``JSONEachRow`` lines into another table of this store's database, one insert."""
        if lines:
            with self._statement():
                self._engine.insert(table, b"\n".join(lines))

    # ---- catching up ---------------------------------------------------------------------------
    def _sync_token(self) -> None:
        """Starts the table again when it missed changes (the index was rebuilt, or ran without tracking)."""
        if self._synced:
            return
        found = self._select(f"SELECT value FROM {self.meta} FINAL WHERE key = 'mirror'")
        mine = found[0]["value"] if found else None
        if mine is None or mine != self.index.mirror_token():
            token = uuid.uuid4().hex
            try:
                self._check_claim()  # never empty another collector's table
            except StoreClaimed as exc:  # claimed since this collector started: its readers get a 503 saying so
                self._on_error()
                raise ClickHouseUnavailable("clickhouse", "the ClickHouse store (server) failed: its database is another "
                                            "collector's", str(exc)) from None
            self._run(f"TRUNCATE TABLE {self.table}")
            self.index.restart_mirror(token)
            self._run(f"INSERT INTO {self.meta} (key, value) VALUES ('mirror', {{t:String}})", {"t": token})
            log.info("clickhouse store filled again from the trajectory index", extra={"event": "clickhouse_store_resync"})
        # row versions count up from the highest the table holds: monotonic whatever the wall clock does, and
        # restart-safe (the table remembers it), so a newer row always replaces an older one
        self._version = int(self._select(f"SELECT max(version) AS v FROM {self.table}")[0]["v"] or 0)
        self._synced = True

    def _drain(self, deadline: float) -> bool:
        """Inserts changed trajectories in batches until none is left (True) or past ``deadline`` (False)."""
        with self._lock:
            self._sync_token()
            while True:
                rows, gone = self.index.changed_rows(self.batch_rows)
                if not rows and not gone:
                    self._pending = 0
                    return True
                self._version += 1
                version = self._version
                batch = []
                for row in rows:
                    value = row.pop("sample_index")
                    row["sample_index_int"] = value if type(value) is int else None
                    row["sample_index_str"] = None if value is None or type(value) is int else str(value)
                    row["words"] = " " + " ".join(folded_words(row["prompt"]) + folded_words(row["response"])) + " "
                    row["version"], row["deleted"] = version, 0
                    batch.append(row)
                if gone:  # a deleted row must carry the sorting key of the row it replaces
                    bind = _Params()
                    batch += [{**old, "version": version, "deleted": 1} for old in self._select(
                        f"SELECT rid, trace_id, experiment, validate, step FROM {self.table} FINAL"
                        f" WHERE trace_id IN {bind(gone)}", bind)]
                self._insert(batch)
                self._cache.clear()
                self._pending = self.index.forget_changed([r["trace_id"] for r in rows] + gone)
                if self._pending == 0:
                    return True
                if time.monotonic() >= deadline:
                    return False

    def refresh(self, budget_s: float = 0.3, *, all_held: bool = False) -> bool:
        deadline = time.monotonic() + budget_s
        # no change may land between a batch's read and its forget (it would be forgotten unsent): one drain at a
        # time. A reader waits for a drain in progress (a slow server's) no longer than its budget: then it reads
        # what the table has, said not caught up
        if not self._lock.acquire(timeout=budget_s):
            return False
        try:
            fresh = self.index.refresh(budget_s=budget_s, all_held=all_held)
            return self._drain(deadline) and fresh
        finally:
            self._lock.release()

    def catching_up(self) -> bool:
        thread = self._thread
        return self.index.catching_up() or (thread is not None and thread.is_alive())

    def catch_up_in_background(self) -> None:
        with self._lock:
            if self._closed or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self._catch_up, name="tracecar-clickhouse-store", daemon=True)
            self._thread.start()

    def _catch_up(self) -> None:
        try:
            while not self._closed and not self.refresh(0.1):
                time.sleep(0.005)
        except Exception as exc:  # noqa: BLE001 - a failed catch-up is retried by the next request
            # each read may start a catch-up: while chDB keeps failing, said once a minute with the count
            count = self._catch_up_failures.hit()
            if count is not None:
                log.warning("clickhouse store catch-up failed (%d time(s) since last said; retried by the next read): %s",
                            count, describe_error(exc))

    def listed_through(self) -> int:
        return self.index.listed_through()  # a row folded there is inserted here from the index's durable cursor

    def status(self) -> dict[str, Any]:
        state = self.index.status()
        return {**state, "caught_up": state["caught_up"] and self._pending == 0, "store": "clickhouse",
                "store_pending": self._pending}

    def close(self) -> None:
        self._closed = True
        thread = self._thread
        if thread is not None:
            thread.join(timeout=10)
        self.index.close()
        with self._lock:
            self._engine.close()

    # ---- queries ---------------------------------------------------------------------------------
    def _page(self, flt: TrajectoryFilter, sort: str, descending: bool, nulls: bool, limit: int, offset: int,
              extra: str = "") -> builtins.list[dict[str, Any]]:
        bind = _Params()
        clause = where(flt, bind)
        direction = "DESC" if descending else "ASC"
        column = SORTS.get(sort, "start_time")
        if column in NOT_NULL:
            order = _sort_expr(sort, direction)
        elif nulls:
            clause += f" AND {_null_test(sort)}"
            order = f"rid {direction}"
        else:
            clause += f" AND NOT {_null_test(sort)}"
            order = _sort_expr(sort, direction)
        return self._select(f"SELECT {SELECT}{extra} FROM {self.table} FINAL WHERE {clause} ORDER BY {order}"
                            f" LIMIT {int(limit)} OFFSET {int(offset)}", bind)

    def _count(self, flt: TrajectoryFilter, extra: str = "") -> int:
        bind = _Params()
        return int(self._select(f"SELECT count() AS n FROM {self.table} FINAL WHERE {where(flt, bind)}{extra}", bind)[0]["n"])

    def list(self, flt: TrajectoryFilter, *, sort: str = "start", descending: bool = True, limit: int = 50,
             offset: int = 0, previews: bool = True) -> dict[str, Any]:
        texts = ", prompt, response" if previews else ""
        total = self._count(flt)
        raw = self._page(flt, sort, descending, False, limit, offset, texts)
        if len(raw) < limit and SORTS.get(sort, "start_time") not in NOT_NULL:
            with_key = offset + len(raw) if raw else self._count(flt, f" AND NOT {_null_test(sort)}")
            raw += self._page(flt, sort, descending, True, limit - len(raw), max(0, offset - with_key), texts)
        rows = []
        for row in raw:
            prompt, response = row.pop("prompt", None), row.pop("response", None)
            out = _row_out(row)
            if previews:
                out.update(previews_of(prompt, response))
            rows.append(out)
        self.index.attach_truth(rows)
        return {"total": total, "limit": limit, "offset": offset, "sort": sort,
                "order": "desc" if descending else "asc", "filters": flt.as_dict(), "trajectories": rows}

    def step_counts(self, flt: TrajectoryFilter) -> dict[str, Any]:
        bind = _Params()
        clause = where(flt, bind)
        head = self._select(f"SELECT count() AS n_, sum(span_count) AS spans_, sum(has_error) AS errors_, count(reward) AS scored_,"
                            f" countIf(trained = 1) AS trained_, countIf(trained = 0) AS dropped_ FROM {self.table} FINAL"
                            f" WHERE {clause}", bind)[0]
        kept = {r["k"]: r["n"] for r in self._select(f"SELECT kept_because AS k, count() AS n FROM {self.table} FINAL WHERE {clause}"
                                                     " AND kept_because IS NOT NULL GROUP BY k", bind)}
        filtered = {r["k"]: r["n"] for r in self._select(f"SELECT filtered_by AS k, count() AS n FROM {self.table} FINAL WHERE"
                                                         f" {clause} AND filtered_by IS NOT NULL GROUP BY k", bind)}
        return {"trajectories": head["n_"], "spans": head["spans_"], "with_error": head["errors_"], "scored": head["scored_"],
                "kept_by_rule": kept, "trainer": {"trained": head["trained_"], "dropped": head["dropped_"], "filtered_by": filtered},
                **self.index.step_truth_counts(flt)}

    def summary(self, trace_id: str) -> dict[str, Any] | None:
        bind = _Params()
        found = self._select(f"SELECT {SELECT} FROM {self.table} FINAL WHERE trace_id = {bind(trace_id)} AND deleted = 0", bind)
        if not found:  # a trajectory whose root has not arrived lives in the index only (as a running one)
            return self.index.summary(trace_id)
        rows = [_row_out(found[0])]
        self.index.attach_truth(rows)
        return rows[0]

    def trainer_detail(self, trace_id: str) -> dict[str, Any] | None:
        return self.index.trainer_detail(trace_id)

    def truth_detail(self, trace_id: str) -> dict[str, Any]:
        return self.index.truth_detail(trace_id)

    def facets(self) -> dict[str, Any]:
        cached = self._cache.get("facets")
        if cached is not None:
            return cached
        experiments: dict[Any, dict[str, Any]] = {}
        for r in self._select(f"SELECT experiment, validate, count() AS n, min(step) AS lo, max(step) AS hi FROM {self.table} FINAL"
                              " WHERE deleted = 0 GROUP BY experiment, validate"):
            entry = experiments.setdefault(r["experiment"], {"experiment": r["experiment"], "trajectories": 0, "train": 0,
                                                             "validation": 0, "step_min": None, "step_max": None})
            entry["trajectories"] += r["n"]
            entry["validation" if r["validate"] else "train"] += r["n"]
            for key, value, pick in (("step_min", r["lo"], min), ("step_max", r["hi"], max)):
                if value is not None:
                    entry[key] = value if entry[key] is None else pick(entry[key], value)
        latest = self._select(f"SELECT experiment FROM {self.table} FINAL WHERE deleted = 0 AND start_time IS NOT NULL"
                              " ORDER BY start_time DESC, rid DESC LIMIT 1")
        order = sorted(experiments.values(),
                       key=lambda e: (not latest or e["experiment"] != latest[0]["experiment"], str(e["experiment"])))
        rules = [{"rule": r["k"], "trajectories": r["n"]} for r in self._select(
            f"SELECT kept_because AS k, count() AS n FROM {self.table} FINAL WHERE deleted = 0 AND kept_because IS NOT NULL"
            " GROUP BY k ORDER BY k")]
        trainer = [{"trained": None if r["t"] is None else bool(r["t"]), "filtered_by": r["f"], "trajectories": r["n"]}
                   for r in self._select(f"SELECT trained AS t, filtered_by AS f, count() AS n FROM {self.table} FINAL WHERE"
                                         " deleted = 0 AND (trained IS NOT NULL OR filtered_by IS NOT NULL) GROUP BY t, f"
                                         " ORDER BY t NULLS FIRST, f NULLS FIRST")]
        nodes = [{"node": r["k"], "trajectories": r["n"]} for r in self._select(
            f"SELECT node AS k, count() AS n FROM {self.table} FINAL WHERE deleted = 0 AND node IS NOT NULL GROUP BY k ORDER BY k")]
        result = {"experiments": order, "kept_because": rules, "trainer": trainer, "nodes": nodes,
                  "reward_components": self.index.reward_component_keys()}
        self._cache["facets"] = result
        return result

    def overview(self, experiment: str | None, validate: bool | None = False, bins: int = 12,
                 bounds: tuple[float, float] | None = None) -> dict[str, Any]:
        key = ("overview", experiment, validate, bins, bounds)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        bind = _Params()
        clause = "deleted = 0 AND " + ("experiment IS NULL" if experiment is None else f"experiment = {bind(experiment)}")
        if validate is not None:
            clause += f" AND validate = {bind(validate)}"
        found = self._select(f"SELECT step, reward, kept_because, trace_id, rid FROM {self.table} FINAL WHERE {clause}"
                             " ORDER BY step NULLS FIRST, reward NULLS FIRST, kept_because NULLS FIRST, trace_id", bind)
        rows = [(r["step"], None if r["reward"] is None else float(r["reward"]), r["kept_because"], r["trace_id"], r["rid"])
                for r in found]
        result = overview_of(rows, experiment, validate, bins, bounds)
        self._cache[key] = result
        return result

    def page_after(self, flt: TrajectoryFilter, after: int = 0, limit: int = 500) -> builtins.list[dict[str, Any]]:
        bind = _Params()
        clause = where(flt, bind)
        found = self._select(f"SELECT rid AS cursor, {SELECT} FROM {self.table} FINAL WHERE {clause} AND rid > {bind(int(after))}"
                             f" ORDER BY rid LIMIT {int(limit)}", bind)
        rows = []
        for row in found:
            cursor = row.pop("cursor")
            rows.append({"cursor": cursor, **_row_out(row)})
        self.index.attach_truth(rows, ground_truth=True)
        return rows
