"""``GET /v1/trajectories?q=...``: the API's text search, answered from the viewer's trajectory index.

The spool keeps spans, not text indexes; the viewer's index already holds one row per
trajectory and the previews' full-text table (search.py), so a search over a million spans is
an FTS lookup there rather than a scan of every payload. The index catches up on each call
(bounded, then in the background); ``index`` in the answer says how far behind it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..spool.query import TrajectoryFilter
from .index import ListFilter, TrajectoryIndex


def search_trajectories(index: TrajectoryIndex, fresh: Callable[[], dict[str, Any]], flt: TrajectoryFilter, q: str, *,
                        sort: str, descending: bool, limit: int, offset: int) -> dict[str, Any]:
    """One page of the trajectories matching ``q`` and the API's filters, with their previews."""
    state = fresh()
    wanted = ListFilter(experiment=flt.experiment, step=flt.step, step_min=flt.step_min, step_max=flt.step_max,
                        sample_index=flt.sample_index, rollout_n=flt.rollout_n, validate=flt.validate,
                        reward_min=flt.reward_min, reward_max=flt.reward_max, has_error=flt.has_error, worker=flt.worker,
                        trained=flt.trained, filtered_by=flt.filtered_by, q=q)
    page = index.list(wanted, sort=sort, descending=descending, limit=limit, offset=offset)
    return {"total": page["total"], "limit": limit, "offset": offset, "q": q, "trajectories": page["trajectories"],
            "index": state}
