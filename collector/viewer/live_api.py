"""HTTP routes of the live view: trajectories still running, with their spans so far.

``GET /v1/live`` takes the API's token; ``GET /ui/api/live`` is the same answer for the viewer
page (its token or cookie), which polls it while a step is on screen. Reads only (see
:mod:`tracecar.collector.spool.live`): nothing partial is moved towards the backend by looking.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from ..processors.open_calls import OpenCalls
from ..query_params import OptionalInt64, sample_index_filter
from ..spool.live import running_trajectories
from ..trajectory_filter import TrajectoryFilter
from . import StoreOwner


def build_router(collector: StoreOwner, api_auth: Callable[..., Any], viewer_auth: Callable[..., Any],
                 open_calls: OpenCalls) -> APIRouter:
    router = APIRouter()
    settings = collector.settings

    async def live(experiment: str | None = None, step: OptionalInt64 = None, validate: bool | None = None,
                   worker: str | None = Query(None, max_length=256), sample_index: str | None = Query(None, max_length=256),
                   limit: int = Query(100, ge=1, le=1000)) -> Any:
        """Running trajectories (spans stored, root not yet), the longest idle first.

        ``experiment=`` (empty) is the trajectories sent without an experiment name.
        """
        flt = TrajectoryFilter(experiment=experiment, step=step, validate=validate, worker=worker,
                               sample_index=sample_index_filter(sample_index))
        now = time.time()
        answer = await asyncio.to_thread(running_trajectories, collector.spool, flt, window_s=settings.live_window_s,
                                         max_scan_spans=settings.live_max_scan_spans, limit=limit, now=now,
                                         open_calls=lambda: open_calls.snapshot(now - settings.live_window_s))
        return Response(orjson.dumps(answer, option=orjson.OPT_NON_STR_KEYS), media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    router.add_api_route("/v1/live", live, methods=["GET"], dependencies=[Depends(api_auth)])
    router.add_api_route("/ui/api/live", live, methods=["GET"], dependencies=[Depends(viewer_auth)], include_in_schema=False)
    return router
