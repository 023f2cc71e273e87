"""Store a growing prompt as a reference: the earlier span's context + the new ids (and text).

The wire already sends turn k's prompt as "span j's context [a:b] + add"
(:mod:`tracecar.collector.processors.prompt_refs` rebuilds the full list for decoding). Storing
the rebuilt list made stored bytes grow with the square of the turns, so the spool keeps the
reference instead, and the decoded ``prompt_text`` / ``response_text`` as the same kind of
reference into the earlier span's ``prompt_text + response_text`` where the text starts with it.
Readers get full lists back from :mod:`tracecar.collector.spool.full_payloads` (byte-identical).

A value is stored as a reference only when its span is known to be stored (earlier in this batch
and not refused, or in the store within the same trajectory: see :func:`refs_stored`), so a
reference never names a span the store lacks; the spool checks again as it writes and counts a
miss (``tracecar_stored_prompt_refs_dangling{where="write"}``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tracecar.client.prompt_delta import REF_KEY

from ..spool.full_payloads import REFS_KEY

# span_id -> [(part, key, ref span_id, from, n)]: the lists of the span rebuilt from a reference
StoreRefs = dict[str, list[tuple[str, str, str, int, int]]]
_TEXT_KEYS = ("prompt_text", "response_text")
MIN_SAVED = 64  # a text reference must save at least this many characters


def referenced(refs: StoreRefs) -> set[str]:
    """Every span a reference of the batch names."""
    return {r[2] for items in refs.values() for r in items}


def refs_stored(refs: StoreRefs, trace_of: dict[str, str], batch_ids: set[str], stored: dict[str, str]) -> StoreRefs:
    """The references whose span is in this batch or stored in the same trajectory (the rest are stored whole)."""
    out: StoreRefs = {}
    for sid, items in refs.items():
        trace = trace_of.get(sid)
        kept = [r for r in items if r[2] in batch_ids or (trace is not None and stored.get(r[2]) == trace)]
        if kept and len(kept) == len(items):
            out[sid] = kept
    return out


def _text_ref(text: str, prompt: str, then: str | None, start: int) -> tuple[int, int, str] | None:
    """(from, n, add) with text == (prompt + then)[from:n] + add, or None; compared in place: the
    base is never built (copying a long context's text each turn grew with the square of the turns)."""
    lp = len(prompt)
    whole = lp + (len(then) if then is not None else 0)
    if start > whole:
        return None
    if start == 0:
        if text.startswith(prompt):
            if then is not None and text.startswith(then, lp):
                return 0, whole, text[whole:]
            if then is not None and len(text) < whole and then.startswith(text[lp:]):
                return 0, len(text), ""
            return 0, lp, text[lp:]
        if prompt.startswith(text):
            return 0, len(text), ""
        return None
    if then is None or start > lp:
        return None
    if prompt.endswith(text[:lp - start]) and len(text) >= lp - start:  # the rest of the prompt, then the response
        if text.startswith(then, lp - start):
            return start, whole, text[whole - start:]
        if then.startswith(text[lp - start:]):
            return start, start + len(text), ""
    return None


def compact_span(span: dict[str, Any], items: list[tuple[str, str, str, int, int]],
                 view: Callable[[str], Any]) -> tuple[dict[str, Any], list[str]] | None:
    """The span as stored (a shallow copy, the caller's is unchanged) and the spans it refers to;
    None when nothing is stored as a reference.

    ``view(ref)`` gives the referenced context's decoded texts (``text``: its prompt's,
    ``response_text``), or None.
    """
    parts: dict[str, dict[str, Any]] = {}
    paths: list[list[str]] = []
    used: list[str] = []
    for part, key, ref, start, n in items:
        holder = span.get(part)
        value = holder.get(key) if type(holder) is dict else None
        if type(value) is not list or not 0 <= start <= n or len(value) < n - start:
            continue
        new = parts.setdefault(part, dict(holder))  # type: ignore[arg-type]
        new[key] = {REF_KEY: ref, "from": start, "n": n, "add": value[n - start:]}
        paths.append([part, key])
        used.append(ref)
    output = span.get("output")
    if type(output) is dict and used:
        own_prompt = output.get("prompt_text")
        for key in _TEXT_KEYS:
            text = output.get(key)
            if type(text) is not str or len(text) < MIN_SAVED:
                continue
            for ref in dict.fromkeys(used):
                ctx = view(ref)
                prompt = getattr(ctx, "text", None) if ctx is not None else None
                if type(prompt) is not str:
                    continue
                then = getattr(ctx, "response_text", None)
                then = then if type(then) is str else None
                found = None
                if key == "response_text" and type(own_prompt) is str and own_prompt and len(own_prompt) <= len(prompt) \
                        and prompt.startswith(own_prompt):
                    found = _text_ref(text, prompt, then, len(own_prompt))
                found = found or _text_ref(text, prompt, then, 0)
                if found is None or len(text) - len(found[2]) < MIN_SAVED:
                    continue
                new = parts.setdefault("output", dict(output))
                new[key] = {REF_KEY: ref, "from": found[0], "n": found[1], "add": found[2]}
                paths.append(["output", key])
                break
    if not paths:
        return None
    # REFS_KEY ends the head (pack_payload writes inputs and output after every other key)
    return {**span, REFS_KEY: paths, **parts}, sorted(set(used))
