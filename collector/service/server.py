"""Runs the collector under uvicorn with a sidecar-friendly shutdown.

SIGTERM/SIGINT: /readyz turns unready at once, then uvicorn stops accepting and finishes
in-flight requests, then the lifespan drains the spool to the backend until
``shutdown_drain_s`` and leaves the rest on disk for the next start.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from typing import Any

import uvicorn

from tracecar.client import __version__

from .. import data_dir_lock
from ..heap import HEAP, tune_gc
from ..logs import setup_logging
from ..settings import CollectorSettings
from .app import create_app
from .http_limits import ConnectionLimits, guarded_protocol

log = logging.getLogger("tracecar.collector")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _DrainingServer(uvicorn.Server):
    """Marks the collector unready before uvicorn begins its own shutdown.

    With ``unready_s`` > 0 the first signal only turns /readyz (and ingest) to 503 and keeps
    the listener open that long, so Kubernetes endpoints and load balancers stop sending before
    the socket closes; a second signal skips the wait.
    """

    def __init__(self, config: uvicorn.Config, collector: Any, unready_s: float = 0.0) -> None:
        super().__init__(config)
        self.collector = collector
        self.unready_s = unready_s
        self._unready_timer: threading.Timer | None = None
        self.data_dir_lock: data_dir_lock.DataDirLock | None = None  # held by serve(): named with our port once bound

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.data_dir_lock is not None and not self.should_exit:
            ports = [s.getsockname()[1] for server in self.servers for s in (server.sockets or ())]
            self.data_dir_lock.note(port=ports[0] if ports else self.config.port)

    def handle_exit(self, sig: int, frame: Any) -> None:
        first = self._unready_timer is None
        self.collector.mark_unready()
        log.info("shutdown requested", extra={"event": "shutdown", "signal": sig, "unready_s": self.unready_s})
        if first and self.unready_s > 0:
            self._unready_timer = threading.Timer(self.unready_s, super().handle_exit, (sig, frame))
            self._unready_timer.daemon = True
            self._unready_timer.start()
            return
        if self._unready_timer is not None:
            self._unready_timer.cancel()
        super().handle_exit(sig, frame)


def uvicorn_config(app: Any, settings: CollectorSettings, **overrides: Any) -> uvicorn.Config:
    """uvicorn's configuration with the collector's connection limits (slow and idle clients)."""
    metrics = app.state.collector.metrics
    limits = ConnectionLimits(
        header_timeout_s=settings.http_header_timeout_s, body_timeout_s=settings.http_body_timeout_s,
        idle_timeout_s=settings.http_idle_timeout_s, max_header_bytes=settings.http_max_header_bytes,
    )
    options: dict[str, Any] = dict(
        host=settings.host, port=settings.port, log_config=None, access_log=False, loop="auto",
        http=guarded_protocol(limits, lambda reason: metrics.http_closed.labels(reason=reason).inc()),
        timeout_keep_alive=settings.http_idle_timeout_s,
        timeout_graceful_shutdown=max(1, int(settings.shutdown_drain_s)), lifespan="on",
    )
    options.update(overrides)
    return uvicorn.Config(app, **options)


def build_server(settings: CollectorSettings) -> _DrainingServer:
    app = create_app(settings)
    return _DrainingServer(uvicorn_config(app, settings), app.state.collector, settings.shutdown_unready_s)


def serve(settings: CollectorSettings) -> None:
    """Runs the collector until a signal; raises :class:`~..data_dir_lock.DataDirInUse` (before it
    touches the store) when another process holds ``settings.data_dir``, ``DataDirError`` when
    it cannot be locked."""
    setup_logging(settings.log_level)
    lock = data_dir_lock.hold(settings.data_dir)
    try:
        HEAP.configure()  # large buffers: heap up to 16 MiB, trimmed after bursts (heap.py)
        if not _is_loopback(settings.host) and settings.token is None:
            log.warning("binding to a non-loopback address without TRACECAR_TOKEN: anyone who can reach "
                        f"{settings.host}:{settings.port} can write traces", extra={"event": "insecure_bind"})
        server = build_server(settings)
        server.data_dir_lock = lock
        c = server.collector
        log.info("tracecar collector starting", extra={
            "event": "startup", "version": __version__, "bind": f"{settings.host}:{settings.port}",
            "store": str(settings.spool_path), "backend": ",".join(settings.effective_exporters) or "local",
            "exporters": settings.effective_exporters,
            "token2text": settings.token2text, "tokenizer": settings.tokenizer,
            "max_samples_per_step_per_worker": settings.max_samples_per_step_per_worker,
            "spool_max_bytes": settings.spool_max_bytes, "auth": settings.token is not None,
            "spool_depth_at_start": c.spool.pending_count,
        })
        tune_gc()
        server.run()
    finally:
        lock.release()  # run() returns after the store is closed: the next collector may take the dir
