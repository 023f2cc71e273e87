"""The collector process's runtime tuning: the garbage collector's thresholds."""

from __future__ import annotations

import gc
import weakref

import orjson

from tracecar.collector.heap import GC_YOUNG_THRESHOLD, tune_gc


class _Cycle:
    """An object that refers to itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _collections(run) -> int:
    seen = [0]

    def count(phase: str, info: dict) -> None:
        seen[0] += phase == "start"

    gc.callbacks.append(count)
    try:
        run()
    finally:
        gc.callbacks.remove(count)
    return seen[0]


def test_tune_gc_freezes_what_exists_and_lets_a_body_live_without_a_collection() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 1000  # the imported modules' objects: skipped by full collections
        # a body of 300 spans, parsed and held while it is worked on, then freed: no collection walks it
        body = orjson.dumps({"spans": [{"attributes": {"step": i}, "inputs": {"prompt_ids": list(range(1500))},
                                        "output": {"response_ids": list(range(500))}, "links": []}
                                       for i in range(300)]})
        gc.collect()
        assert _collections(lambda: [orjson.loads(body) for _ in range(3)]) == 0
        # CPython's own 700 (set here: another test in this process may have served, tuning it already)
        before_tuning = _collections(lambda: gc.set_threshold(700, 10, 10) or [orjson.loads(body) for _ in range(3)])
        assert before_tuning > 0  # CPython's 700 walked it
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_cycles_are_still_collected_under_the_raised_threshold() -> None:
    before = gc.get_threshold()
    try:
        tune_gc()
        gc.collect()
        first = _Cycle()
        probe = weakref.ref(first)
        del first
        for _ in range(2 * GC_YOUNG_THRESHOLD):  # garbage cycles piling up, nothing else allocating
            _Cycle()
        assert probe() is None  # a young collection ran on the way and freed the first one
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
