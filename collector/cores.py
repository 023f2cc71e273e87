"""How many CPU cores this process may use: its affinity mask, capped by a cgroup CPU quota.

``os.cpu_count()`` reports the host's cores; a container limited to 2 CPUs on a 64-core node
must not start 64 worker processes. cgroup v2 (``cpu.max``: "QUOTA PERIOD" or "max PERIOD")
and v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) quotas are read; a fractional quota is
rounded down (a worker per whole core), never below 1.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_quota(root: Path = CGROUP) -> float | None:
    """CPUs the cgroup quota allows (e.g. 1.5), or None when unlimited or unknown."""
    v2 = _read(root / "cpu.max")
    if v2:
        parts = v2.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                quota, period = int(parts[0]), int(parts[1])
            except ValueError:
                return None
            return quota / period if quota > 0 and period > 0 else None
        return None
    quota_s, period_s = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
    if quota_s is None or period_s is None:
        quota_s, period_s = _read(root / "cpu.cfs_quota_us"), _read(root / "cpu.cfs_period_us")
    try:
        quota, period = int(quota_s or "-1"), int(period_s or "0")
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cores(root: Path = CGROUP) -> int:
    """Cores this process may run on (sched_getaffinity), capped by the cgroup quota; at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_quota(root)
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)


#: below this many cores the pool is not started by default: the ingest process (HTTP, sampling,
#: the spool writer, Weave forwarding) needs most of a core itself, and on 2 cores 2 workers beside
#: it were measured slower than the single process (docs/performance.md, "Worker processes")
MIN_CORES_FOR_POOL = 3


def default_workers(cores: int | None = None) -> int:
    """TRACECAR_WORKERS when unset: the cores this container may use, or 1 (no pool) below
    :data:`MIN_CORES_FOR_POOL`."""
    n = available_cores() if cores is None else cores
    return n if n >= MIN_CORES_FOR_POOL else 1
