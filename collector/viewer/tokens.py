"""The token view of one trajectory: each response token with its text, log-probability, loss mask and entropy.

Read from the packed per-token arrays the collector stored at ingest (processors.token_arrays)
and the decoded ``response_text`` in the payload, cut at the offsets token_pieces computed, so
the pieces always join to the text the conversation view shows. Per span that carried arrays:
a turn (an LLM call) or the agent loop's whole output (VERL's ``AgentLoopOutput``: every turn
plus tool output, the tool tokens outside the loss mask). Every answer says whether each token's
text is exactly its own (``exact``, per span and for the whole answer): offsets are exact for
byte-level BPE, WordPiece, Metaspace and byte-fallback decoders; only an odd decoder on a long
sequence gets approximated ones, and the viewer then says so.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from ..processors.token_arrays import TokenArrays
from ..spool.full_payloads import full_payloads, spool_loader
from ..spool.query import trajectory_loader
from ..spool.store import Spool

LOWEST = 10


def _number(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value


def _lowest(tokens: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The ``k`` least probable tokens the policy generated (inside the loss mask when there is one)."""
    scored = [t for t in tokens if t.get("logprob") is not None and t.get("mask", 1) != 0]
    return sorted(scored, key=lambda t: t["logprob"])[:k]


def span_tokens(span_id: str, name: str, start_time: float | None, aggregate: bool, payload: bytes, blob: bytes,
                lowest: int = LOWEST) -> dict[str, Any]:
    """One span's tokens (see the module)."""
    arrays = TokenArrays.unpack(blob)
    span = orjson.loads(payload)
    output = span.get("output") if isinstance(span.get("output"), dict) else {}
    text = output.get("response_text") if isinstance(output.get("response_text"), str) else None
    ends = arrays.ends if text is not None and arrays.ends is not None and (not arrays.ends or arrays.ends[-1] == len(text)) else None
    tokens = []
    for i, token_id in enumerate(arrays.ids):
        token: dict[str, Any] = {"i": i, "id": token_id}
        if ends is not None:
            start = ends[i - 1] if i else 0
            token.update(start=start, end=ends[i], text=text[start:ends[i]])  # type: ignore[index]
        if arrays.logprobs is not None:
            token["logprob"] = _number(arrays.logprobs[i])
        if arrays.mask is not None:
            token["mask"] = arrays.mask[i]
        if arrays.entropy is not None:
            token["entropy"] = _number(arrays.entropy[i])
        tokens.append(token)
    logprobs = [t["logprob"] for t in tokens if t.get("logprob") is not None and t.get("mask", 1) != 0]
    return {
        "span_id": span_id, "name": name, "start_time": start_time, "aggregate": aggregate,
        "text": text if ends is not None else None, "text_note": None if ends is not None else _why_no_text(text, arrays),
        # False: the pieces join to the text but are approximated (a decoder token_pieces cannot
        # place exactly); None: no text to cut
        "exact": (arrays.exact if ends is not None else None),
        "sources": arrays.keys or {}, "has": {k: getattr(arrays, k) is not None for k in ("logprobs", "mask", "entropy")},
        "count": len(tokens), "outside_mask": sum(1 for t in tokens if t.get("mask") == 0),
        "mean_logprob": sum(logprobs) / len(logprobs) if logprobs else None,
        "lowest": _lowest(tokens, lowest) if arrays.logprobs is not None else [],
        "tokens": tokens,
    }


def _with_archived(spool: Spool, trace_id: str) -> list[dict[str, Any]] | None:
    """Every span of a trajectory retention may have moved to the archive (spool/archive.py), the spool's and the
    archive's, each with ``aggregate`` (it has children: the agent loop's whole output); None if neither has it."""
    rows = spool.with_archive(trace_id, spool.query(
        "SELECT seq, span_id, parent_id, name, start_time, payload, token_arrays FROM spans WHERE trace_id = ?"
        " ORDER BY start_time, seq", [trace_id]))
    if not rows:
        return None
    parents = {r["parent_id"] for r in rows}
    for r in rows:
        r["aggregate"] = r["span_id"] in parents
    return rows


def _why_no_text(text: str | None, arrays: TokenArrays) -> str:
    if text is None:
        return "response not decoded (token2text off, or no tokenizer): token ids only"
    return "token offsets not recorded for this span: token ids only"


def trajectory_tokens(spool: Spool, trace_id: str, lowest: int = LOWEST) -> dict[str, Any] | None:
    """Every span of the trajectory that carried per-token data, in start order; None if the trajectory is unknown.

    ``lowest`` (trajectory-wide) comes from the agent loop's whole output when there is one (it
    holds every turn), else from all spans.
    """
    if spool.may_be_archived(trace_id):
        rows = _with_archived(spool, trace_id)
        if rows is None:
            return None
        load = trajectory_loader(spool, trace_id, rows)
        rows = [r for r in rows if r["token_arrays"] is not None]
    else:
        rows = spool.query(
            "SELECT s.span_id, s.name, s.start_time, s.payload, s.token_arrays,"
            " EXISTS (SELECT 1 FROM spans c WHERE c.parent_id = s.span_id AND c.trace_id = s.trace_id) AS aggregate"
            " FROM spans s WHERE s.trace_id = ? AND s.token_arrays IS NOT NULL ORDER BY s.start_time, s.seq", [trace_id])
        if not rows and not spool.query("SELECT 1 AS x FROM spans WHERE trace_id = ? LIMIT 1", [trace_id]):
            return None
        load = spool_loader(spool.query)
    payloads = full_payloads([r["payload"] for r in rows], load)  # stored prompt references, rebuilt
    spans = [span_tokens(r["span_id"], r["name"], r["start_time"], bool(r["aggregate"]), p or b"{}", r["token_arrays"], lowest)
             for r, p in zip(rows, payloads)]
    pool = [s for s in spans if s["aggregate"]] or spans
    everywhere = [{**t, "span_id": s["span_id"]} for s in pool for t in s["tokens"]]
    return {"trace_id": trace_id, "exact": all(s["exact"] is not False for s in spans), "spans": spans,
            "lowest": _lowest(everywhere, lowest)}
