"""The client's voice: a bad TRACECAR_URL, a failed send and what was dropped are said, briefly.

A worker whose collector is missing must not be silent for the 300 s of retries (nor exit 0
without a word), and must not flood the training log either: the first failure is logged at
once, later ones at most once per ``interval_s`` with a count, and shutdown logs one line with
what was dropped, by reason. Everything here runs on the sender thread or at configure/exit,
never on the caller's path.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("tracecar.client")

WARN_INTERVAL_S = 60.0


def check_url(url: str) -> tuple[str | None, str | None]:
    """(the URL to use or None for tracing off, a warning line or None).

    ``host:port`` without a scheme is taken as ``http://host:port`` (said once); any other
    scheme, or no host, turns tracing off with a line saying why.
    """
    if "://" not in url:
        if url.split(":", 1)[0].lower() in ("http", "https"):  # 'http:' or 'http:/host': a mangled scheme
            return None, f"tracecar: TRACECAR_URL={url!r} is not a URL (expected http://HOST:PORT); tracing is off"
        fixed = "http://" + url
        parts = urlsplit(fixed)
        if parts.hostname:
            return fixed, f"tracecar: TRACECAR_URL={url!r} has no scheme; using {fixed} (write it as http://HOST:PORT)"
        return None, f"tracecar: TRACECAR_URL={url!r} is not a URL (expected http://HOST:PORT); tracing is off"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None, f"tracecar: TRACECAR_URL={url!r} is not an http(s) URL with a host (expected http://HOST:PORT); tracing is off"
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return None, f"tracecar: TRACECAR_URL={url!r} has an invalid port (expected http://HOST:PORT); tracing is off"
    path = parts.path.rstrip("/")
    for suffix in API_PATHS:  # the endpoint, not the collector: every post would be a 404
        if path.endswith(suffix):
            base = url[:url.index(parts.netloc) + len(parts.netloc)] + path[:-len(suffix)]
            return base, (f"tracecar: TRACECAR_URL={url!r} names an endpoint; using the collector's base URL {base} "
                          f"(give it as http://HOST:PORT: the client adds {INGEST_PATH} itself)")
    return url, None


INGEST_PATH = "/v1/spans"
API_PATHS = (INGEST_PATH, "/v1/traces", "/v1")  # longest first


def _hint(reason: str) -> str:
    if reason in ("http_401", "http_403"):
        return "the collector refused the token: set TRACECAR_TOKEN to the collector's TRACECAR_TOKEN"
    if reason.startswith("connection"):
        return "is the collector running there? check TRACECAR_URL"
    if reason in ("http_503", "http_429"):
        return "the collector is starting, draining or applying backpressure"
    if reason == "http_413":
        return "a batch is over the collector's TRACECAR_MAX_BODY_BYTES"
    return "see the collector's log"


def summarize_drops(dropped: dict[str, int]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted(dropped.items()) if n)


class FailureReporter:
    """Rate-limited warnings about sends and drops, and the line logged at shutdown."""

    def __init__(self, url: str | None, retry_max_elapsed_s: float, interval_s: float = WARN_INTERVAL_S) -> None:
        self.url = url
        self.retry_max_elapsed_s = retry_max_elapsed_s
        self.interval_s = interval_s
        self.failures = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._last_warned: float | None = None
        self._since_warned = 0
        self._drops_warned = 0
        self._last_drop_warned: float | None = None
        self._closed = False  # after the shutdown line, nothing more

    def _due(self, last: float | None) -> bool:
        return last is None or time.monotonic() - last >= self.interval_s

    def send_failed(self, reason: str, *, retrying: bool) -> None:
        """A post failed (``reason`` as in the drop counters); logs the first at once, then rate-limited."""
        with self._lock:
            self.failures += 1
            self.last_error = reason
            self._since_warned += 1
            if not self._due(self._last_warned):
                return
            count, self._since_warned, self._last_warned = self._since_warned, 0, time.monotonic()
        then = (f"retrying with backoff for up to {self.retry_max_elapsed_s:g} s before dropping them" if retrying
                else "these spans are dropped")
        more = "" if count == 1 else f" ({count} failures in the last {self.interval_s:g} s)"
        log.warning("tracecar: cannot send spans to the collector at %s (%s)%s: %s; %s. Further failures are "
                    "logged at most once every %g s.", self.url, reason, more, _hint(reason), then, self.interval_s)

    def dropped(self, stats: dict[str, Any]) -> None:
        """Called by the sender thread after each drain: new drops are logged, rate-limited."""
        total = stats.get("dropped_total", 0)
        with self._lock:
            if self._closed or total <= self._drops_warned or not self._due(self._last_drop_warned):
                return
            self._drops_warned, self._last_drop_warned = total, time.monotonic()
        log.warning("tracecar: %d spans dropped so far (%s); the worker keeps running untouched",
                    total, summarize_drops(stats.get("dropped", {})))

    def at_shutdown(self, stats: dict[str, Any]) -> None:
        """One line: what was sent and dropped, by reason, and the last send error."""
        total = stats.get("dropped_total", 0)
        with self._lock:
            self._closed = True
        if not total and not self.failures:
            log.info("tracecar: sent %d spans to %s, none dropped", stats.get("sent", 0), self.url)
            return
        last = f"; last send error: {self.last_error} ({_hint(self.last_error)})" if self.last_error else ""
        log.warning("tracecar: at shutdown: sent %d spans to %s, dropped %d (%s)%s",
                    stats.get("sent", 0), self.url, total, summarize_drops(stats.get("dropped", {})) or "none", last)
