"""Outages and refusals the collector must say out loud: rate-limited logs, counters, /readyz.

Two things used to be silent: a Weave that cannot be reached (the spool just grew) and workers
sending a wrong token (401s, nothing in the log). Both are logged at the first occurrence, then
at most once per ``interval_s`` with the count since, counted in metrics, and described on
``/readyz`` so ``tracecar doctor`` and a person with curl see the same thing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tracecar.client.redact import DEFAULT as DEFAULT_REDACT
from tracecar.client.redact import RedactKeys
from tracecar.client.spans import safe_str

log = logging.getLogger("tracecar.collector")

LOG_INTERVAL_S = 60.0


def describe_error(exc: BaseException, limit: int = 300, redact: RedactKeys | None = None) -> str:
    """An exception as one short line for a log: its type and message, cut to ``limit``, with
    ``key=value`` secrets scrubbed (an internal error, a store's or a worker's, can quote a span's
    value), and never raising (a broken ``__str__`` is named instead)."""
    text = f"{type(exc).__name__}: {safe_str(exc)}"[:4 * limit]
    return (redact or DEFAULT_REDACT).scrub_text(text)[:limit]


class RateLimited:
    """Says an event at once, then at most once per interval with how many happened since."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.total = 0
        self._since = 0
        self._last: float | None = None
        self._lock = threading.Lock()

    def hit(self) -> int | None:
        """Counts one; returns how many to report now (None: stay quiet)."""
        with self._lock:
            self.total += 1
            self._since += 1
            now = time.monotonic()
            if self._last is not None and now - self._last < self.interval_s:
                return None
            count, self._since, self._last = self._since, 0, now
            return count

    def reset(self) -> None:
        with self._lock:
            self._since, self._last = 0, None


class BackgroundFailures:
    """Failures of the collector's background work that repeat until their cause goes away (a full
    disk, a locked store: every tick, every batch): the first of each task is logged with its
    traceback, then at most one line per interval with how many happened since and the latest
    one's traceback; each is counted in ``tracecar_background_failures_total{task}`` when a counter
    is given. Call :meth:`failed` inside the ``except`` block."""

    def __init__(self, counter: Any = None, interval_s: float = LOG_INTERVAL_S) -> None:
        self.counter = counter
        self.interval_s = interval_s
        self._limits: dict[str, RateLimited] = {}
        self._lock = threading.Lock()

    def failed(self, task: str, message: str) -> None:
        if self.counter is not None:
            self.counter.labels(task=task).inc()
        with self._lock:
            limit = self._limits.setdefault(task, RateLimited(self.interval_s))
            first = limit.total == 0
            count = limit.hit()
        if count is None:
            return
        # each line carries the latest failure's traceback: a new cause hours later is as clear as the first
        if first:
            log.exception("%s (later failures of %s are logged at most once every %g s)", message, task, self.interval_s,
                          extra={"event": "background_failure", "task": task})
        else:
            log.exception("%s: %d time(s) since the last line", message, count,
                          extra={"event": "background_failure", "task": task})

    def total(self, task: str) -> int:
        with self._lock:
            limit = self._limits.get(task)
        return limit.total if limit is not None else 0


class AuthFailures:
    """Requests refused for a missing or wrong bearer token (the presented value is never kept)."""

    def __init__(self, counter: Any, interval_s: float = LOG_INTERVAL_S) -> None:
        self.counter = counter
        self.limit = RateLimited(interval_s)
        self.last: dict[str, Any] | None = None

    def __call__(self, route: str, client: str | None, missing: bool) -> None:
        self.counter.labels(route=route).inc()
        self.last = {"at": round(time.time(), 3), "route": route,  # no client address on the open /readyz
                     "reason": "no bearer token" if missing else "wrong bearer token"}
        count = self.limit.hit()
        if count is not None:
            log.warning("refused %d request(s) with %s (latest: %s from %s): the worker's TRACECAR_TOKEN must equal "
                        "the collector's TRACECAR_TOKEN; further refusals are logged at most once every %g s",
                        count, self.last["reason"], route, client or "?", self.limit.interval_s,
                        extra={"event": "auth_failure", "count": count, "route": route, "client": client,
                               "auth_failures_total": self.limit.total})

    def details(self) -> dict[str, Any]:
        return {"total": self.limit.total, "last": self.last}


class WatchedSink:
    """Wraps the backend sink: says when it becomes unreachable, how long for, and when it recovers."""

    def __init__(self, sink: Any, unreachable: Any, interval_s: float = LOG_INTERVAL_S, redact: Any = None) -> None:
        self.inner = sink
        # a backend's answer may quote the request: every reason it gives is scrubbed like free text here,
        # before the forwarder logs or stores it and /readyz shows it
        self.redact = redact if redact is not None else RedactKeys()
        self.name = sink.name
        self.unreachable = unreachable  # gauge: 1 while the backend fails
        self.limit = RateLimited(interval_s)
        self.failing_since: float | None = None
        self.consecutive_failures = 0
        self.last_error: str | None = None
        self.last_success_at: float | None = None
        self.last_rejection: str | None = None

    async def send(self, spans: Sequence[Mapping[str, Any]]) -> Any:
        try:
            result = await self.inner.send(spans)
        except Exception as exc:
            self._failed(f"sink error: {type(exc).__name__}", len(spans))
            raise
        self._scrub(result)
        if result.rejected:
            self.last_rejection = next(iter(result.rejected.values()))
        if result.retryable:
            self._failed(result.retry_reason or "retryable failure", len(result.retryable))
        elif result.delivered:
            self._recovered()
        return result

    async def aclose(self) -> None:
        await self.inner.aclose()

    def _scrub(self, result: Any) -> None:
        scrub = self.redact.scrub_text
        if result.rejected:
            result.rejected = {sid: scrub(str(reason)) for sid, reason in result.rejected.items()}
        if result.retry_reason:
            result.retry_reason = scrub(result.retry_reason)
        if result.refused_reason:
            result.refused_reason = scrub(result.refused_reason)

    def _failed(self, reason: str, spans: int) -> None:
        now = time.time()
        if self.failing_since is None:
            self.failing_since = now
        self.consecutive_failures += 1
        self.last_error = reason
        self.unreachable.set(1)
        count = self.limit.hit()
        if count is not None:
            log.warning("cannot forward to %s: %s; %d failed attempt(s) since %s, spans wait in the spool and are "
                        "retried with backoff (check WANDB_API_KEY, the entity and the network; GET /readyz shows "
                        "the latest error); further failures are logged at most once every %g s",
                        self.name, reason, self.consecutive_failures,
                        time.strftime("%H:%M:%S", time.gmtime(self.failing_since)) + "Z", self.limit.interval_s,
                        extra={"event": "forward_unreachable", "backend": self.name, "reason": reason,
                               "consecutive_failures": self.consecutive_failures, "batch_spans": spans})

    def _recovered(self) -> None:
        self.last_success_at = time.time()
        if self.failing_since is not None:
            log.warning("forwarding to %s recovered after %d failed attempt(s) over %.0f s", self.name,
                        self.consecutive_failures, self.last_success_at - self.failing_since,
                        extra={"event": "forward_recovered", "backend": self.name})
        self.failing_since, self.consecutive_failures, self.last_error = None, 0, None
        self.unreachable.set(0)
        self.limit.reset()

    def details(self) -> dict[str, Any]:
        return {"backend": self.name, "reachable": self.failing_since is None, "last_error": self.last_error,
                "failing_since": self.failing_since, "consecutive_failures": self.consecutive_failures,
                "last_success_at": self.last_success_at, "last_rejection": self.last_rejection}


def route_of(scope: Mapping[str, Any]) -> str:
    """The matched route's template (bounded label values), not the raw path."""
    route = scope.get("route")
    return f"{scope.get('method', '?')} {getattr(route, 'path', None) or 'unmatched'}"


def client_of(scope: Mapping[str, Any]) -> str | None:
    peer = scope.get("client")
    return peer[0] if peer else None


AuthHook = Callable[[str, "str | None", bool], None]


def describe_tokenizer_attempts(name: str) -> str:
    """Where a tokenizer name was looked for, in words (for the once-per-name log line)."""
    import os
    from pathlib import Path

    path = Path(os.path.expanduser(name))
    if path.is_dir():
        as_path = f"{path} is a directory without tokenizer.json"
    elif path.exists():
        as_path = f"{path} exists but did not load as a tokenizer.json"
    else:
        as_path = f"no file or directory {path}"
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub")
    cached = hub / f"models--{name.replace('/', '--')}" / "snapshots"
    return (f"tried: {as_path}; the Hugging Face cache {cached}/*/tokenizer.json (offline; set HF_HOME or mount the "
            "cache); nothing is downloaded")


REFUSALS = frozenset({"not_allowed", "too_large"})  # the operator's policy said no (TokenizerPolicy)


class TokenizerFailures:
    """Logs each tokenizer name that cannot be loaded once, with what was tried and who asked.

    Names come from clients, so a hostile one could send a new name per batch: lines are also
    limited to one per ``min_interval_s`` (the names skipped meanwhile are counted in the next
    line, and every attempt is in ``tracecar_tokenizer_refused_total``), and at most
    ``max_names`` names are remembered.
    """

    def __init__(self, min_interval_s: float = 1.0, max_names: int = 4096) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._min_interval_s = min_interval_s
        self._max_names = max_names
        self._last_at = float("-inf")
        self._skipped = 0

    def failed(self, name: str, error: Exception, *, configured: bool, worker: str | None) -> None:
        now = time.monotonic()
        with self._lock:
            if name in self._seen:
                return
            if len(self._seen) < self._max_names:
                self._seen.add(name)
            if now - self._last_at < self._min_interval_s:
                self._skipped += 1
                return
            self._last_at, skipped, self._skipped = now, self._skipped, 0
        refused = getattr(error, "reason", "") in REFUSALS
        source = "TRACECAR_TOKENIZER" if configured else f"the tokenizer named by worker {worker or '?'}"
        tried = "" if refused else f"; {describe_tokenizer_attempts(name)}"  # a refusal's message says why
        more = f" ({skipped} more tokenizer names failed since the last such line)" if skipped else ""
        log.warning("cannot decode token ids: %s %s%s. Spans are stored without text and carry this warning; "
                    "give the collector the model's tokenizer.json (README: 'Giving the collector the tokenizer')%s",
                    source, error, tried, more,
                    extra={"event": "tokenizer_refused" if refused else "tokenizer_not_found", "tokenizer": name})


class _Dangling:
    """Stored prompt references (spool.full_payloads) that name a span the store does not hold, by
    where they were found (write, read); process-wide, logged at most once a minute."""

    def __init__(self) -> None:
        self.counts = {"write": 0, "read": 0}
        self._lock = threading.Lock()
        self._loud = RateLimited()

    def hit(self, where: str, n: int, detail: str) -> None:
        with self._lock:
            self.counts[where] = self.counts.get(where, 0) + n
        since = self._loud.hit()
        if since is not None:
            logging.getLogger("tracecar.collector.spool").error(
                "stored prompt reference cannot be rebuilt (%s): %s; %d such since the last message",
                where, detail, since, extra={"event": "prompt_ref_dangling", "where": where})


DANGLING = _Dangling()
