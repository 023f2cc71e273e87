"""HTTP side of training truth (issue 29): the truth filters every list takes, and one trajectory's truth.

``truth_filters`` is a FastAPI dependency the list, groups and export routes add: ``drift=``
(true: a turn drifted; false: multi-turn and every turn extends the one before) and
``where=acc=0,format<1`` (reward components). A malformed ``where`` is a 422 naming the field.

``GET /v1/trajectories/{id}/truth`` (and the viewer's trajectory page, through
:func:`add_truth`): per turn whether its prompt extends the previous turn's prompt + response,
and if not where it parts with the ids and their decoded text on both sides of the cut (decoded
here, on read, with the collector's default tokenizer when one loads); the reward's components
and the ground truth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.responses import Response

from ..processors import byte_level
from ..read_store import ReadStore
from ..truth_filter import FATES, parse_where
from . import StoreOwner
from .list_api import INDEX_ERRORS, caught_up
from .trajectory_ids import read_by_id
from .truth import decode_windows

WHERE_MAX_CHARS = 1024
FATE_PATTERN = "^(|" + "|".join(FATES) + ")$"


def truth_filters(drift: bool | None = None, where: str | None = Query(None, max_length=WHERE_MAX_CHARS),
                  fate: str | None = Query(None, pattern=FATE_PATTERN), refill: bool | None = None,
                  trained_other: bool | None = None, lp_delta_min: float | None = Query(None, ge=0)) -> dict[str, Any]:
    """The truth filters of a list request, checked (a bad ``where`` names itself in a 422)."""
    if where is not None and where.strip():
        try:
            parse_where(where)
        except ValueError as exc:
            raise HTTPException(422, detail={"field": "where", "reason": str(exc)}) from None
    return {"drift": drift, "reward_where": where.strip() if where and where.strip() else None, "fate": fate or None,
            "refill": refill, "trained_other": trained_other, "lp_delta_min": lp_delta_min}


TruthFilters = Annotated[dict[str, Any], Depends(truth_filters)]


def decoder_of(collector: StoreOwner) -> Callable[[list[int]], str] | None:
    """The default tokenizer's decode (special tokens kept: template drift is often in them), or None."""
    name = collector.settings.tokenizer
    pipeline = getattr(collector, "pipeline", None)
    if not name or pipeline is None:
        return None
    try:
        tokenizer = pipeline.tokenizers.get(name)
    except Exception:  # noqa: BLE001 - no tokenizer: the ids are shown
        return None
    return lambda ids: byte_level.decode(tokenizer, ids, False)


def trajectory_truth(index: ReadStore, trace_id: str, decode: Callable[[list[int]], str] | None,
                     turns: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Blocking: one trajectory's truth; ``turns`` (the conversation view's) gain their ``drift``."""
    found = index.truth_detail(trace_id)
    by_span = found.pop("turn_drift")
    trainer = found.get("trainer")
    if trainer is not None:
        for key in ("was", "now"):
            if isinstance(trainer.get(key), list) and decode is not None:
                try:
                    trainer[key + "_text"] = decode(trainer[key])
                except Exception:  # noqa: BLE001 - ids the tokenizer refuses: shown as ids
                    trainer[key + "_text"] = None
    for entry in by_span.values():
        decode_windows(entry, decode)
    order = {t["span_id"]: t.get("index") for t in turns or []}
    for turn in turns or []:
        if turn["span_id"] in by_span:
            turn["drift"] = by_span[turn["span_id"]]
    found["turns"] = [{"span_id": sid, "turn": order.get(sid), **entry} for sid, entry in by_span.items()]
    found["turns"].sort(key=lambda t: (t["turn"] is None, t["turn"] or 0))
    return found


def add_trainer_logprobs(view: dict[str, Any] | None, index: ReadStore) -> None:
    """Blocking: the token view's tokens gain the trainer's ``old_log_probs`` (``trainer_logprob``) and
    ``logprob_diff`` (trainer − rollout) where the trainer trained on them; each span its max |Δ|.

    Turns' generated tokens are numbered in start order, as the comparison numbers them; the agent
    loop's whole output maps its mask-1 tokens in order (VERL's layout). Nothing without a trainer row.
    """
    if not view or not view.get("spans"):
        return
    try:
        index.refresh(budget_s=0.3)  # the trainer's row may have come after the index last caught up
        detail = index.trainer_detail(view["trace_id"])
    except INDEX_ERRORS:
        return
    if detail is None:
        return
    trainer = detail["trainer_logprobs"]
    view["trainer"] = {k: detail.get(k) for k in ("tt_mismatch", "lp_compared", "lp_mean", "lp_p99", "lp_max")}
    at = 0
    for span in view["spans"]:
        generated = 0 if span["aggregate"] else None
        worst = None
        for token in span["tokens"]:
            if span["aggregate"]:
                if token.get("mask") != 1:
                    continue
                index_ = generated
                generated += 1  # type: ignore[operator]
            else:
                index_ = at
                at += 1
            mine = trainer[index_] if index_ is not None and index_ < len(trainer) else None
            if mine is None:
                continue
            token["trainer_logprob"] = mine
            if token.get("logprob") is not None:
                token["logprob_diff"] = mine - token["logprob"]
                worst = abs(token["logprob_diff"]) if worst is None else max(worst, abs(token["logprob_diff"]))
        span["max_logprob_diff"] = worst


def add_truth(view: dict[str, Any], collector: StoreOwner, index: ReadStore) -> None:
    """Blocking: the viewer's trajectory page gains drift at each turn and the reward panel's data."""
    try:
        view["truth"] = trajectory_truth(index, view["trace_id"], decoder_of(collector), view.get("turns"))
    except INDEX_ERRORS:  # the index cannot catch up (a full disk): the page shows the rest
        view["truth"] = None


def build_router(collector: StoreOwner, index: ReadStore, api_auth: Callable[..., Any], catch_up_s: float) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/trajectories/{trace_id}/truth", dependencies=[Depends(api_auth)])
    async def truth(trace_id: str) -> Any:
        """Drift per turn, reward components and ground truth of one trajectory (issue 29)."""
        await asyncio.to_thread(caught_up, index, catch_up_s)
        summary = await asyncio.to_thread(read_by_id, collector.spool, trace_id, index.summary)  # the viewer's short ids too
        trace_id = summary["trace_id"]
        turn_rows = await asyncio.to_thread(_turn_order, collector, trace_id)
        # the decoder too: its first call loads the tokenizer and checks its byte table (~1 s), never on the loop
        found = await asyncio.to_thread(lambda: trajectory_truth(index, trace_id, decoder_of(collector), turn_rows))
        return Response(orjson.dumps({"trace_id": trace_id, "summary": summary, **found}), media_type="application/json")

    return router


def _turn_order(collector: StoreOwner, trace_id: str) -> list[dict[str, Any]]:
    """The trajectory's turns numbered as the conversation view numbers them (by start time)."""
    from ..shape import shape
    from ..spool.query import get_trajectory

    found = get_trajectory(collector.spool, trace_id)
    if found is None:
        return []
    return [{"span_id": t["span_id"], "index": t["index"]} for t in shape(found)["turns"]]
