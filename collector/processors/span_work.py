"""The per-span CPU work after sampling: decode token ids to text, pack token arrays, serialise.

Pure functions of the spans and a few settings, so the ingest process runs them in a thread
(``TRACECAR_WORKERS=1``) and the worker processes of :mod:`tracecar.collector.receivers.worker_pool` run the very same code.
State the work needs from the ingest process (earlier prompts' texts, for wire-version-2
references) comes in through the ``contexts`` lookup and goes back through ``set_texts``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import orjson

from ..spool.payload import PayloadError, pack_payload  # noqa: F401 - the pipeline's and engine_hold's names for them
from ..spool.store import SpoolRow
from ..types import Span
from .decoding import KnownPrefix, KnownSuffix, collect_jobs, decode_spans
from .store_refs import StoreRefs, compact_span
from .token_arrays import extract as extract_token_arrays
from .token_arrays import strip_from_payload as strip_token_arrays
from .token_pieces import ApproximateEnds
from .validate import Rejection


def pack_token_arrays(span: Span, ends: list[int] | None, warnings: dict[str, list[str]], local_only: bool) -> bytes | None:
    """The span's per-token arrays packed for the spool (see token_arrays); in local mode they
    also leave the payload. Problems are warnings on the span, never a lost span."""
    if not isinstance(span.get("output"), dict):
        return None
    notes: list[str] = []
    arrays = extract_token_arrays(span, notes)
    if notes:
        warnings.setdefault(span["span_id"], []).extend(notes)
    if arrays is None:
        return None
    arrays.ends = ends if ends is not None and len(ends) == len(arrays.ids) else None
    arrays.exact = not isinstance(arrays.ends, ApproximateEnds)
    if local_only:
        strip_token_arrays(span, arrays)
    return arrays.pack()


def serialize_spans(spans: list[Span], warnings: dict[str, list[str]], index_of: dict[str, int], ends: dict[str, list[int]],
                    *, max_span_bytes: int, count_tokens: bool, local_only: bool,
                    store_refs: StoreRefs | None = None,
                    view: Callable[[str], Any] | None = None) -> tuple[list[SpoolRow], list[Rejection]]:
    """Spool rows of the spans; a span over ``max_span_bytes`` or that cannot be stored is a rejection naming it.

    ``store_refs`` (see :mod:`.store_refs`): lists rebuilt from a reference whose span is stored
    (earlier in this batch, or in the store) are stored as the reference; ``view(ref)`` gives the
    referenced context's texts. A reference to a span of this batch that is refused is stored whole.
    """
    rows, too_big = [], []
    refused: set[str] = set()
    for span in spans:
        packed = pack_token_arrays(span, ends.get(span["span_id"]), warnings, local_only)
        notes = warnings.get(span["span_id"])
        if notes:
            span["warnings"] = notes
        stored: Any = span
        refs: list[str] | None = None
        items = store_refs.get(span["span_id"]) if store_refs else None
        if items and not any(r[2] in refused for r in items):
            compact = compact_span(cast("dict[str, Any]", span), items, view or (lambda ref: None))
            if compact is not None:
                stored, refs = compact
        try:
            payload, inputs_at, output_at = pack_payload(stored)
        except PayloadError as exc:  # e.g. nested past orjson's depth: the part at fault is named
            index = index_of[span["span_id"]]
            too_big.append(Rejection(index, span["span_id"], f"spans[{index}].{exc.field}", exc.reason))
            refused.add(span["span_id"])
            continue
        except orjson.JSONEncodeError as exc:
            index = index_of[span["span_id"]]
            too_big.append(Rejection(index, span["span_id"], f"spans[{index}]", f"cannot be stored: {exc}"))
            refused.add(span["span_id"])
            continue
        if len(payload) > max_span_bytes:
            index = index_of[span["span_id"]]
            too_big.append(Rejection(index, span["span_id"], f"spans[{index}]",
                                     f"{len(payload)} bytes exceed TRACECAR_MAX_SPAN_BYTES={max_span_bytes}"))
            refused.add(span["span_id"])
            continue
        row = SpoolRow(span, payload, notes, inputs_at=inputs_at, output_at=output_at, token_arrays=packed, refs=refs)
        if count_tokens:  # for max_tokens_per_step: token ids the span carries
            row.tokens = sum(len(job.ids) for job in collect_jobs(span))
        rows.append(row)
    return rows, too_big


@dataclass
class ContextView:
    """What decoding reads of a remembered prompt context (prompt_refs.Context without its ids)."""

    prompt_len: int
    n_ids: int
    response_source: str | None = None
    text: str | None = None
    response_text: str | None = None
    tokenizer: str | None = None
    marks: tuple[tuple[int, str], ...] = ()

    @classmethod
    def of(cls, entry: Any) -> ContextView:
        return cls(entry.prompt_len, entry.n_ids, entry.response_source, entry.text, entry.response_text, entry.tokenizer,
                   tuple(getattr(entry, "marks", ())))


# (worker, span_id) -> the context remembered for that span, or None
Lookup = Callable[[str, str], "ContextView | Any | None"]
# (worker, span_id, prompt text, response text, tokenizer name)
SetTexts = Callable[[str, str, "str | None", "str | None", str], None]


def _n_ids(entry: Any) -> int:
    return int(entry.n_ids)


def prefix_text(worker: str, entry: Any, length: int, name: str, lookup: Lookup) -> str | None:
    """The text of the first ``length`` ids of a context when they are exactly a prompt whose text is
    known (its own, or an earlier turn's it was built on: ``marks``), decoded with tokenizer ``name``."""
    if entry.prompt_len == length and entry.text is not None and entry.tokenizer == name:
        return str(entry.text)
    for n, span_id in getattr(entry, "marks", ()):
        if n == length:
            earlier = lookup(worker, span_id)
            if earlier is not None and earlier.prompt_len == length and earlier.text is not None and earlier.tokenizer == name:
                return str(earlier.text)
    return None


def decode_v2(spans: list[Span], worker: str, bases: dict[Any, Any], tokenizer: Any, name: str,
              warnings: dict[str, list[str]], ends: dict[str, list[int]], lookup: Lookup, set_texts: SetTexts,
              outcomes: dict[str, int]) -> int:
    """decode_spans, reusing the text of referenced prompts decoded with this tokenizer, and
    keeping each decoded prompt's text for the next turn (v2 batches only).

    A turn whose earlier turn is in this batch too waits for a later round (one
    ``decode_batch`` each), so its earlier text is known when it is decoded.
    """
    tokens = 0
    pending = spans
    while pending:
        waiting = {s["span_id"] for s in pending}
        now: list[Span] = []
        later: list[Span] = []
        for span in pending:
            sid = span["span_id"]
            refs = [b.ref for b in (bases.get(sid), bases.get((sid, "output"))) if b is not None and b.ref != sid]
            (later if any(ref in waiting for ref in refs) else now).append(span)
        if not now:  # cannot happen (a reference names an earlier span); never loop on it
            now, later = later, []
        known: dict[Any, Any] = {}
        for span in now:
            sid = span["span_id"]
            base = bases.get(sid)
            entry = lookup(worker, base.ref) if base is not None else None
            if (entry is not None and base is not None and entry.text is not None and entry.tokenizer == name
                    and entry.prompt_len == base.prompt_len):
                then = entry.response_text is not None and base.with_response
                known[sid] = KnownPrefix(base.prompt_len, entry.text, _n_ids(entry) - entry.prompt_len if then else 0,
                                         entry.response_text if then else None)
            base = bases.get((sid, "output"))
            entry = lookup(worker, base.ref) if base is not None else None
            if (entry is not None and base is not None and entry.text is not None and entry.response_text is not None
                    and entry.tokenizer == name):
                context = KnownPrefix(entry.prompt_len, entry.text, _n_ids(entry) - entry.prompt_len, entry.response_text)
                known[(sid, "output.response_ids")] = KnownSuffix(context, base.start)
            if entry is not None and base is not None:  # the output's prompt_ids: an earlier prompt, text known
                text = prefix_text(worker, entry, base.start, name, lookup)
                if text is not None:
                    known[(sid, "output.prompt_ids")] = text
        texts: dict[tuple[str, str], str] = {}
        tokens += decode_spans(now, tokenizer, warnings, known=known, texts_out=texts, outcomes=outcomes, pieces=ends)
        for span in now:
            span_id = span["span_id"]
            entry = lookup(worker, span_id)
            if entry is not None:
                response = texts.get((span_id, entry.response_source)) if entry.response_source else None
                set_texts(worker, span_id, texts.get((span_id, "inputs.prompt_ids")), response, name)
        pending = later
    return tokens
