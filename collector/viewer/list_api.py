"""``GET /v1/trajectories``: the API's trajectory list, answered from the viewer's trajectory index.

It used to be SQL over the spans (every trajectory's span count, error flag, annotated reward and
trainer values aggregated per page): 3.6-3.8 s a page on a million spans, 7.8 s with
``trained=false``. The viewer's index already keeps one row per trajectory with an index per
sort key, so the API, the viewer's ``/ui/api/trajectories``, ``q=`` search, export and groups
now share one list and one filter (collector/trajectory_filter.py); a page is tens of ms.

An API caller lists right after it ingested, so before answering the index is let catch up with
the store for up to ``TRACECAR_LIST_CATCH_UP_S`` (held spans whose step was just decided
included); past that the answer says so in ``index`` (``caught_up: false``, ``behind_spans``)
and the backlog is indexed in the background.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException

from ..loudness import RateLimited
from ..trajectory_filter import TrajectoryFilter
from .index import TrajectoryIndex

_index_failures = RateLimited()  # a full disk fails every list request: say it once a minute, with the count


def caught_up(index: TrajectoryIndex, budget_s: float, on_behind: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Lets the index catch up for up to ``budget_s``, then says how far behind it is."""
    try:
        fresh = index.refresh(budget_s=budget_s, all_held=True)
    except (sqlite3.OperationalError, OSError) as exc:  # a full disk: the index cannot be brought up to date
        count = _index_failures.hit()
        if count is not None:
            logging.getLogger("tracecar.viewer").warning("trajectory index cannot catch up (%d request(s) refused): %s", count, exc)
        on_behind()
        raise HTTPException(503, detail=f"trajectory index cannot catch up ({exc}); retry later (a full disk: free space "
                                        "beside the spool)",
                            headers={"Retry-After": "2"}) from None
    if not fresh:
        index.catch_up_in_background()
        on_behind()
    return index.status()


def list_page(index: TrajectoryIndex, flt: TrajectoryFilter, *, sort: str, descending: bool, limit: int, offset: int,
              budget_s: float, on_behind: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """One page of summaries (with their prompt/response previews), the total, and the index's state."""
    state = caught_up(index, budget_s, on_behind)
    page = index.list(flt, sort=sort, descending=descending, limit=limit, offset=offset)
    if flt.q:
        page["q"] = flt.q
    return {**page, "index": state}
