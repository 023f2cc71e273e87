"""The process-wide tracer: configuration, the sender, and the current-span context.

``active`` is the one global the hot path reads; it is None when TRACECAR_URL is unset, so an
untraced job pays one attribute load per decorated call.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .config import ClientConfig
from .loud import check_url
from .sender import Sender
from .spans import SNAPSHOT_MODES, SpanRecord, deep_inputs, deep_snapshot, snapshot

log = logging.getLogger("tracecar.client")

DISABLED = object()  # context marker for rollout_trace_attr(trace=False)
current: contextvars.ContextVar[Any] = contextvars.ContextVar("tracecar_current_span", default=None)


class Tracer:
    """Joins a config to a sender; one per process."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.sender = Sender(config)
        # a call starting: an open marker for the live view, or nothing (TRACECAR_OPEN_MARKERS=false)
        self.opened = self.sender.opened if config.open_markers else _ignore
        # a call that ended: queued for the sender (bound once: one call frame fewer per traced call)
        self.emit: Callable[[SpanRecord], None] = self.sender.enqueue
        # TRACECAR_SNAPSHOT: what the caller's path copies of a call's arguments and its output
        mode = config.snapshot
        if mode not in SNAPSHOT_MODES:
            log.warning("tracecar: TRACECAR_SNAPSHOT=%r is not one of %s; using shallow", mode, ", ".join(SNAPSHOT_MODES))
            mode = "shallow"
        self.copy_dicts = mode == "shallow"
        self.deep_inputs: Callable[..., tuple[tuple[Any, ...], dict[str, Any] | None]] | None = (
            functools.partial(deep_inputs, depth=config.max_depth) if mode == "deep" else None)
        self.snapshot: Callable[[Any], Any] = (
            functools.partial(deep_snapshot, depth=config.max_depth) if mode == "deep" else snapshot)

    def flush(self, timeout_s: float | None = None) -> bool:
        return self.sender.flush(timeout_s)

    def shutdown(self, timeout_s: float | None = None) -> bool:
        return self.sender.shutdown(timeout_s)

    def stats(self) -> dict[str, Any]:
        return {**self.sender.stats.as_dict(), "queued": len(self.sender.queue)}


def _ignore(record: SpanRecord) -> None:
    return None


active: Tracer | None = None


def configure(config: ClientConfig | None = None, **overrides: Any) -> Tracer | None:
    """(Re)configures tracing: from the environment, then keyword overrides. Returns the tracer.

    With no URL the tracer is None and every decorated function runs untraced.
    """
    global active
    config = config or ClientConfig.from_env(**overrides)
    if config.url:
        url, warning = check_url(config.url)
        if warning:
            log.warning(warning)
        config = replace(config, url=url)
    previous, active = active, (Tracer(config) if config.url else None)
    if previous is not None:
        previous.shutdown(previous.config.shutdown_timeout_s)
    if active is not None:
        log.info("tracecar: tracing to %s as worker %s", config.url, active.sender.worker_id)
    return active


def get_tracer() -> Tracer | None:
    return active


def flush(timeout_s: float | None = None) -> bool:
    """Blocks at most ``timeout_s`` until queued spans are posted. True when fully drained."""
    return active.flush(timeout_s) if active is not None else True


def shutdown(timeout_s: float | None = None) -> bool:
    global active
    tracer, active = active, None
    return tracer.shutdown(timeout_s) if tracer is not None else True


@atexit.register
def _flush_at_exit() -> None:
    if active is not None:
        active.shutdown(active.config.shutdown_timeout_s)


configure()
