"""The sender's real build path on this thread, for the benches that take it apart.

``traced_sender()`` configures a tracer whose sender never starts its thread (nothing is posted:
``Sender._start`` is a no-op) and talks wire v3 as to a current collector (prompt deltas, short
ids, open markers), and returns it with a ``trace(n)`` that records ``n`` of ``hot_path.py``'s calls
(1,500 + 500 ids, a tool call, a reward) in trajectories of 4 through the real decorator. Each
bench then empties the queue with ``Sender._build_body``, the sender's own code.
``keep_body_pieces()`` makes ``_build_body`` hand the body over as its unjoined pieces
(``wire.body_pieces``), for a bench that posts them its own way.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hot_path

from common import token_ids, tool_call


@dataclass
class TracedSender:
    sender: Any
    trace: Callable[[int], None]

    def build_all(self) -> int:
        """Empties the queue through ``Sender._build_body``; the spans it took."""
        spans = len(self.sender.queue)
        while self.sender.queue:
            self.sender._build_body()
        self.sender.opens.clear()  # open markers: the next run starts with none pending
        return spans


def traced_sender() -> TracedSender:
    from tracecar.client import rollout_trace_attr, rollout_trace_op, tracer
    from tracecar.client import sender as sender_mod

    sender_mod.Sender._start = lambda self: None  # type: ignore[method-assign]  # built on this thread, never posted
    tr = tracer.configure(url="http://127.0.0.1:9", experiment="bench", queue_max_spans=10**6)
    sender = tr.sender
    sender._short_ids, sender._markers_ok = True, True  # as a current collector's first answer would say
    loop = hot_path.make_loop(rollout_trace_op)
    rng = random.Random(1)
    inputs = [(token_ids(1500, rng), token_ids(500, rng), tool_call(rng), round(rng.random(), 3)) for _ in range(8)]

    def trace(n: int) -> None:
        for t in range(n // 4):
            with rollout_trace_attr(sample_index=t, step=1, rollout_n=0):
                for i in range(4):
                    loop.step(*inputs[(t * 4 + i) & 7])

    return TracedSender(sender, trace)


def keep_body_pieces() -> list[list[bytes]]:
    """From now on ``_build_body`` appends each body's pieces to the returned list (and returns b"")."""
    from tracecar.client import sender as sender_mod
    from tracecar.client.wire import body_pieces

    bodies: list[list[bytes]] = []

    def keep(header: dict[str, Any], spans: list[list[bytes]]) -> bytes:
        bodies.append(body_pieces(header, spans))
        return b""

    sender_mod.batch_body_pieces = keep  # type: ignore[assignment]
    return bodies


def shutdown() -> None:
    from tracecar.client import tracer

    tracer.shutdown(0)
