"""The one read interface: what the list, groups, export, health, truth and viewer APIs ask of a store.

Before it, each read API held the SQLite trajectory index (viewer/index.py) and spoke to it
directly, so a second store (ClickHouse, for a gateway's whole job) would have meant touching
each of them. Now they hold a :class:`ReadStore`, made by ``viewer/stores.py`` as
``TRACECAR_STORE`` says; the SQLite index is one implementation (unchanged), the other is
``viewer/clickhouse_store.py``, and ``tests/test_read_store_contract.py`` asserts that every read
API answers the same on both. It is a shared module (not a folder) so that every layer that
reads may name it (tests/test_layout.py).

Every method is blocking (callers run them with ``asyncio.to_thread``) and thread-safe.
"""

from __future__ import annotations

import builtins  # ReadStore.list shadows the builtin in its class body
from typing import Any, Protocol, runtime_checkable

from .trajectory_filter import TrajectoryFilter


class StoreUnavailable(OSError):
    """The read store's engine refused a statement (a full disk, a damaged part, a bad query).

    ``public`` is what a reader may be told: the store's name and the engine's error name, never its
    message (which carries data paths, and for a server would carry its address). Every reader answers
    it as a 503 with ``Retry-After`` (viewer/list_api.py); the full message goes to the log.
    """

    def __init__(self, store: str, public: str, detail: str) -> None:
        super().__init__(detail)
        self.store, self.public = store, public


class StoreStartError(RuntimeError):
    """The read store cannot start (a ClickHouse server unreachable or refusing the store's tables, a server
    database that is another collector's): ``tracecar serve`` says it in one line and exits 2. The message
    names the engine and its error, never a URL's credentials."""


@runtime_checkable
class ReadStore(Protocol):
    """One row per trajectory, caught up with the spool by ``seq``; every read API's queries."""

    # ---- catching up with the spool -----------------------------------------------------------
    def refresh(self, budget_s: float = 0.3, *, all_held: bool = False) -> bool:
        """Takes in what the spool committed since, for up to ``budget_s``; True when caught up."""
        ...

    def catching_up(self) -> bool:
        """True while a background catch-up runs."""
        ...

    def catch_up_in_background(self) -> None:
        """Starts (once at a time) a thread that takes in the backlog."""
        ...

    def status(self) -> dict[str, Any]:
        """``indexed_seq``, ``latest_seq``, ``behind_spans``, ``caught_up``, ``held_spans`` (and the store's own)."""
        ...

    def close(self) -> None:
        ...

    # ---- queries ----------------------------------------------------------------------------------
    def list(self, flt: TrajectoryFilter, *, sort: str = "start", descending: bool = True, limit: int = 50,
             offset: int = 0, previews: bool = True) -> dict[str, Any]:
        """One page of summaries (``total``, ``trajectories``...); rows without the sort key last."""
        ...

    def step_counts(self, flt: TrajectoryFilter) -> dict[str, Any]:
        """Counts over a selection (``/v1/health?step=``)."""
        ...

    def summary(self, trace_id: str) -> dict[str, Any] | None:
        ...

    def trainer_detail(self, trace_id: str) -> dict[str, Any] | None:
        ...

    def truth_detail(self, trace_id: str) -> dict[str, Any]:
        ...

    def facets(self) -> dict[str, Any]:
        """Experiments (latest first) with step ranges and counts; kept rules; the trainer's; reward components."""
        ...

    def listed_through(self) -> int:
        """The spool seq through which every span is listed (held spans waited on excluded)."""
        ...

    def overview(self, experiment: str | None, validate: bool | None = False, bins: int = 12,
                 bounds: tuple[float, float] | None = None) -> dict[str, Any]:
        """Per step: reward distribution, best and worst, kept per rule (``bounds``: the histogram's reward range)."""
        ...

    def page_after(self, flt: TrajectoryFilter, after: int = 0, limit: int = 500) -> builtins.list[dict[str, Any]]:
        """Summaries in a stable order after ``cursor`` ``after`` (export's keyset walk)."""
        ...

