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
from typing import Any, TypeVar

from fastapi import HTTPException

from ..loudness import RateLimited
from ..read_store import ReadStore, StoreUnavailable
from ..trajectory_filter import TrajectoryFilter

_index_failures = RateLimited()  # a full disk fails every list request: say it once a minute, with the count
_store_failures = RateLimited()


def index_unavailable(exc: Exception, on_behind: Callable[[], None] = lambda: None) -> HTTPException:
    """The 503 for an index that cannot be brought up to date (a full disk), logged once a minute.

    Every reader of the index (this list, the viewer's pages, groups, per-step health) answers
    this rather than a 500: the spool's data is intact, only the index beside it cannot grow.
    """
    if isinstance(exc, StoreUnavailable):  # the ClickHouse store's engine: its name, not a disk the user can free
        count = _store_failures.hit()
        if count is not None:
            logging.getLogger("tracecar.viewer").warning("%s store refused a statement (%d request(s) refused): %s",
                                                         exc.store, count, exc)
        on_behind()
        return HTTPException(503, detail=f"{exc.public}; retry later (the collector's log has the details)",
                             headers={"Retry-After": "2"})
    count = _index_failures.hit()
    if count is not None:
        logging.getLogger("tracecar.viewer").warning("trajectory index cannot catch up (%d request(s) refused): %s", count, exc)
    on_behind()
    return HTTPException(503, detail=f"trajectory index cannot catch up ({exc}); retry later (a full disk: free space "
                                     "beside the spool)",
                         headers={"Retry-After": "2"})


INDEX_ERRORS = (sqlite3.OperationalError, OSError)  # what a full disk raises from the index's writes
T = TypeVar("T")


def read_index(read: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Runs one blocking read of (or catch-up of) the trajectory index: every index-backed answer
    (lists, facets, overview, groups, per-step health, export) goes through here, so a full disk
    is one 503 + Retry-After naming it, never a 500 (the index lives beside the spool)."""
    try:
        return read(*args, **kwargs)
    except INDEX_ERRORS as exc:
        raise index_unavailable(exc) from None


def caught_up(index: ReadStore, budget_s: float, on_behind: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Lets the index catch up for up to ``budget_s``, then says how far behind it is."""
    try:
        fresh = index.refresh(budget_s=budget_s, all_held=True)
    except INDEX_ERRORS as exc:
        raise index_unavailable(exc, on_behind) from None
    if not fresh:
        index.catch_up_in_background()
        on_behind()
    return index.status()


def viewer_fresh(index: ReadStore) -> dict[str, Any]:
    """The viewer's catch-up: index what arrived since the last request (bounded), then its state.

    A backlog (a big store opened for the first time) is left to the background thread, so
    requests meanwhile answer at once from what is indexed so far; a full disk is the same 503
    as :func:`caught_up`'s.
    """
    try:
        if not index.catching_up() and not index.refresh(budget_s=0.3):
            index.catch_up_in_background()
    except INDEX_ERRORS as exc:
        raise index_unavailable(exc) from None
    return index.status()


def list_page(index: ReadStore, flt: TrajectoryFilter, *, sort: str, descending: bool, limit: int, offset: int,
              budget_s: float, on_behind: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """One page of summaries (with their prompt/response previews), the total, and the index's state."""
    state = caught_up(index, budget_s, on_behind)
    page = read_index(index.list, flt, sort=sort, descending=descending, limit=limit, offset=offset)
    if flt.q:
        page["q"] = flt.q
    return {**page, "index": state}
