"""Prompt and response previews of each trajectory, and a text search over them (SQLite FTS5).

A list of trajectories that shows only ids and numbers makes a user open each one to see what
it was asked and what it answered. The viewer's trajectory index therefore keeps, per
trajectory, its first turn's prompt and its last turn's response (decoded text, bounded), in
``previews``, with a full-text index (``previews_fts``, external content: the text is stored
once) over both. They are filled while the index catches up (never on the ingest path), from
the LLM-call payloads it parses anyway, so a search or a page of previews is a few index seeks
on a store of a million spans. Older index files gain the tables by the index's rebuild (its
version names them).

Only what the collector decoded is searchable (``TRACECAR_TOKEN2TEXT``); token ids alone are not.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from typing import Any

from ..chat_preview import prompt_preview
from ..text_query import MATCH_CLAUSE, QUERY_MAX_CHARS, fts_query  # noqa: F401 - the viewer's names for them

STORED_CHARS = 2000  # per text: longer ones keep their first and last STORED_CHARS / 2 (both are searched)
LIST_CHARS = 200  # per text in a list row: its end (where a chat prompt's question and a response's answer are)
ELLIPSIS = " … "

SCHEMA = """
CREATE TABLE IF NOT EXISTS previews (
    id INTEGER PRIMARY KEY,  -- the trajectory's rowid in the index, so a match is a rowid seek there
    trace_id TEXT NOT NULL UNIQUE,
    prompt_at REAL,
    prompt TEXT,
    response_at REAL,
    response TEXT
);
CREATE VIRTUAL TABLE IF NOT EXISTS previews_fts USING fts5(
    prompt, response, content='previews', content_rowid='id', tokenize='unicode61 remove_diacritics 2'
);
"""
DROP = "DROP TABLE IF EXISTS previews_fts; DROP TABLE IF EXISTS previews;"
def bounded(text: str | None) -> str | None:
    """A text as stored: whole up to STORED_CHARS, else its head and tail."""
    if not isinstance(text, str) or text == "":
        return None
    if len(text) <= STORED_CHARS:
        return text
    half = STORED_CHARS // 2
    return text[:half] + ELLIPSIS + text[-half:]


def _at(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) else default


def note(conn: sqlite3.Connection, calls: Iterable[tuple[str, Any, Any, Any]]) -> None:
    """Folds LLM calls (trace_id, start_time, prompt_text, response_text) into the previews.

    A trajectory keeps the earliest call's prompt and the latest call's response, whatever
    order its spans arrive in. Runs inside the index's write transaction, after the trajectories' rows.
    """
    best: dict[str, list[Any]] = {}
    for trace_id, start, prompt, response in calls:
        prompt, response = bounded(prompt), bounded(response)
        if prompt is None and response is None:
            continue
        entry = best.setdefault(trace_id, [None, None, None, None])
        if prompt is not None and (entry[1] is None or _at(start, float("inf")) < entry[0]):
            entry[0], entry[1] = _at(start, float("inf")), prompt
        if response is not None and (entry[3] is None or _at(start, float("-inf")) >= entry[2]):
            entry[2], entry[3] = _at(start, float("-inf")), response
    for trace_id, (prompt_at, prompt, response_at, response) in best.items():
        old = conn.execute("SELECT id, prompt_at, prompt, response_at, response FROM previews WHERE trace_id = ?",
                           (trace_id,)).fetchone()
        if old is None:
            found = conn.execute("SELECT rowid FROM trajectories WHERE trace_id = ?", (trace_id,)).fetchone()
            if found is None:  # upserted just before in the same transaction: cannot happen
                continue
            conn.execute("INSERT INTO previews (id, trace_id, prompt_at, prompt, response_at, response) VALUES (?,?,?,?,?,?)",
                         (found[0], trace_id, prompt_at, prompt, response_at, response))
            conn.execute("INSERT INTO previews_fts (rowid, prompt, response) VALUES (?,?,?)", (found[0], prompt, response))
            continue
        row_id, old_prompt_at, old_prompt, old_response_at, old_response = old
        new_prompt = (prompt_at, prompt) if prompt is not None and (old_prompt is None or prompt_at < _at(old_prompt_at, float("inf"))) \
            else (old_prompt_at, old_prompt)
        new_response = (response_at, response) if response is not None and (
            old_response is None or response_at >= _at(old_response_at, float("-inf"))) else (old_response_at, old_response)
        if new_prompt[1] == old_prompt and new_response[1] == old_response:
            continue
        conn.execute("INSERT INTO previews_fts (previews_fts, rowid, prompt, response) VALUES ('delete', ?, ?, ?)",
                     (row_id, old_prompt, old_response))
        conn.execute("UPDATE previews SET prompt_at = ?, prompt = ?, response_at = ?, response = ? WHERE id = ?",
                     (*new_prompt, *new_response, row_id))
        conn.execute("INSERT INTO previews_fts (rowid, prompt, response) VALUES (?,?,?)", (row_id, new_prompt[1], new_response[1]))


def forget(conn: sqlite3.Connection, trace_ids: list[str]) -> None:
    """Drops the previews of trajectories the index pruned (inside its transaction)."""
    for i in range(0, len(trace_ids), 500):
        chunk = trace_ids[i:i + 500]
        marks = ",".join("?" * len(chunk))
        for row_id, prompt, response in conn.execute(f"SELECT id, prompt, response FROM previews WHERE trace_id IN ({marks})",
                                                     chunk).fetchall():
            conn.execute("INSERT INTO previews_fts (previews_fts, rowid, prompt, response) VALUES ('delete', ?, ?, ?)",
                         (row_id, prompt, response))
        conn.execute(f"DELETE FROM previews WHERE trace_id IN ({marks})", chunk)


def _tail(text: str | None) -> str | None:
    if text is None or len(text) <= LIST_CHARS:
        return text
    return "…" + text[-LIST_CHARS:]


def attach(conn: sqlite3.Connection, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds ``prompt_preview`` (the first prompt's last user message, template tokens stripped; its end when
    no chat template is recognised) and ``response_preview`` (the last response's end), LIST_CHARS each."""
    if not rows:
        return rows
    ids = [r["trace_id"] for r in rows]
    found = {t: (p, r) for t, p, r in conn.execute(
        f"SELECT trace_id, prompt, response FROM previews WHERE trace_id IN ({','.join('?' * len(ids))})", ids)}
    for row in rows:
        row.update(previews_of(*found.get(row["trace_id"], (None, None))))
    return rows


def previews_of(prompt: str | None, response: str | None) -> dict[str, str | None]:
    """A list row's two previews from the stored (bounded) texts: every read store shows the same."""
    return {"prompt_preview": prompt_preview(prompt, LIST_CHARS), "response_preview": _tail(response)}
