"""collector/loudness.py BackgroundFailures: a background loop's failure that repeats every tick is
logged once with its traceback, then rate-limited with its count, and every one is counted."""

from __future__ import annotations

import sqlite3

import pytest

from tracecar.collector.loudness import BackgroundFailures
from tracecar.collector.metrics import Metrics


def fail_ticks(failures: BackgroundFailures, ticks: int) -> None:
    for _ in range(ticks):
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError:
            failures.failed("retention", "retention: eviction failed; retrying next tick")


def test_a_failure_every_tick_is_one_traceback_then_a_counted_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    failures = BackgroundFailures(metrics.background_failures, interval_s=60.0)
    with caplog.at_level("WARNING", logger="tracecar.collector"):
        fail_ticks(failures, 50)
    records = [r for r in caplog.records if "eviction failed" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is not None  # the first, with its traceback
    assert metrics.background_failures.labels(task="retention")._value.get() == 50 and failures.total("retention") == 50
    caplog.clear()
    failures._limits["retention"].interval_s = 0.0  # the interval has passed
    with caplog.at_level("WARNING", logger="tracecar.collector"):
        fail_ticks(failures, 1)
    [line] = [r for r in caplog.records if "eviction failed" in r.getMessage()]
    assert line.exc_info is not None and "50 time(s) since the last line" in line.getMessage()  # the latest traceback too


def test_tasks_are_limited_apart(caplog: pytest.LogCaptureFixture) -> None:
    failures = BackgroundFailures(None, interval_s=60.0)
    with caplog.at_level("WARNING", logger="tracecar.collector"):
        for task in ("selection", "engine_hold_expire", "selection"):
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                failures.failed(task, f"{task} failed")
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["selection failed", "engine_hold_expire failed"]


def test_an_error_described_for_a_log_is_one_scrubbed_cut_line() -> None:
    from tracecar.client.redact import RedactKeys
    from tracecar.collector.loudness import describe_error

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    text = describe_error(sqlite3.OperationalError("near 'api_key=abc123secret': syntax error " + "y" * 900))
    assert "abc123secret" not in text and text.startswith("OperationalError: near") and len(text) == 300
    assert "hunter2" not in describe_error(KeyError("password=hunter2"), redact=RedactKeys(["password"]))
    assert describe_error(Unprintable()) == "Unprintable: <unprintable Unprintable>"
