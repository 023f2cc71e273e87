"""Loopback services in child processes: a free port, waiting until one answers, stopping it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

#: Settings a test or bench must not inherit from the shell that runs it.
SETTING_PREFIXES = ("TRACECAR_", "WANDB_", "WF_")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago (closed again on return)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(drop: Sequence[str] = SETTING_PREFIXES, **extra: Any) -> dict[str, str]:
    """This environment without the variables starting with one of ``drop``, plus ``extra`` (None: left out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(tuple(drop))}
    env.update({k: str(v) for k, v in extra.items() if v is not None})
    return env


def wait_http(url: str, proc: subprocess.Popen[Any] | None = None, timeout: float = 60.0, poll_s: float = 0.05) -> None:
    """Polls ``url`` until it answers 200; raises at once if ``proc`` exits, TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=max(1.0, 4 * poll_s)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 20.0, kill_wait_s: float = 30.0) -> int | None:
    """Terminate, wait up to ``grace_s``, then kill and wait: the exit status (None if it never exited).

    ``grace_s=0`` kills at once (a leftover after a test, whose drain nobody waits for).
    """
    if proc.poll() is None and grace_s > 0:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.kill()
        try:
            proc.wait(timeout=kill_wait_s)
        except subprocess.TimeoutExpired:
            return None
    return proc.returncode


@dataclass
class Service:
    """A subprocess serving HTTP on 127.0.0.1; stopped (SIGTERM, then SIGKILL) by its pid."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 20.0) -> int | None:
        return stop_process(self.proc, timeout)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path is not None and self.log_path.exists() else ""

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])


def start_service(name: str, argv: Sequence[str], ready_url: str, log_path: Path, *, timeout: float = 60.0,
                  poll_s: float = 0.05, stdout_to_log: bool = False, **popen: Any) -> Service:
    """Starts ``argv`` (stderr, and stdout if asked, to ``log_path``) and waits for ``ready_url`` to answer 200.

    A service that exits or never answers is killed, and the error carries the end of its log.
    """
    base = ready_url.split("/", 3)
    url = "/".join(base[:3])
    with log_path.open("wb") as log:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen(list(argv), stdout=log if stdout_to_log else subprocess.DEVNULL,
                                stderr=subprocess.STDOUT if stdout_to_log else log, **popen)
    service = Service(name, url, proc, log_path)
    try:
        wait_http(ready_url, proc, timeout, poll_s)
    except (RuntimeError, TimeoutError) as e:
        stop_process(proc, grace_s=0)
        raise RuntimeError(f"{name} did not start ({e}):\n{service.log_text()[-3000:]}") from None
    return service


def pool_pids(pid: int) -> list[int]:
    """A collector's worker-pool processes (TRACECAR_WORKERS: spawned children, not multiprocessing's resource tracker)."""
    import psutil

    out = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "multiprocessing" in cmd and "resource_tracker" not in cmd:
            out.append(child.pid)
    return out
