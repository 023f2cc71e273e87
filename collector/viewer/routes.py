"""The local trajectory viewer: a page under ``/ui/`` and the read-only JSON it draws from.

For clusters without W&B access the embedded store is otherwise only readable from a CLI.
Everything the page needs is served from this process (the chart library is vendored under
``static/vendor/``), and the page's Content-Security-Policy allows no other origin.

Access is the API's: with ``TRACECAR_TOKEN`` set, every route here needs it, as an
``Authorization: Bearer`` header, or (for a browser) once as ``/ui/?token=...``, which sets an
HttpOnly cookie and redirects to drop the token from the address bar. The cookie holds an
HMAC of the token, not the token, and is honoured on ``/ui`` only, so it reads traces but can
never write them. All comparisons are constant-time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import mimetypes
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from ..bearer import bearer_matches
from ..json_out import dumps_deep
from ..loudness import RateLimited, describe_error
from ..query_params import ATTR_QUERY, INT64_MAX, OptionalInt64, attribute_filters, sample_index_filter
from ..read_store import ReadStore
from ..shape import shape
from ..spool.query import get_trajectory
from . import StoreOwner
from .index import SORTS, ListFilter
from .list_api import INDEX_ERRORS, read_index, viewer_fresh
from .search import QUERY_MAX_CHARS
from .stores import open_read_store
from .tokens import trajectory_tokens
from .truth_api import TruthFilters, add_trainer_logprobs, add_truth

log = logging.getLogger("tracecar.collector.viewer")

STATIC = Path(__file__).with_name("static")
COOKIE = "tracecar_viewer"
PREFIX = "/ui"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff",
                "Cache-Control": "no-cache"}
SORT_PATTERN = "^(" + "|".join(SORTS) + ")$"

_LOGIN_PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>tracecar: token needed</title></head>
<body>
<h1>tracecar viewer</h1><p>This collector requires its access token (<code>TRACECAR_TOKEN</code>).
Open <code>/ui/?token=YOUR_TOKEN</code> once; the browser then keeps a cookie for this page.</p></body></html>"""


class ViewerAuth:
    """The API's bearer token, plus a browser cookie derived from it; constant-time checks."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None
        self.cookie = hmac.new(self._token, b"tracecar viewer cookie v1", hashlib.sha256).hexdigest() if self._token else None

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def token_matches(self, presented: str) -> bool:
        return self._token is not None and hmac.compare_digest(presented.encode(), self._token)

    def allowed(self, request: Request) -> bool:
        if self._token is None:
            return True
        by_header = bearer_matches(request.headers.get("authorization", ""), self._token)
        cookie = request.cookies.get(COOKIE)
        by_cookie = cookie is not None and self.cookie is not None and hmac.compare_digest(cookie.encode(), self.cookie.encode())
        return by_header or by_cookie

    async def __call__(self, request: Request) -> None:
        """A coroutine, as BearerAuth: FastAPI would run a plain function in its thread pool."""
        if not self.allowed(request):
            raise HTTPException(status_code=401, headers={"WWW-Authenticate": "Bearer"}, detail={
                "field": "Authorization", "reason": "missing or wrong token: send the bearer token, or open /ui/?token=..."})


def _static_files() -> dict[str, Path]:
    """Only files shipped in static/ are served: no path from a request reaches the filesystem."""
    if not STATIC.is_dir():
        return {}
    return {p.relative_to(STATIC).as_posix(): p for p in STATIC.rglob("*") if p.is_file() and p.name != "index.html"}


def _json(payload: Any) -> Response:
    """orjson, also for values nested past its 255 levels (a deep trajectory: see json_out)."""
    return Response(dumps_deep(payload, option=orjson.OPT_NON_STR_KEYS), media_type="application/json",
                    headers={"Cache-Control": "no-store"})


class ViewerRouter(APIRouter):
    """The viewer's routes, and what the group export API shares with them (set by :func:`build_router`)."""

    trajectory_index: ReadStore
    fresh: Callable[[], dict[str, Any]]
    viewer_auth: ViewerAuth


_catch_up_failures = RateLimited()


def _listed_through(index: ReadStore) -> int:
    """The spool seq through which ``index`` has listed every span, after letting it catch up for a moment (held
    spans released meanwhile included): retention moves nothing past it to the archive. A failing catch-up (a
    full disk under the index) answers what the index has, and says so (eviction waits for the index)."""
    try:
        index.refresh(budget_s=2.0, all_held=True)
    except Exception as exc:  # noqa: BLE001 - eviction goes on with what the index has listed
        count = _catch_up_failures.hit()
        if count is not None:
            log.warning("the trajectory index cannot catch up before eviction (%d time(s) since last said): retention "
                        "moves only what it listed: %s", count, describe_error(exc), extra={"event": "index_behind_eviction"})
    return index.listed_through()


def build_router(collector: StoreOwner, token: str | None) -> ViewerRouter:
    """The viewer's routes for one collector; the trajectory index closes with the app."""
    settings = collector.settings
    index = open_read_store(collector.spool.path, settings,
                            prune_deleted=not collector.spool.local_only and not settings.keep_forwarded,
                            on_error=collector.metrics.store_errors.labels(store=settings.store).inc)
    if settings.store == "clickhouse" and settings.store_archive:
        from .clickhouse_spans import ClickHouseSpanArchive  # imports chDB: only with the ClickHouse store
        from .clickhouse_store import ClickHouseStore

        assert isinstance(index, ClickHouseStore)
        collector.spool.archive = ClickHouseSpanArchive(index)  # retention moves evicted trajectories there
        # and evicts only what is listed: an archived trajectory is found through its list row. (Without the archive
        # the index stays lazy, folded only when read: an evicted trajectory's spans are gone either way.)
        collector.spool.readers_through = functools.partial(_listed_through, index)
    auth = ViewerAuth(token)
    files = _static_files()

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(index.close)

    router = ViewerRouter(prefix=PREFIX, lifespan=lifespan, include_in_schema=False)
    guarded = APIRouter(dependencies=[Depends(auth)])

    def fresh() -> dict[str, Any]:
        return viewer_fresh(index)

    @router.get("")
    async def bare() -> Any:
        return RedirectResponse(PREFIX + "/", status_code=307)

    @router.get("/")
    async def page(request: Request, token: str | None = None) -> Any:
        if token is not None and auth.enabled:
            if not auth.token_matches(token):
                return HTMLResponse(_LOGIN_PAGE, status_code=401, headers=PAGE_HEADERS)
            response = RedirectResponse(PREFIX + "/", status_code=303)
            response.set_cookie(COOKIE, auth.cookie or "", httponly=True, samesite="strict", path=PREFIX)
            return response
        if not auth.allowed(request):
            return HTMLResponse(_LOGIN_PAGE, status_code=401, headers=PAGE_HEADERS)
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    @guarded.get("/static/{path:path}")
    async def static(path: str) -> Any:
        found = files.get(path)
        if found is None:
            raise HTTPException(404, detail={"field": "path", "reason": f"no static file {path!r}"})
        media = mimetypes.guess_type(found.name)[0] or "application/octet-stream"
        if media.startswith("text/") or media.endswith("javascript"):
            media += "; charset=utf-8"
        return FileResponse(found, media_type=media, headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})

    @guarded.get("/api/status")
    async def status() -> Any:
        return _json({"index": await asyncio.to_thread(fresh), "auth": auth.enabled})

    @guarded.get("/api/facets")
    async def facets() -> Any:
        state = await asyncio.to_thread(fresh)
        return _json({**await asyncio.to_thread(read_index, index.facets), "index": state})

    @guarded.get("/api/overview")
    async def overview(experiment: str | None = None,
                       split: str = Query("train", pattern="^(train|validation|all)$"),
                       reward_low: float | None = Query(None, allow_inf_nan=False),
                       reward_high: float | None = Query(None, allow_inf_nan=False)) -> Any:
        """Per-step reward distribution of one experiment (default: the latest), kept per rule.

        ``experiment=`` (empty) is the trajectories sent without an experiment name. ``reward_low`` and
        ``reward_high`` (both or neither): the histogram's range instead of the rewards' own (several gateways'
        overviews binned alike, viewer/federation.py).
        """
        if (reward_low is None) != (reward_high is None) or (reward_low is not None and reward_high is not None
                                                             and reward_high < reward_low):
            raise HTTPException(422, detail={"field": "reward_high", "reason": "reward_low and reward_high come together, "
                                                                              "reward_high >= reward_low"})
        bounds = (reward_low, reward_high) if reward_low is not None and reward_high is not None else None
        state = await asyncio.to_thread(fresh)
        if experiment is None:
            known = (await asyncio.to_thread(read_index, index.facets))["experiments"]
            experiment = known[0]["experiment"] if known else None
        validate = {"train": False, "validation": True, "all": None}[split]
        result = await asyncio.to_thread(read_index, index.overview, experiment or None, validate, 12, bounds)
        return _json({**result, "split": split, "index": state})

    @guarded.get("/api/trajectories")
    async def trajectories(
        truth: TruthFilters, experiment: str | None = None, step: OptionalInt64 = None, step_min: OptionalInt64 = None,
        step_max: OptionalInt64 = None, sample_index: str | None = Query(None, max_length=256), rollout_n: OptionalInt64 = None,
        validate: bool | None = None, kept_because: str | None = None, reward_min: float | None = None,
        reward_max: float | None = None, has_error: bool | None = None, worker: str | None = None,
        trained: bool | None = None, filtered_by: str | None = Query(None, max_length=256),
        node: str | None = Query(None, max_length=256),
        sort: str = Query("start", pattern=SORT_PATTERN), order: str = Query("desc", pattern="^(asc|desc)$"),
        limit: int = Query(50, ge=1, le=500), offset: int = Query(0, ge=0, le=INT64_MAX),
        q: str | None = Query(None, max_length=QUERY_MAX_CHARS), attr: list[str] | None = ATTR_QUERY,
    ) -> Any:
        """One page of trajectory summaries with their previews; unscored ones sort last either way.

        ``q``: words that must all occur in the first prompt or the last response (search.py).
        """
        flt = ListFilter(experiment, step, step_min, step_max, sample_index_filter(sample_index), rollout_n, validate, kept_because or None,
                         reward_min, reward_max, has_error, worker, trained, filtered_by or None, node or None)
        flt.q = q or None
        flt.attributes = attribute_filters(attr)
        for key, value in truth.items():  # drift, reward_where, fate, refill, trained_other, lp_delta_min (truth_api.py)
            setattr(flt, key, value)
        state = await asyncio.to_thread(fresh)
        page = await asyncio.to_thread(read_index, index.list, flt, sort=sort, descending=order == "desc", limit=limit,
                                       offset=offset)
        return _json({**page, "index": state})

    @guarded.get("/api/trajectories/{trace_id}")
    async def trajectory(trace_id: str, tree: bool = True) -> Any:
        """One trajectory as a conversation (turns, tool calls, reward, metrics) and its span tree."""
        found = await asyncio.to_thread(get_trajectory, collector.spool, trace_id, settings.max_tree_depth)
        if found is None:
            raise HTTPException(404, detail={"field": "trace_id", "reason": f"no trajectory {trace_id!r} in the store"})
        view = await asyncio.to_thread(shape, found)
        try:  # the trajectory itself comes from the spool; its summary row is a bonus a full disk may withhold
            await asyncio.to_thread(fresh)
            view["summary"] = await asyncio.to_thread(index.summary, trace_id)
        except (HTTPException, *INDEX_ERRORS):
            view["summary"] = None
        if view["summary"] is not None:
            await asyncio.to_thread(add_truth, view, collector, index)
        if tree:
            view["tree"] = found["root"]
            view["tree_depth_cap"] = found["depth_cap"]
        return await asyncio.to_thread(_json, view)

    @guarded.get("/api/trajectories/{trace_id}/tokens")
    async def tokens(trace_id: str, lowest: int = Query(10, ge=0, le=1000)) -> Any:
        """The token view (see spool.tokens): the same JSON as ``GET /v1/trajectories/{id}/tokens``."""
        found = await asyncio.to_thread(trajectory_tokens, collector.spool, trace_id, lowest)
        if found is None:
            raise HTTPException(404, detail={"field": "trace_id", "reason": f"no trajectory {trace_id!r} in the store"})
        await asyncio.to_thread(add_trainer_logprobs, found, index)
        return await asyncio.to_thread(_json, found)

    router.include_router(guarded)
    router.trajectory_index, router.fresh, router.viewer_auth = index, fresh, auth  # for group_export_api
    return router
