"""Stored prompt references: a growing prompt is stored as "an earlier span's context + the new
ids" (as the wire sends it) and rebuilt whole here, the one place every reader of span
``inputs``/``output`` goes through.

Why: VERL sends turn k's whole context as its prompt, so storing each turn's full
``prompt_ids`` (and its decoded ``prompt_text``) made a trajectory's stored bytes grow with the
square of its turns. The ingest path (:mod:`tracecar.collector.processors.store_refs`) stores
such a value as ``{"$ref": <span_id>, "from": a, "n": b, "add": [...]}`` (ids: the referenced
span's context ``[a:b]`` + ``add``; texts: its ``prompt_text + response_text`` ``[a:b]`` +
``add``) and lists the compacted paths under the top-level key :data:`REFS_KEY`, which no
client can send (span validation ignores unknown top-level keys). A span's *context* is its
``inputs.prompt_ids`` followed by its output's ``response_ids`` (else ``token_ids``), as
:mod:`tracecar.collector.processors.prompt_refs` remembers it at ingest.

Readers: :func:`full_spans` (parsed spans, in place) and :func:`full_payloads` /
:func:`full_rows` (payload bytes, byte-identical to what a store without references holds:
the rebuilt span is serialised by the same ``pack_payload``). A reference resolves only within
its own trajectory; one that cannot (its span deleted or never stored) is loud: counted in
:data:`DANGLING`, logged rate-limited, and the value left as stored with a warning on the span,
never silently wrong. Heads (attributes, names, times) are never compacted, so readers of those
alone (list filters, annotations, roots) need not come here.
"""

from __future__ import annotations

import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import orjson

from tracecar.client.prompt_delta import REF_KEY, as_ids, response_of

from ..loudness import DANGLING
from .payload import pack_payload

REFS_KEY = "$refs"  # top-level key of a stored span: the [part, key] paths stored as references
REFS_MARK = b'"$refs":['  # how a stored payload that holds references starts its list of them
MAX_CHAIN = 4096  # references followed from one span before giving up (a chain, never a loop: refs point back)

# span_id -> (trace_id, payload) of stored spans
Loader = Callable[[Sequence[str]], dict[str, tuple[str, bytes]]]


def is_compact(payload: bytes | None) -> bool:
    """Whether a stored payload may hold references (cheap; :func:`full_spans` confirms by parsing)."""
    return payload is not None and REFS_MARK in payload


def spool_loader(query: Callable[[str, Sequence[Any]], list[dict[str, Any]]], table: str = "spans") -> Loader:
    """A loader over ``Spool.query`` (or any ``(sql, params) -> rows as dicts``)."""

    def load(span_ids: Sequence[str]) -> dict[str, tuple[str, bytes]]:
        out: dict[str, tuple[str, bytes]] = {}
        ids = list(span_ids)
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            for r in query(f"SELECT span_id, trace_id, payload FROM {table} WHERE span_id IN ({','.join('?' * len(chunk))})",
                           chunk):
                out[r["span_id"]] = (r["trace_id"], r["payload"])
        return out

    return load


def conn_loader(conn: sqlite3.Connection, table: str = "spool.spans") -> Loader:
    """A loader over a connection of its own (the viewer's index attaches the spool as ``spool``)."""

    def query(sql: str, params: Sequence[Any]) -> list[dict[str, Any]]:
        return [{"span_id": a, "trace_id": b, "payload": c} for a, b, c in conn.execute(sql, params).fetchall()]

    return spool_loader(query, table)


def with_rows(rows: dict[str, tuple[str, bytes]], fallback: Loader | None) -> Loader:
    """A loader that looks in rows the caller holds already (span_id -> (trace_id, payload)) first."""

    def load(span_ids: Sequence[str]) -> dict[str, tuple[str, bytes]]:
        out = {sid: rows[sid] for sid in span_ids if sid in rows and rows[sid][1]}
        missing = [sid for sid in span_ids if sid not in out]
        if missing and fallback is not None:
            out.update(fallback(missing))
        return out

    return load


class ContextCache:
    """Contexts rebuilt by earlier reads, by (trace_id, span_id), bounded by their ids (least
    recently used first out). A forwarder batch or an index chunk holds a turn or two of a
    trajectory; without this each read would rebuild every earlier turn again (a chain), a cost
    growing with the cube of the turns. Stored rows never change once referenced, so an entry
    stays right; ``TRACECAR_STORE_PROMPT_REFS_CACHE_IDS`` sets the bound (0: off)."""

    def __init__(self, max_ids: int) -> None:
        self.max_ids = max_ids
        self._entries: OrderedDict[tuple[Any, str], tuple[list[Any], str]] = OrderedDict()
        self._ids = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, str]) -> tuple[list[Any], str] | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key: tuple[Any, str], value: tuple[list[Any], str]) -> None:
        n = len(value[0])
        with self._lock:
            if n > self.max_ids or key in self._entries:
                return
            self._entries[key] = value
            self._ids += n
            while self._ids > self.max_ids:
                _, (ids, _) = self._entries.popitem(last=False)
                self._ids -= len(ids)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._ids = 0


CONTEXTS = ContextCache(1_000_000)  # the process's; the service sets its bound from the settings


class _Resolver:
    """Rebuilds spans, memoising each referenced span's full context and texts."""

    def __init__(self, known: dict[str, dict[str, Any]], load: Loader | None) -> None:
        self.known = known  # span_id -> parsed span (the caller's, expanded in place)
        self.load = load
        self.contexts: dict[str, tuple[list[Any], str]] = {}  # span_id -> (context ids, context text)

    def _span(self, span_id: str, trace_id: Any) -> dict[str, Any] | None:
        span = self.known.get(span_id)
        if span is None and self.load is not None:
            found = self.load([span_id]).get(span_id)
            if found is not None and found[0] == trace_id and found[1]:
                try:
                    loaded = orjson.loads(found[1])
                except orjson.JSONDecodeError:
                    loaded = None
                if isinstance(loaded, dict):
                    span = self.known[span_id] = loaded
        if span is None or span.get("trace_id") != trace_id:
            return None
        return span

    def context(self, span_id: str, trace_id: Any, depth: int) -> tuple[list[Any], str] | None:
        """(ids, text) of a stored span's context, rebuilt; None when it cannot be."""
        done = self.contexts.get(span_id) or CONTEXTS.get((trace_id, span_id))
        if done is not None:
            return done
        span = self._span(span_id, trace_id)
        if span is None or depth > MAX_CHAIN:
            return None
        if REFS_KEY in span and not self.expand(span, depth + 1):
            return None
        inputs, output = span.get("inputs"), span.get("output")
        prompt = as_ids(inputs.get("prompt_ids")) if isinstance(inputs, dict) else None
        if prompt is None:
            return None
        response = as_ids(response_of(output)[1])
        text = output.get("prompt_text") if isinstance(output, dict) else None
        then = output.get("response_text") if isinstance(output, dict) else None
        found = (prompt + response if response else prompt,
                 (text if type(text) is str else "") + (then if type(then) is str else ""))
        self.contexts[span_id] = found
        CONTEXTS.put((trace_id, span_id), found)
        return found

    def expand(self, span: dict[str, Any], depth: int = 0) -> bool:
        """Rebuilds the span's references in place; False (said, counted) if one cannot be."""
        paths = span.pop(REFS_KEY, None)
        if type(paths) is not list:
            return True
        failed: list[str] = []
        for path in paths:
            if type(path) is not list or len(path) != 2:
                continue
            part, key = path
            holder = span.get(part)
            value = holder.get(key) if type(holder) is dict else None
            if type(value) is not dict or REF_KEY not in value:
                continue
            ref, start, n, add = value.get(REF_KEY), value.get("from"), value.get("n"), value.get("add")
            context = self.context(ref, span.get("trace_id"), depth) if type(ref) is str else None
            if context is None or type(start) is not int or type(n) is not int:
                failed.append(f"{part}.{key}")
                continue
            base: Any = context[1] if type(add) is str else context[0]
            if not 0 <= start <= n <= len(base) or type(add) not in (str, list):
                failed.append(f"{part}.{key}")
                continue
            holder[key] = base[start:n] + add  # type: ignore[index]
        if failed:
            detail = (f"span {span.get('span_id')!r} of trajectory {span.get('trace_id')!r}: {', '.join(failed)} refer to a span "
                      "this store does not hold (deleted, or never stored)")
            DANGLING.hit("read", len(failed), detail)
            notes = span.setdefault("warnings", [])
            if type(notes) is list:
                notes.append(f"{', '.join(failed)}: stored as a reference to an earlier span that this store no longer holds; "
                             "shown as stored (the new ids only)")
            return False
        return True


def full_spans(spans: Iterable[dict[str, Any]], load: Loader | None) -> None:
    """Rebuilds every stored reference of these parsed spans in place (the spans themselves are
    looked up first, then ``load``: a whole trajectory read needs no further query)."""
    spans = [s for s in spans if isinstance(s, dict)]
    compact = [s for s in spans if REFS_KEY in s]
    if not compact:
        return
    resolver = _Resolver({s["span_id"]: s for s in spans if type(s.get("span_id")) is str}, load)
    for span in compact:
        resolver.expand(span)


def _pack(span: dict[str, Any]) -> tuple[bytes, int, int]:
    return pack_payload(span)  # type: ignore[arg-type]  # the very serialiser of the ingest path


def full_rows(rows: Sequence[tuple[bytes | None, int | None, int | None]], load: Loader | None
              ) -> list[tuple[bytes | None, int | None, int | None]]:
    """(payload, inputs_at, output_at) rows with their references rebuilt; rows without any are
    returned as they are (not parsed)."""
    compact = [i for i, (payload, _, _) in enumerate(rows) if is_compact(payload)]
    if not compact:
        return list(rows)
    parsed: dict[int, dict[str, Any]] = {}
    for i in compact:
        try:
            span = orjson.loads(rows[i][0])  # type: ignore[arg-type]
        except orjson.JSONDecodeError:
            continue
        if isinstance(span, dict) and REFS_KEY in span:
            parsed[i] = span
    if not parsed:
        return list(rows)
    full_spans(parsed.values(), load)
    out = list(rows)
    for i, span in parsed.items():
        out[i] = _pack(span)
    return out


def full_payloads(payloads: Sequence[bytes | None], load: Loader | None) -> list[bytes | None]:
    """Stored payloads with their references rebuilt (byte-identical to a store without them)."""
    return [p for p, _, _ in full_rows([(p, None, None) for p in payloads], load)]
