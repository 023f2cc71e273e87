"""TRL's callback: a batch it cannot trace is counted, not only logged once (the callback itself
needs transformers; what it counts with does not)."""

from __future__ import annotations

from typing import Any

from tracecar.client.integrations.trl import _count_lost


def test_completions_not_traced_are_counted_as_integration_error_drops(tracer_to: Any, kit: Any) -> None:
    tracer = tracer_to(f"http://127.0.0.1:{kit.free_port()}")  # nothing listens: nothing is sent here
    _count_lost([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}])
    _count_lost(object())  # no length: one
    assert tracer.stats()["dropped"]["integration_error"] == 4
