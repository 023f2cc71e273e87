"""Viewer: the read side over the spool — the browser UI at ``/ui``, its trajectory index,
GRPO groups and dataset export (``/v1/groups``, ``/v1/export``).

``routes`` builds the ``/ui`` router, ``index`` keeps the per-trajectory summaries the lists sort
and filter on, ``groups`` and ``export`` read whole steps, ``group_export_api`` serves them.
The service mounts these routers; nothing here imports the service (``StoreOwner`` is what the
routers need from it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..metrics import Metrics
    from ..settings import CollectorSettings
    from ..spool.store import Spool


class StoreOwner(Protocol):
    """What the viewer's routers read from the running collector: its settings and its spool."""

    settings: CollectorSettings
    spool: Spool
    metrics: Metrics
