"""TRL's callback: a batch it cannot trace is counted, not only logged once (the callback itself
needs transformers; what it counts with does not)."""

from __future__ import annotations

from typing import Any

from tracecar.client.integrations.trl import SPANS_PER_COMPLETION, _count_lost


def test_completions_not_traced_are_counted_as_integration_error_drops(tracer_to: Any, kit: Any) -> None:
    """Three spans a completion (its call, trajectory and annotation); those sent before the failure are not lost."""
    tracer = tracer_to(f"http://127.0.0.1:{kit.free_port()}")  # nothing listens: nothing is sent here
    _count_lost([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}], sent=0)
    _count_lost([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}], sent=2)  # failed at the third row
    _count_lost([{"prompt": "a"}], sent=1)  # failed after its last row: nothing lost
    _count_lost(object(), sent=0)  # no length: not counted, and no raise
    assert tracer.stats()["dropped"]["integration_error"] == (3 + 1) * SPANS_PER_COMPLETION
