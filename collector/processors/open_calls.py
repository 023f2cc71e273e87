"""Open calls: calls that started and have not ended, as the clients' open markers say.

A span is sent when its call ends, so a call that hangs sends nothing. The client therefore
queues a small *open marker* when a call starts and sends it only if the call is still
running when the sender drains (every ``TRACECAR_FLUSH_INTERVAL_S``): the live view can then
name the tool call that hangs, and show a trajectory whose very first call hangs. Markers live
here, in memory only: never stored, never forwarded. One leaves when its span arrives, all of a
trajectory's when its root does; past ``TRACECAR_LIVE_MAX_OPEN_CALLS`` the oldest are forgotten
(counted), and ones older than ``TRACECAR_LIVE_WINDOW_S`` are not shown (a worker that died).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

OPEN_KIND = "open"
SUFFIX = ".open"  # a marker's span id is its call's id + this (never the same id in one batch)


class OpenCalls:
    def __init__(self, max_calls: int, forgotten: Any = None) -> None:
        self.max_calls = max_calls
        self.forgotten = forgotten  # a counter, incremented per marker forgotten at the bound
        self._calls: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._by_trace: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._calls)

    def opened(self, markers: Iterable[Mapping[str, Any]], now: float) -> None:
        with self._lock:
            for m in markers:
                span_id = m["span_id"].removesuffix(SUFFIX)
                attrs = m["attributes"]
                self._calls[span_id] = {
                    "span_id": span_id, "trace_id": m["trace_id"], "parent_id": m["parent_id"], "name": m["name"],
                    "start_time": m["start_time"], "worker": m.get("worker"), "received_at": now,
                    "experiment": attrs.get("experiment_name"), "step": attrs.get("step"),
                    "sample_index": attrs.get("sample_index"), "rollout_n": attrs.get("rollout_n"),
                    "validate": attrs.get("validate"),
                }
                self._calls.move_to_end(span_id)
                self._by_trace.setdefault(m["trace_id"], set()).add(span_id)
            while len(self._calls) > self.max_calls:
                _, old = self._calls.popitem(last=False)
                self._unlink(old)
                if self.forgotten is not None:
                    self.forgotten.inc()

    def closed(self, spans: Iterable[Mapping[str, Any]]) -> None:
        """Spans that arrived: their calls ended; a root ends its whole trajectory."""
        if not self._calls:
            return
        with self._lock:
            for s in spans:
                gone = self._calls.pop(s["span_id"], None)
                if gone is not None:
                    self._unlink(gone)
                if s["parent_id"] is None and s["kind"] != "annotation":
                    for span_id in self._by_trace.pop(s["trace_id"], set()):
                        self._calls.pop(span_id, None)

    def _unlink(self, call: dict[str, Any]) -> None:
        ids = self._by_trace.get(call["trace_id"])
        if ids is not None:
            ids.discard(call["span_id"])
            if not ids:
                del self._by_trace[call["trace_id"]]

    def snapshot(self, since: float) -> list[dict[str, Any]]:
        """Copies of the open calls received at or after ``since``."""
        with self._lock:
            return [dict(c) for c in self._calls.values() if c["received_at"] >= since]
