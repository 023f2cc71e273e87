"""collector/receivers/worker_pool.py: a worker killed in the middle of writing its result.

The OOM killer's usual moment is when a worker holds the most memory: a batch's payloads, being
written back. ``ProcessPoolExecutor`` then reads the rest of that message for ever: without the
pool's own liveness check, the batch, and every later one, would never finish nor fail (a real
spawned pool; the half-written message is written by the worker itself, then it is SIGKILLed, so
the pipe holds exactly what a kill mid-write leaves).
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import sys
import threading
from typing import Any

import pytest

from tracecar.collector.metrics import Metrics
from tracecar.collector.processors.decoding import TokenizerPolicy
from tracecar.collector.receivers.worker_pool import WorkerConfig, WorkerPool

pytestmark = pytest.mark.timeout(180)


def die_mid_result(_: Any) -> None:
    """In a worker: the header of a 64 MiB result and its first KiB, then SIGKILL (lock held, as in a real send)."""
    result_queue = sys._getframe(1).f_locals["result_queue"]  # concurrent.futures.process._process_worker's
    result_queue._wlock.acquire()
    result_queue._writer._send(struct.pack("!i", 64 * 2**20) + b"x" * 1024)
    os.kill(os.getpid(), signal.SIGKILL)


def pid_of(_: Any) -> int:
    return os.getpid()


def _died(metrics: Metrics) -> float:
    return metrics.worker_failures.labels(kind="died")._value.get()


async def _until_ready(pool: WorkerPool, timeout_s: float = 90) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pool.ready:
        assert loop.time() < deadline, "the worker pool did not warm up"
        await asyncio.sleep(0.05)


def _pool(processes: int, liveness_check_s: float) -> tuple[WorkerPool, Metrics]:
    """A real spawned pool (no tokenizer: these tasks decode nothing), not started yet."""
    metrics = Metrics()
    config = WorkerConfig(policy=TokenizerPolicy(), redact_keys=["api_key"], max_batch_spans=100,
                          max_decompressed_bytes=2**20, max_span_bytes=2**20, local_only=True)
    pool = WorkerPool(processes, config, metrics)
    pool.LIVENESS_CHECK_S = liveness_check_s
    return pool, metrics


def test_a_worker_killed_while_writing_its_result_costs_one_redo_not_the_pool() -> None:
    pool, metrics = _pool(2, liveness_check_s=0.2)

    async def scenario() -> None:
        pool.start()
        await _until_ready(pool)
        first = set(pool.pids)
        # answered None (the caller redoes the batch in-process), soon, instead of never
        assert await asyncio.wait_for(pool.call(die_mid_result, None), timeout=30) is None
        assert _died(metrics) == 1
        await _until_ready(pool)  # a new pool, whose workers answer
        assert not first & set(pool.pids)
        assert await asyncio.wait_for(pool.call(pid_of, None), timeout=30) in pool.pids
        assert _died(metrics) == 1

    try:
        asyncio.run(scenario())
    finally:
        pool.close()


def test_closing_a_pool_whose_worker_died_writing_its_result_does_not_hang() -> None:
    """The drain's last step joins the executor: it must end even if a worker died mid-write
    after the last liveness check (here the batch's own check is an hour away)."""
    pool, _ = _pool(1, liveness_check_s=3600)

    async def scenario() -> None:
        pool.start()
        await _until_ready(pool)
        [pid] = pool.pids
        batch = asyncio.ensure_future(pool.call(die_mid_result, None))
        deadline = asyncio.get_running_loop().time() + 30
        while not _exited(pid):  # the worker wrote half its result and is gone; the batch still waits
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        assert not batch.done()
        closing = threading.Thread(target=pool.close, daemon=True)
        closing.start()
        await asyncio.get_running_loop().run_in_executor(None, closing.join, 30)
        assert not closing.is_alive(), "close() hung on the stuck executor"
        batch.cancel()

    asyncio.run(scenario())


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1].startswith(("Z", "X"))
    except FileNotFoundError:
        return True


def test_a_workers_error_is_logged_scrubbed_and_cut(caplog: pytest.LogCaptureFixture) -> None:
    """A batch's error can quote a span's value: the log line's ``error`` never carries its secret."""
    pool, _ = _pool(1, liveness_check_s=1.0)  # never started: _log alone
    with caplog.at_level("ERROR", logger="tracecar.collector.workers"):
        pool._log("a worker failed a batch", ValueError("bad value api_key='sk-live-123456' " + "x" * 2000))
    (record,) = [r for r in caplog.records if getattr(r, "event", None) == "worker_failed"]
    error = record.error  # type: ignore[attr-defined]
    assert "sk-live-123456" not in error and error.startswith("ValueError: bad value api_key=") and len(error) <= 500
