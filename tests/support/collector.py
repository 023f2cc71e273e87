"""The collector, really started on 127.0.0.1: in a thread of the caller, or as ``python -m tracecar.collector``."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.processes import Service, clean_env, start_service, wait_http

#: How every test and bench starts a collector process (the launcher `tracecar serve` also runs).
COLLECTOR_ARGV = (sys.executable, "-m", "tracecar.collector")


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in a /metrics text whose labels include ``labels`` (0.0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def scrape_metric(url: str, name: str, **labels: str) -> float:
    """:func:`metric_value` of the collector at ``url``, scraped now."""
    return metric_value(httpx.get(url + "/metrics", timeout=10).text, name, **labels)


def wait_ready(url: str, timeout: float = 30.0, proc: subprocess.Popen[Any] | None = None) -> None:
    """Waits for the collector at ``url`` to answer 200 on /readyz."""
    wait_http(url + "/readyz", proc, timeout)


@dataclass
class ThreadCollector:
    """A collector served by uvicorn in a thread of the test process."""

    url: str
    server: Any
    thread: threading.Thread
    settings: Any

    @property
    def collector(self) -> Any:
        return self.server.collector

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve_in_thread(settings: Any, sink: Any = None) -> ThreadCollector:
    """Serves ``settings`` (a CollectorSettings on 127.0.0.1) as `tracecar serve` would, in a daemon thread."""
    from tracecar.collector.service.app import create_app
    from tracecar.collector.service.server import _DrainingServer, uvicorn_config

    app = create_app(settings, sink=sink)
    config = uvicorn_config(app, settings, timeout_graceful_shutdown=None)
    server = _DrainingServer(config, app.state.collector, settings.shutdown_unready_s)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.port}"
    wait_ready(url)
    return ThreadCollector(url, server, thread, settings)


def collector_env(port: int, data_dir: Path, drop: tuple[str, ...] | None = None, **settings: Any) -> dict[str, str]:
    """The environment of a collector process on 127.0.0.1:``port`` with the local store in ``data_dir``.

    ``settings``: TRACECAR_* names, or setting names without the prefix (``log_level="warning"``); None
    leaves one out, booleans are written as ``true``/``false``. ``drop``: prefixes not inherited.
    """
    env = clean_env(drop) if drop is not None else clean_env()
    env.update({"TRACECAR_HOST": "127.0.0.1", "TRACECAR_PORT": str(port), "TRACECAR_DATA_DIR": str(data_dir),
                "TRACECAR_BACKEND": "local"})
    for key, value in settings.items():
        if value is None:
            continue
        name = key if key.isupper() else "TRACECAR_" + key.upper()
        env[name] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def launch_collector(env: dict[str, str], log_path: Path, timeout: float = 60.0, **popen: Any) -> Service:
    """``python -m tracecar.collector`` with ``env`` (stderr to ``log_path``), once /readyz answers 200."""
    url = f"http://127.0.0.1:{env['TRACECAR_PORT']}"
    return start_service("collector", COLLECTOR_ARGV, url + "/readyz", log_path, timeout=timeout, env=env, **popen)


@dataclass
class ProcessCollector:
    """A collector run as ``python -m tracecar.collector`` in its own process (for kill/SIGTERM tests)."""

    url: str
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    logs: list[Path] = field(default_factory=list)

    def start(self, timeout: float = 60) -> ProcessCollector:
        self.log_path = Path(self.env["TRACECAR_DATA_DIR"]) / f"collector-{len(self.logs)}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.logs.append(self.log_path)
        self.proc = launch_collector(self.env, self.log_path, timeout).proc
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 60) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())
