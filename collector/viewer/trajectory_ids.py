"""Read one trajectory by the id a user typed: the full id, the viewer's short form or a unique prefix.

Every route that takes a ``trace_id`` (the tree, tokens, training truth) reads through
:func:`read_by_id`, so that every id the viewer shows works in every command and route alike; a
404 says which trajectories match, or the sampling decision that dropped it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import HTTPException

from ..spool.store import Spool
from ..spool.trace_ids import resolve


def read_by_id(spool: Spool, trace_id: str, read: Callable[[str], Any]) -> Any:
    """Blocking: ``read`` the trajectory ``trace_id`` names (tried as given first); 404 if none."""
    found = read(trace_id)
    if found is not None:
        return found
    resolution = resolve(spool, trace_id)
    found = read(resolution.trace_id) if resolution.trace_id is not None else None
    if found is None:
        detail: dict[str, Any] = {"field": "trace_id", "reason": resolution.reason or f"no trajectory {trace_id!r} in the store"}
        if resolution.decision is not None:
            detail["sampling_decision"] = resolution.decision
        if resolution.candidates:
            detail["candidates"] = resolution.candidates
        raise HTTPException(404, detail=detail)
    return found
