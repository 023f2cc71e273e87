"""Training truth in the trajectory index: drift between turns, and why this reward.

Two questions a trace backend does not answer (issue 29), kept beside the trajectory index
(viewer/index.py) in tables of their own, filled while it catches up (never on the ingest
path) from payloads it parses anyway:

* **Drift, per turn.** Each LLM call whose ``inputs.prompt_ids`` the store holds (every wire
  version stores the full list: prompt deltas are rebuilt at ingest) is compared with the
  previous call of its trajectory: does its prompt start with that call's prompt + response?
  ``turn_drift`` keeps one row per compared turn (where it parts, how many ids differ, the
  ids on both sides of the cut, decoded on read); ``truth`` keeps per trajectory how many turns
  were compared and how many drifted, for the list's filter and column and per-step health.
  Cost: one C list compare per turn (a few µs per thousand ids); a drifting turn also pays
  for locating the cut and counting (processors/drift.py). The previous turn's ids come from
  a bounded in-memory map of recent turns, else one stored payload re-read.
* **Why this reward.** The reward's components (VERL's ``reward_extra_info``: ``acc``,
  ``format``, ``score``, ...) and the ground truth, from annotations (the trainer hook sends
  them; a worker's ``annotate(traj, acc=1, format=0)`` too): ``reward_components`` keeps the
  latest value of each component per trajectory, indexed by (key, value) for ``where=acc=0``.
"""

from __future__ import annotations

import base64
import math
import re
import sqlite3
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from ..processors.drift import compare
from ..processors.token_arrays import TokenArrays
from ..processors.trainer_compare import HIST_BINS, TrainerTokens, Turn, compare_trainer, hist_quantile
from ..shape import RESPONSE_ID_KEYS, dict_or_empty, int_list
from ..spool.full_payloads import conn_loader, full_spans

SCHEMA = """
CREATE TABLE IF NOT EXISTS truth (
    trace_id TEXT PRIMARY KEY,
    drift_checked INTEGER,  -- turns compared with the turn before them
    drift_turns INTEGER,  -- of which did not extend it exactly
    ground_truth TEXT,
    fate TEXT,  -- the latest note: trained, filtered, evicted (none: never reached the trainer, or no hook)
    fate_reason TEXT,  -- filtered / evicted by what: dynamic_sampling, stale, filter, failure, ...
    refill_of TEXT,  -- the evicted group this one replaces
    min_global_steps INTEGER,  -- the policy versions that generated it (VERL v1 async extra_fields)
    max_global_steps INTEGER,
    evicted_at_step INTEGER,
    -- what the trainer trained on vs what the rollout generated (processors/trainer_compare.py)
    tt_ids_equal INTEGER, tt_first_diff INTEGER, tt_ids_differing INTEGER, tt_mask_extra INTEGER,
    tt_mask_missing INTEGER, tt_absent INTEGER, tt_mismatch INTEGER,
    lp_compared INTEGER, lp_mean REAL, lp_p99 REAL, lp_max REAL
);
CREATE INDEX IF NOT EXISTS truth_mismatch ON truth(tt_mismatch) WHERE tt_mismatch = 1;
CREATE INDEX IF NOT EXISTS truth_lp_max ON truth(lp_max) WHERE lp_max IS NOT NULL;
CREATE TABLE IF NOT EXISTS trainer_rows (
    trace_id TEXT PRIMARY KEY,
    seq INTEGER,
    tokens BLOB,  -- the annotation's output.trainer_tokens (JSON of base64 arrays)
    result BLOB  -- the comparison's per-token part: JSON {hist, trainer_lp (base64 f32 per generated token), was, now}
);
CREATE INDEX IF NOT EXISTS truth_drift ON truth(drift_turns);
CREATE INDEX IF NOT EXISTS truth_fate ON truth(fate);
CREATE INDEX IF NOT EXISTS truth_refill ON truth(refill_of) WHERE refill_of IS NOT NULL;
CREATE TABLE IF NOT EXISTS truth_turns (
    span_id TEXT PRIMARY KEY,
    trace_id TEXT NOT NULL,
    start_time REAL,
    seq INTEGER
);
CREATE INDEX IF NOT EXISTS truth_turns_trace ON truth_turns(trace_id, start_time);
CREATE TABLE IF NOT EXISTS turn_drift (
    span_id TEXT PRIMARY KEY,
    trace_id TEXT NOT NULL,
    prev_span_id TEXT,
    extends INTEGER NOT NULL,
    detail BLOB  -- processors.drift.Drift.as_dict(), JSON; NULL when it extends
);
CREATE INDEX IF NOT EXISTS turn_drift_trace ON turn_drift(trace_id);
CREATE TABLE IF NOT EXISTS reward_components (
    trace_id TEXT NOT NULL,
    key TEXT NOT NULL,
    value REAL,  -- numbers and booleans (true = 1)
    text TEXT,  -- anything else, as text (shown, not filtered)
    seq INTEGER,
    PRIMARY KEY (trace_id, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS reward_components_kv ON reward_components(key, value);
"""
DROP = ("DROP TABLE IF EXISTS truth; DROP TABLE IF EXISTS truth_turns; DROP TABLE IF EXISTS turn_drift;"
        " DROP TABLE IF EXISTS reward_components; DROP TABLE IF EXISTS trainer_rows;")
TABLES = ("truth", "truth_turns", "turn_drift", "reward_components", "trainer_rows")
TT_COLUMNS = ("tt_ids_equal", "tt_first_diff", "tt_ids_differing", "tt_mask_extra", "tt_mask_missing", "tt_absent",
              "tt_mismatch", "lp_compared", "lp_mean", "lp_p99", "lp_max")

# annotation keys that are not reward components (what the trainer did, ids, the reward itself)
RESERVED = frozenset({"reward", "advantage", "trained", "filtered_by", "policy_version", "trained_on_version",
                      "reward_extra_info", "ground_truth", "data_source", "min_global_steps", "max_global_steps",
                      "fate", "fate_reason", "refill_of", "staleness", "trainer_tokens"})
MAX_COMPONENTS = 64  # per annotation: more are ignored (the panel is for reading, not a dump)
MAX_TEXT = 200  # a component's text value, stored
MAX_GROUND_TRUTH = 2000
RECENT_IDS = 2_000_000  # ids of recent turns kept in memory, so the next turn's comparison reads no payload

KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]{0,63}$")


# ---- reward components ----------------------------------------------------------------------------
def _plain(value: Any) -> tuple[float | None, str | None] | None:
    """A component's (number, text); None for what is not one (nested objects and lists)."""
    if type(value) is bool:
        return float(value), None
    if type(value) in (int, float):
        number = float(value)
        return (number, None) if number == number and abs(number) != float("inf") else (None, str(value))
    if isinstance(value, str):
        return None, value[:MAX_TEXT]
    return None


FATE_KEYS = ("fate", "fate_reason", "refill_of", "min_global_steps", "max_global_steps", "evicted_at_step")
_FATE_TYPES = {"fate": str, "fate_reason": str, "refill_of": str, "min_global_steps": int, "max_global_steps": int,
               "evicted_at_step": int}


def fate_notes(attrs: dict[str, Any]) -> dict[str, Any]:
    """What an annotation says became of the trajectory (validated at ingest: types only checked here)."""
    return {k: attrs[k] for k in FATE_KEYS if type(attrs.get(k)) is _FATE_TYPES[k]}


def annotation_notes(payload: bytes | None) -> tuple[dict[str, tuple[float | None, str | None]], str | None]:
    """An annotation's reward components and ground truth (parsed only when it may carry some)."""
    attrs = _attributes(payload)
    if not attrs:
        return {}, None
    return _components(attrs), _ground_truth(attrs)


def _attributes(payload: bytes | None) -> dict[str, Any]:
    if not payload:
        return {}
    try:
        return dict_or_empty(dict_or_empty(orjson.loads(payload)).get("attributes"))
    except orjson.JSONDecodeError:
        return {}


def trainer_rows(notes: Iterable[tuple[str, int, bytes | None]]) -> Iterable[tuple[str, int, bytes]]:
    """The annotations that carry the trainer's batch row (``output.trainer_tokens``), as stored JSON."""
    for trace_id, seq, payload in notes:
        if not payload or b'"trainer_tokens"' not in payload:
            continue
        try:
            tokens = dict_or_empty(dict_or_empty(orjson.loads(payload)).get("output")).get("trainer_tokens")
        except orjson.JSONDecodeError:
            continue
        if isinstance(tokens, dict):
            yield trace_id, seq, orjson.dumps(tokens)


def _components(attrs: dict[str, Any]) -> dict[str, tuple[float | None, str | None]]:
    components: dict[str, tuple[float | None, str | None]] = {}
    extra = attrs.get("reward_extra_info")
    sources: list[Iterable[tuple[Any, Any]]] = [extra.items()] if isinstance(extra, dict) else []
    sources.append([(k, v) for k, v in attrs.items() if k not in RESERVED])
    for items in sources:
        for key, value in items:
            if len(components) >= MAX_COMPONENTS:
                break
            if not isinstance(key, str) or not KEY.match(key) or key in components or key == "reward":
                continue
            plain = _plain(value)
            if plain is not None:
                components[key] = plain
    return components


def _ground_truth(attrs: dict[str, Any]) -> str | None:
    truth = attrs.get("ground_truth")
    if truth is not None and not isinstance(truth, str):
        truth = orjson.dumps(truth, option=orjson.OPT_NON_STR_KEYS).decode() if isinstance(truth, (dict, list, int, float)) else str(truth)
    return truth[:MAX_GROUND_TRUTH] if isinstance(truth, str) else None


def note_annotations(conn: sqlite3.Connection, notes: Iterable[tuple[str, int, bytes | None]]) -> None:
    """Folds annotations (trace_id, seq, payload) into the components: the latest seq of each key wins."""
    rows: list[tuple[Any, ...]] = []
    truths: list[tuple[str, str]] = []
    fates: list[tuple[Any, ...]] = []
    for trace_id, seq, payload in notes:
        attrs = _attributes(payload)
        if not attrs:
            continue
        rows.extend((trace_id, key, number, text, seq) for key, (number, text) in _components(attrs).items())
        ground_truth = _ground_truth(attrs)
        if ground_truth is not None:
            truths.append((trace_id, ground_truth))
        fate = fate_notes(attrs)
        if fate:
            fates.append((trace_id, *(fate.get(k) for k in FATE_KEYS)))
    conn.executemany("INSERT INTO trainer_rows (trace_id, seq, tokens) VALUES (?, ?, ?) ON CONFLICT(trace_id) DO UPDATE"
                     " SET seq = excluded.seq, tokens = excluded.tokens, result = NULL WHERE excluded.seq >= trainer_rows.seq",
                     [(t, seq, tokens) for t, seq, tokens in trainer_rows(notes)])
    conn.executemany("INSERT INTO reward_components (trace_id, key, value, text, seq) VALUES (?,?,?,?,?)"
                     " ON CONFLICT(trace_id, key) DO UPDATE SET value = excluded.value, text = excluded.text, seq = excluded.seq"
                     " WHERE excluded.seq >= reward_components.seq", rows)
    conn.executemany("INSERT INTO truth (trace_id, ground_truth) VALUES (?, ?)"
                     " ON CONFLICT(trace_id) DO UPDATE SET ground_truth = excluded.ground_truth", truths)
    # notes come in seq order: a later value of each key wins, an absent one keeps the earlier
    conn.executemany(f"INSERT INTO truth (trace_id, {', '.join(FATE_KEYS)}) VALUES (?{', ?' * len(FATE_KEYS)})"
                     " ON CONFLICT(trace_id) DO UPDATE SET "
                     + ", ".join(f"{k} = COALESCE(excluded.{k}, {k})" for k in FATE_KEYS), fates)


def components_of(conn: sqlite3.Connection, trace_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Per trajectory, its components (number, else text)."""
    out: dict[str, dict[str, Any]] = {}
    for i in range(0, len(trace_ids), 500):
        chunk = trace_ids[i:i + 500]
        for trace_id, key, value, text in conn.execute(
                f"SELECT trace_id, key, value, text FROM reward_components WHERE trace_id IN ({','.join('?' * len(chunk))})"
                " ORDER BY trace_id, key", chunk):
            out.setdefault(trace_id, {})[key] = value if value is not None else text
    return out


def component_keys(conn: sqlite3.Connection, limit: int = 32) -> list[dict[str, Any]]:
    """The numeric components known (for the list's optional columns), most common first."""
    return [{"key": k, "trajectories": n, "min": lo, "max": hi} for k, n, lo, hi in conn.execute(
        "SELECT key, COUNT(*), MIN(value), MAX(value) FROM reward_components WHERE value IS NOT NULL"
        " GROUP BY key ORDER BY COUNT(*) DESC, key LIMIT ?", (limit,))]


# ---- drift ----------------------------------------------------------------------------------------
def turn_ids(span: dict[str, Any]) -> tuple[list[int], list[int]] | None:
    """(prompt ids, response ids) of an LLM call that sent its prompt's ids, else None."""
    prompt = int_list(dict_or_empty(span.get("inputs")).get("prompt_ids"))
    if prompt is None:
        return None
    output = dict_or_empty(span.get("output"))
    response = next((ids for ids in (int_list(output.get(k)) for k in RESPONSE_ID_KEYS) if ids is not None), None)
    return prompt, response or []


class RecentTurns:
    """Ids of recently indexed turns (span_id -> (prompt, response)), bounded by ``max_ids``."""

    def __init__(self, max_ids: int = RECENT_IDS) -> None:
        self.max_ids = max_ids
        self._ids = 0
        self._turns: OrderedDict[str, tuple[list[int], list[int]]] = OrderedDict()

    def put(self, span_id: str, ids: tuple[list[int], list[int]]) -> None:
        old = self._turns.pop(span_id, None)
        if old is not None:
            self._ids -= len(old[0]) + len(old[1])
        self._turns[span_id] = ids
        self._ids += len(ids[0]) + len(ids[1])
        while self._ids > self.max_ids and self._turns:
            _, gone = self._turns.popitem(last=False)
            self._ids -= len(gone[0]) + len(gone[1])

    def get(self, span_id: str) -> tuple[list[int], list[int]] | None:
        return self._turns.get(span_id)

    def clear(self) -> None:
        self._turns.clear()
        self._ids = 0


def _stored_turn(conn: sqlite3.Connection, seq: int | None) -> tuple[list[int], list[int]] | None:
    if seq is None:
        return None
    row = conn.execute("SELECT payload FROM spool.spans WHERE seq = ? AND state != 3", (seq,)).fetchone()
    if row is None or not row[0]:
        return None
    try:
        span = orjson.loads(row[0])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(span, dict):
        return None
    full_spans([span], conn_loader(conn))  # stored prompt references, rebuilt
    return turn_ids(span)


def note_turns(conn: sqlite3.Connection, turns: list[tuple[int, str, str, Any, tuple[list[int], list[int]]]],
               recent: RecentTurns) -> None:
    """Compares each new turn (seq, span_id, trace_id, start_time, ids) with the turn before it in its
    trajectory, and the turn after it with it (a turn indexed late); runs in the index's transaction,
    after the chunk's parents are recorded (an agent loop's aggregate output is not a turn)."""
    if not turns:
        return
    for _, span_id, _, _, ids in turns:
        recent.put(span_id, ids)
    conn.executemany("INSERT OR REPLACE INTO truth_turns (span_id, trace_id, start_time, seq) VALUES (?,?,?,?)",
                     [(span_id, trace_id, start, seq) for seq, span_id, trace_id, start, _ in turns])
    new = {span_id for _, span_id, _, _, _ in turns}
    traces = sorted({trace_id for _, _, trace_id, _, _ in turns})
    rows = []
    for trace_id in traces:
        ordered = conn.execute(
            "SELECT span_id, seq FROM truth_turns t WHERE trace_id = ?"
            " AND NOT EXISTS (SELECT 1 FROM parents p WHERE p.parent_id = t.span_id)"
            " ORDER BY start_time, seq", (trace_id,)).fetchall()
        for (prev_id, prev_seq), (cur_id, cur_seq) in zip(ordered, ordered[1:]):
            if prev_id not in new and cur_id not in new:
                continue
            prev = recent.get(prev_id) or _stored_turn(conn, prev_seq)
            cur = recent.get(cur_id) or _stored_turn(conn, cur_seq)
            if prev is None or cur is None:
                continue
            drift = compare(prev[0] + prev[1], cur[0])
            rows.append((cur_id, trace_id, prev_id, int(drift.extends),
                         None if drift.extends else orjson.dumps(drift.as_dict())))
        # a turn that is now an aggregate (children came after it) is no longer compared
        conn.execute("DELETE FROM turn_drift WHERE trace_id = ? AND (EXISTS (SELECT 1 FROM parents p WHERE p.parent_id = span_id)"
                     " OR EXISTS (SELECT 1 FROM parents p WHERE p.parent_id = prev_span_id))", (trace_id,))
    conn.executemany("INSERT OR REPLACE INTO turn_drift (span_id, trace_id, prev_span_id, extends, detail) VALUES (?,?,?,?,?)", rows)
    conn.executemany(
        "INSERT INTO truth (trace_id, drift_checked, drift_turns) SELECT ?, COUNT(*), COALESCE(SUM(extends = 0), 0)"
        " FROM turn_drift WHERE trace_id = ? ON CONFLICT(trace_id) DO UPDATE SET drift_checked = excluded.drift_checked,"
        " drift_turns = excluded.drift_turns", [(t, t) for t in traces])


def _turns_with_logprobs(conn: sqlite3.Connection, trace_id: str) -> list[Turn]:
    """The trajectory's LLM calls in start order, with the engine's log-probabilities (packed at ingest)."""
    out = []
    for seq, in conn.execute("SELECT seq FROM truth_turns t WHERE trace_id = ?"
                             " AND NOT EXISTS (SELECT 1 FROM parents p WHERE p.parent_id = t.span_id) ORDER BY start_time, seq",
                             (trace_id,)).fetchall():
        row = conn.execute("SELECT payload, token_arrays FROM spool.spans WHERE seq = ? AND state != 3", (seq,)).fetchone()
        if row is None or not row[0]:
            continue
        try:
            span = orjson.loads(row[0])
        except orjson.JSONDecodeError:
            continue
        if isinstance(span, dict):
            full_spans([span], conn_loader(conn))  # stored prompt references, rebuilt
        ids = turn_ids(span) if isinstance(span, dict) else None
        if ids is None:
            continue
        logprobs = None
        if row[1]:
            try:
                arrays = TokenArrays.unpack(row[1])
                if arrays.logprobs is not None and arrays.ids == ids[1]:
                    logprobs = arrays.logprobs
            except (ValueError, KeyError):
                logprobs = None
        if logprobs is None:
            raw = dict_or_empty(span.get("output")).get("log_probs")
            logprobs = raw if isinstance(raw, list) and len(raw) == len(ids[1]) else None
        out.append(Turn(ids[0], ids[1], logprobs))
    return out


def compare_pending(conn: sqlite3.Connection, noted: Iterable[str], turned: Iterable[str]) -> None:
    """Compares the trainer's row with the rollout for each trajectory annotated in this chunk whose
    row is not compared yet, and each whose turns just changed; runs in the index's transaction after
    the turns are noted (a trainer row that arrives before its turns is compared when they come)."""
    changed = set(turned)
    for trace_id in sorted(set(noted) | changed):
        row = conn.execute("SELECT tokens, result FROM trainer_rows WHERE trace_id = ?", (trace_id,)).fetchone()
        if row is None or (row[1] is not None and trace_id not in changed):
            continue
        turns = _turns_with_logprobs(conn, trace_id)
        if not turns:
            continue
        try:
            tokens = TrainerTokens.of(orjson.loads(row[0]))
        except (ValueError, orjson.JSONDecodeError):
            continue  # validated at ingest: an index from before that cannot compare it
        result = compare_trainer(turns, tokens)
        lp = array("f", result.trainer_lp)
        if sys.byteorder == "big":
            lp.byteswap()
        detail = {"hist": result.hist, "trainer_lp": base64.b64encode(lp.tobytes()).decode(), "was": result.was, "now": result.now,
                  "generated": len(result.trainer_lp)}
        conn.execute("UPDATE trainer_rows SET result = ? WHERE trace_id = ?", (orjson.dumps(detail), trace_id))
        values = (int(result.ids_equal), result.first_diff, result.ids_differing, result.mask_extra, result.mask_missing,
                  result.absent, int(result.mismatch), result.lp_compared, result.lp_mean, result.lp_p99, result.lp_max)
        conn.execute(f"INSERT INTO truth (trace_id, {', '.join(TT_COLUMNS)}) VALUES (?{', ?' * len(TT_COLUMNS)})"
                     " ON CONFLICT(trace_id) DO UPDATE SET " + ", ".join(f"{k} = excluded.{k}" for k in TT_COLUMNS),
                     (trace_id, *values))


def trainer_detail(conn: sqlite3.Connection, trace_id: str) -> dict[str, Any] | None:
    """The trainer comparison of one trajectory: summary numbers, the trainer's logprob per generated token."""
    row = conn.execute("SELECT result FROM trainer_rows WHERE trace_id = ?", (trace_id,)).fetchone()
    if row is None or row[0] is None:
        return None
    detail = orjson.loads(row[0])
    lp = array("f")
    lp.frombytes(base64.b64decode(detail.pop("trainer_lp")))
    if sys.byteorder == "big":
        lp.byteswap()
    detail["trainer_logprobs"] = [None if math.isnan(v) else v for v in lp.tolist()]
    values = conn.execute(f"SELECT {', '.join(TT_COLUMNS)} FROM truth WHERE trace_id = ?", (trace_id,)).fetchone()
    if values is not None:
        detail.update(dict(zip(TT_COLUMNS, values)))
        detail["tt_ids_equal"] = None if detail["tt_ids_equal"] is None else bool(detail["tt_ids_equal"])
        detail["tt_mismatch"] = None if detail["tt_mismatch"] is None else bool(detail["tt_mismatch"])
    return detail


def drift_of(conn: sqlite3.Connection, trace_id: str) -> dict[str, dict[str, Any]]:
    """Per compared turn (by span id): whether it extends the previous turn, and where it parts."""
    out = {}
    for span_id, prev, _extends, detail in conn.execute(
            "SELECT span_id, prev_span_id, extends, detail FROM turn_drift WHERE trace_id = ?", (trace_id,)):
        entry = orjson.loads(detail) if detail else {"extends": True}
        entry["previous_span_id"] = prev
        out[span_id] = entry
    return out


def truth_of(conn: sqlite3.Connection, trace_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Per trajectory: drift counts and ground truth (the list's columns)."""
    out: dict[str, dict[str, Any]] = {}
    for i in range(0, len(trace_ids), 500):
        chunk = trace_ids[i:i + 500]
        for trace_id, checked, drifted, ground_truth, *rest in conn.execute(
                f"SELECT trace_id, drift_checked, drift_turns, ground_truth, {', '.join(FATE_KEYS + TT_COLUMNS)} FROM truth"
                f" WHERE trace_id IN ({','.join('?' * len(chunk))})", chunk):
            out[trace_id] = {"drift_checked": checked, "drift_turns": drifted, "ground_truth": ground_truth,
                             **dict(zip(FATE_KEYS + TT_COLUMNS, rest))}
    return out


def attach(conn: sqlite3.Connection, rows: list[dict[str, Any]], ground_truth: bool = False) -> None:
    """Adds ``drift_turns``, ``drift_checked`` and ``reward_components`` (and ``ground_truth``) to
    list rows (two queries a page)."""
    ids = [r["trace_id"] for r in rows]
    if not ids:
        return
    truths = truth_of(conn, ids)
    components = components_of(conn, ids)
    for row in rows:
        found = truths.get(row["trace_id"], {})
        row["drift_turns"] = found.get("drift_turns")
        row["drift_checked"] = found.get("drift_checked")
        row["reward_components"] = components.get(row["trace_id"], {})
        if ground_truth:
            row["ground_truth"] = found.get("ground_truth")
        row.update(fate_of(row, found))
        for key in TT_COLUMNS:
            row[key] = found.get(key)
        for key in ("tt_ids_equal", "tt_mismatch"):
            row[key] = None if row[key] is None else bool(row[key])


def fate_of(row: dict[str, Any], found: dict[str, Any]) -> dict[str, Any]:
    """A trajectory's fate from the trainer's notes: evicted (by the replay buffer) over trained over
    filtered; "not_reached" when nothing says the trainer saw it. Its policy versions and staleness."""
    note = found.get("fate")
    if note == "evicted":
        fate = "evicted"
    elif row.get("trained") is True or row.get("trained") == 1 or note == "trained" or found.get("tt_mismatch") is not None:
        fate = "trained"
    elif row.get("trained") is False or row.get("trained") == 0 or note == "filtered":
        fate = "filtered"
    else:
        fate = "not_reached"
    low = found.get("min_global_steps")
    low = low if low is not None else row.get("policy_version")
    high = found.get("max_global_steps")
    trained_at = row.get("trained_on_version")
    return {"fate": fate, "fate_reason": found.get("fate_reason") or (row.get("filtered_by") if fate == "filtered" else None),
            "refill_of": found.get("refill_of"), "min_global_steps": low, "max_global_steps": high if high is not None else low,
            "evicted_at_step": found.get("evicted_at_step"),
            "staleness": trained_at - low if fate == "trained" and trained_at is not None and low is not None else None}


# the export's truth columns (viewer/export.py): name, parquet kind
TRUTH_COLUMNS = (("reward_components", "str"), ("ground_truth", "str"), ("drift_turns", "int"), ("drift_checked", "int"),
                 ("fate", "str"), ("fate_reason", "str"), ("refill_of", "str"), ("min_global_steps", "int"),
                 ("max_global_steps", "int"), ("staleness", "int"), ("tt_mismatch", "bool"), ("tt_first_diff", "int"),
                 ("tt_ids_differing", "int"), ("tt_mask_extra", "int"), ("tt_mask_missing", "int"), ("lp_mean", "float"),
                 ("lp_p99", "float"), ("lp_max", "float"))


def truth_fields(summary: dict[str, Any]) -> dict[str, Any]:
    """An export record's truth: components as JSON text (as ``metrics``), ground truth, drift counts."""
    parts = summary.get("reward_components")
    out: dict[str, Any] = {"reward_components": orjson.dumps(parts).decode() if parts else "{}"}
    out.update({name: summary.get(name) for name, _ in TRUTH_COLUMNS[1:]})
    return out


def separation(rollouts: list[dict[str, Any]], top: int = 5) -> dict[str, Any] | None:
    """Which reward component separates a group's best rollouts from its worst.

    Best and worst are the rollouts with the group's highest and lowest reward; per numeric
    component, the mean over each side and the gap, scored by the gap over the component's range
    in the group (1: it alone tells them apart), so a 0/1 ``acc`` and a length penalty compare.
    None when the group has no spread or no components.
    """
    scored = [r for r in rollouts if type(r.get("reward")) in (int, float)]
    if len(scored) < 2:
        return None
    high, low = max(r["reward"] for r in scored), min(r["reward"] for r in scored)
    if high == low:
        return None
    best = [r for r in scored if r["reward"] == high]
    worst = [r for r in scored if r["reward"] == low]
    keys = sorted({k for r in scored for k, v in (r.get("reward_components") or {}).items() if type(v) is float})
    found = []
    for key in keys:
        values = [r["reward_components"].get(key) for r in scored]
        numbers = [v for v in values if type(v) is float]
        on_best = [v for r in best if type(v := (r.get("reward_components") or {}).get(key)) is float]
        on_worst = [v for r in worst if type(v := (r.get("reward_components") or {}).get(key)) is float]
        if not on_best or not on_worst:
            continue
        mean_best, mean_worst = sum(on_best) / len(on_best), sum(on_worst) / len(on_worst)
        spread = max(numbers) - min(numbers)
        gap = mean_best - mean_worst
        if spread > 0 and gap != 0:
            found.append({"key": key, "best": mean_best, "worst": mean_worst, "gap": gap, "score": abs(gap) / spread})
    found.sort(key=lambda c: (-c["score"], -abs(c["gap"]), c["key"]))
    return {"components": found[:top]} if found else None


def step_truth(conn: sqlite3.Connection, where: str, params: list[Any]) -> dict[str, Any]:
    """Per-step counts over a selection: multi-turn trajectories compared, how many drifted, their share."""
    checked, drifted, turns, turns_drifted = conn.execute(
        f"SELECT COUNT(*), COALESCE(SUM(t.drift_turns > 0), 0), COALESCE(SUM(t.drift_checked), 0), COALESCE(SUM(t.drift_turns), 0)"
        f" FROM truth t WHERE t.drift_checked > 0 AND t.trace_id IN (SELECT trace_id FROM trajectories WHERE {where})",
        params).fetchone()
    drift = {"multi_turn": checked, "with_drift": drifted, "share": drifted / checked if checked else None,
             "turns_compared": turns, "turns_drifted": turns_drifted}
    return drift


def step_trainer(conn: sqlite3.Connection, where: str, params: list[Any]) -> dict[str, Any]:
    """Per-step trainer vs rollout: trajectories compared, with a token mismatch (and their share), |Δ logprob|
    mean over all compared tokens, max, and p99 from the merged histograms (its bin's upper edge)."""
    compared = mismatched = tokens = 0
    total = 0.0
    high: float | None = None
    hist = [0] * (HIST_BINS + 2)
    for mismatch, n, mean, top, result in conn.execute(
            f"SELECT x.tt_mismatch, x.lp_compared, x.lp_mean, x.lp_max, r.result FROM truth x JOIN trainer_rows r"
            f" ON r.trace_id = x.trace_id WHERE x.tt_mismatch IS NOT NULL AND x.trace_id IN (SELECT trace_id FROM trajectories"
            f" WHERE {where})", params):
        compared += 1
        mismatched += bool(mismatch)
        if n:
            tokens += n
            total += mean * n
            high = top if high is None else max(high, top)
            for i, c in enumerate(orjson.loads(result).get("hist") or ()):
                hist[i] += c
    return {"compared": compared, "with_token_mismatch": mismatched, "mismatch_share": mismatched / compared if compared else None,
            "tokens": tokens, "logprob_diff_mean": total / tokens if tokens else None, "logprob_diff_max": high,
            "logprob_diff_p99": hist_quantile(hist, 0.99)}


FATE_SQL = ("CASE WHEN x.fate = 'evicted' THEN 'evicted' WHEN t.trained = 1 OR x.fate = 'trained' OR x.tt_mismatch IS NOT NULL"
            " THEN 'trained'"
            " WHEN t.trained = 0 OR x.fate = 'filtered' THEN 'filtered' ELSE 'not_reached' END")


def step_fates(conn: sqlite3.Connection, where: str, params: list[Any]) -> dict[str, Any]:
    """Per-step fates: trained / filtered / evicted / never reached, evicted by reason, refills, staleness."""
    fates = dict.fromkeys(("trained", "filtered", "evicted", "not_reached"), 0)
    reasons: dict[str, int] = {}
    refills = 0
    stale: list[int] = []
    spans: list[int] = []
    for fate, reason, refill, low, high, policy, trained_at in conn.execute(
            f"SELECT {FATE_SQL}, x.fate_reason, x.refill_of, x.min_global_steps, x.max_global_steps, t.policy_version,"
            f" t.trained_on_version FROM (SELECT trace_id, trained, policy_version, trained_on_version FROM trajectories"
            f" WHERE {where}) t LEFT JOIN truth x ON x.trace_id = t.trace_id", params):
        fates[fate] += 1
        if fate == "evicted":
            reasons[reason or "unknown"] = reasons.get(reason or "unknown", 0) + 1
        refills += refill is not None
        low = low if low is not None else policy
        if fate == "trained" and trained_at is not None and low is not None:
            stale.append(trained_at - low)
        if low is not None and high is not None:
            spans.append(high - low + 1)
    return {**fates, "evicted_by": reasons, "refills": refills,
            "staleness_mean": sum(stale) / len(stale) if stale else None, "staleness_max": max(stale) if stale else None,
            "multi_version": sum(1 for s in spans if s > 1)}


def decode_windows(drift: dict[str, Any], decode: Callable[[list[int]], str] | None) -> None:
    """The decoded text on both sides of the cut (``before``, ``was``, ``now`` as text), when a tokenizer loads."""
    if decode is None or drift.get("extends"):
        return
    for key in ("before", "was", "now"):
        ids = drift.get(key)
        if isinstance(ids, list):
            try:
                drift[key + "_text"] = decode(ids)
            except Exception:  # noqa: BLE001 - ids the tokenizer refuses: shown as ids
                drift[key + "_text"] = None
