"""HTTP routes of the GRPO group view and the dataset export.

``GET /v1/groups`` and ``GET /v1/export`` take the API's token; ``GET /ui/api/groups`` is the
same answer for the viewer page (its token or cookie). All read the viewer's trajectory index,
the one summary table of the store, so there is no second query layer to keep in step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.responses import Response, StreamingResponse

from ..loudness import RateLimited
from ..query_params import ATTR_QUERY, INT64_MAX, Int64, OptionalInt64, attribute_filters, sample_index_filter
from ..read_store import ReadStore
from ..spool.full_payloads import full_spans, spool_loader
from ..spool.query import get_trajectory, trajectory_loader
from ..spool.store import Spool
from . import StoreOwner
from .export import FORMATS, MEDIA_TYPES, IndexBehind, export_chunks, parquet_available, settle
from .groups import GROUP_SORTS, build_groups
from .index import ListFilter
from .list_api import read_index
from .node_scope import mark_partial_groups, node_scope
from .search import QUERY_MAX_CHARS
from .truth_api import TruthFilters

log = logging.getLogger("tracecar.export")
_skips = RateLimited(10.0)  # rows left out of exports: logged at once, then at most every 10 s with the count
GROUP_SORT_PATTERN = "^(" + "|".join(GROUP_SORTS) + ")$"
FORMAT_PATTERN = "^(" + "|".join(FORMATS) + ")$"
MAX_STEP_TRAJECTORIES = 200_000  # one step's summaries are grouped in memory: bounded


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS), media_type="application/json",
                    headers={"Cache-Control": "no-store"})


def root_and_annotations(spool: Spool, trace_id: str) -> dict[str, Any] | None:
    """What a group without diffs needs of a trajectory (its advantage): the root and annotations only."""
    rows = spool.query("SELECT seq, span_id, kind, payload FROM spans WHERE trace_id = ? AND (parent_id IS NULL OR kind = 'annotation') "
                       "ORDER BY seq", [trace_id])
    load = spool_loader(spool.query)
    if spool.may_be_archived(trace_id):  # retention moved some of it to the archive (spool/archive.py)
        every = spool.with_archive(trace_id, rows)
        load = trajectory_loader(spool, trace_id, every)
        rows = sorted((r for r in every if r.get("parent_id") is None or r["kind"] == "annotation"), key=lambda r: r["seq"])
    if not rows:
        return None
    spans = [orjson.loads(r["payload"]) for r in rows]
    full_spans(spans, load)  # a root or annotation another client sent with a prompt reference
    root: dict[str, Any] = next((s for k, s in zip((r["kind"] for r in rows), spans) if k != "annotation"), {"attributes": {}})
    return {"trace_id": trace_id, "root": root, "annotations": [s for r, s in zip(rows, spans) if r["kind"] == "annotation"]}


def sampled_out_of_step(spool: Spool, experiment: str | None, step: int, validate: bool) -> dict[str, int]:
    """Rollouts of each sample index a tail budget dropped in this step (any reason), by the index as text:
    the groups they belonged to are partial."""
    rows = spool.query("SELECT sample_index, COUNT(*) AS n FROM trajectory_decisions WHERE step = ? AND experiment IS ? "
                       "AND validate = ? AND keep = 0 AND sample_index IS NOT NULL GROUP BY sample_index",
                       [step, experiment, int(validate)])
    return {str(r["sample_index"]): r["n"] for r in rows}


def groups_of_step(collector: StoreOwner, index: ReadStore, experiment: str | None, step: int,
                   validate: bool, **options: Any) -> dict[str, Any]:
    """Blocking: the step's summaries from the index, grouped; trajectories read for the page only."""
    if experiment is None:  # as the overview: the latest experiment
        known = index.facets()["experiments"]
        experiment = known[0]["experiment"] if known else None
    elif experiment == "":  # experiment= (empty): the trajectories sent without one, as on every list
        experiment = None
    flt = ListFilter(experiment=experiment if experiment is not None else "", step=step, validate=validate)
    page = index.list(flt, sort="sample_index", descending=False, limit=MAX_STEP_TRAJECTORIES)
    truncated = page["total"] > len(page["trajectories"])
    truth = {k: v for k, v in (options.pop("truth", None) or {}).items() if v is not None}
    if truth:  # groups with a rollout that matches the truth or attribute filters (drift, where, fate, attr...), kept whole
        for key, value in truth.items():
            setattr(flt, key, value)
        hits = index.list(flt, sort="sample_index", descending=False, limit=MAX_STEP_TRAJECTORIES, previews=False)
        keys = {(type(r["sample_index"]).__name__, r["sample_index"]) for r in hits["trajectories"]}
        page["trajectories"] = [r for r in page["trajectories"] if (type(r["sample_index"]).__name__, r["sample_index"]) in keys]
    spool = collector.spool
    load = ((lambda trace_id: get_trajectory(spool, trace_id)) if options.get("diff", True)
            else (lambda trace_id: root_and_annotations(spool, trace_id)))
    result = build_groups(page["trajectories"], load, sampled_out=sampled_out_of_step(spool, experiment, step, validate), **options)
    return {"experiment": experiment, "step": step, "validate": validate,
            "truncated": truncated, **result}


def build_router(collector: StoreOwner, index: ReadStore, fresh: Callable[[], dict[str, Any]],
                 api_auth: Callable[..., Any], viewer_auth: Callable[..., Any]) -> APIRouter:
    router = APIRouter()

    async def groups(truth: TruthFilters, step: Int64, experiment: str | None = None, validate: bool = False,
                     sort: str = Query("sample_index", pattern=GROUP_SORT_PATTERN), sample_index: str | None = Query(None, max_length=256),
                     diff: bool = True, limit: int = Query(50, ge=1, le=1000), offset: int = Query(0, ge=0, le=INT64_MAX),
                     attr: list[str] | None = ATTR_QUERY) -> Any:
        """Per sample index of one step: rollouts ranked by reward, group stats, diffs against the best.
        The list's truth and attribute filters keep the groups with a matching rollout, whole."""
        state = await asyncio.to_thread(fresh)
        result = await asyncio.to_thread(read_index, groups_of_step, collector, index, experiment, step, validate, sort=sort,
                                         sample_index=sample_index or None, limit=limit, offset=offset, diff=diff,
                                         truth={**truth, "attributes": attribute_filters(attr) or None})
        scope = node_scope(collector.settings)  # a node with a gateway: its groups may be partial
        if scope is not None:
            scope["partial_groups_on_page"] = mark_partial_groups(result["groups"])
            result["scope"] = scope
        return _json({**result, "index": state})

    router.add_api_route("/v1/groups", groups, methods=["GET"], dependencies=[Depends(api_auth)])
    router.add_api_route("/ui/api/groups", groups, methods=["GET"], dependencies=[Depends(viewer_auth)],
                         include_in_schema=False)

    @router.get("/v1/export", dependencies=[Depends(api_auth)])
    async def export(
        truth: TruthFilters, format: str = Query("jsonl", pattern=FORMAT_PATTERN), experiment: str | None = None,
        step: OptionalInt64 = None, step_min: OptionalInt64 = None, step_max: OptionalInt64 = None,
        sample_index: str | None = Query(None, max_length=256),
        rollout_n: OptionalInt64 = None, validate: bool | None = None, kept_because: str | None = None,
        reward_min: float | None = None, reward_max: float | None = None, has_error: bool | None = None,
        worker: str | None = None, trained: bool | None = None, filtered_by: str | None = Query(None, max_length=256),
        node: str | None = Query(None, max_length=256), q: str | None = Query(None, max_length=QUERY_MAX_CHARS),
        token_ids: bool = False, limit: int | None = Query(None, ge=1, le=INT64_MAX),
        attr: list[str] | None = ATTR_QUERY,
    ) -> Any:
        """Selected trajectories as a dataset file (JSONL or Parquet), streamed.

        Every filter of the trajectory list (``GET /v1/trajectories``), the trainer's (``trained``,
        ``filtered_by``) and text search (``q``) included: one filter (trajectory_filter.py).
        """
        if format == "parquet" and not parquet_available():
            raise HTTPException(501, detail={"field": "format", "reason": "parquet needs pyarrow: pip install 'tracecar[export]'"})
        try:
            await asyncio.to_thread(read_index, settle, index)
        except IndexBehind as exc:
            raise HTTPException(503, detail={"field": None, "reason": str(exc)}, headers={"Retry-After": "10"}) from exc
        flt = ListFilter(experiment=experiment, step=step, step_min=step_min, step_max=step_max,
                         sample_index=sample_index_filter(sample_index), rollout_n=rollout_n, validate=validate,
                         kept_because=kept_because, reward_min=reward_min, reward_max=reward_max, has_error=has_error,
                         worker=worker, trained=trained, filtered_by=filtered_by, node=node, q=q, attributes=attribute_filters(attr),
                         **truth)
        skipped = collector.metrics.export_rows_skipped.labels(format=format)

        def on_skip(trace_id: str, reason: str) -> None:  # the 200 is sent: the row is named in the log and counted
            skipped.inc()
            count = _skips.hit()
            if count is not None:
                log.warning("export: trajectory %s left out of a %s export (%d since the last such line): %s",
                            trace_id, format, count, reason, extra={"event": "export_row_skipped", "trace_id": trace_id})

        chunks = export_chunks(collector.spool, index, flt, format, token_ids=token_ids, limit=limit, on_skip=on_skip)
        filename = f"tracecar-export.{format}"
        return StreamingResponse(chunks, media_type=MEDIA_TYPES[format],
                                 headers={"Content-Disposition": f'attachment; filename="{filename}"',
                                          "Cache-Control": "no-store"})

    # the viewer's list links its selection here (a download with the page's token or cookie)
    router.add_api_route("/ui/api/export", export, methods=["GET"], dependencies=[Depends(viewer_auth)], include_in_schema=False)
    return router
