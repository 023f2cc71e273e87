"""Client drops: spans a worker lost before they reached the collector, as the worker says.

Each batch header carries the sender's running totals (``"dropped": {"queue_full": 12, ...}``,
since the worker process started). The collector keeps the last totals per worker and counts
the increase in ``tracecar_client_dropped_spans_total{reason}``, so a gap in traces caused by
the client shows in the collector's metrics, ``/v1/health`` and, from there, the trainer's W&B
run. Totals that go down (a worker restarted under the same id) start a new count. A malformed
field is ignored with a warning count: telemetry never costs the spans it came with.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

MAX_WORKERS = 65536  # workers remembered (least recently heard from forgotten first)
MAX_REASONS = 32  # reasons one header may carry
#: distinct reasons counted in all (each is a metric series): later new ones count as ``other``
MAX_DISTINCT_REASONS = 64
OTHER_REASON = "other"
_REASON = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def parse_dropped(value: Any) -> dict[str, int] | None:
    """The header's totals, or None when absent or malformed (the caller counts a warning)."""
    if not isinstance(value, dict) or len(value) > MAX_REASONS:
        return None
    out: dict[str, int] = {}
    for reason, count in value.items():
        if not isinstance(reason, str) or not _REASON.match(reason) or type(count) is not int or not 0 <= count < 2**63:
            return None
        out[reason] = count
    return out


class ClientDrops:
    """Last totals per worker; feeds the counter with the increase of each new header."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter
        self._last: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._reasons: set[str] = set()  # the label values in use (bounded: MAX_DISTINCT_REASONS)

    def observe(self, worker: str, totals: dict[str, int]) -> None:
        with self._lock:
            before = self._last.get(worker, {})
            for reason, total in totals.items():
                seen = before.get(reason, 0)
                increase = total - seen if total >= seen else total  # went down: a restarted worker
                if increase:
                    self.counter.labels(reason=self._label(reason)).inc(increase)
            self._last[worker] = totals
            self._last.move_to_end(worker)
            while len(self._last) > MAX_WORKERS:
                self._last.popitem(last=False)

    def _label(self, reason: str) -> str:
        """The reason as a label value: a client's names, but at most MAX_DISTINCT_REASONS series."""
        if reason in self._reasons:
            return reason
        if len(self._reasons) < MAX_DISTINCT_REASONS:
            self._reasons.add(reason)
            return reason
        return OTHER_REASON

    def by_worker(self) -> dict[str, dict[str, int]]:
        """The latest totals each worker reported (for /v1/health)."""
        with self._lock:
            return {w: dict(t) for w, t in self._last.items() if any(t.values())}
