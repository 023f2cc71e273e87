"""The collector process's runtime tuning: the garbage collector's thresholds."""

from __future__ import annotations

import gc

from tracecar.collector.service.server import tune_gc


def test_tune_gc_freezes_what_exists_and_keeps_the_thresholds() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == before  # cycles holding bodies are found as often as before
        assert gc.get_freeze_count() > 1000  # the imported modules' objects: skipped by full collections
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
