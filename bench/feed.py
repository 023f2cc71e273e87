"""Span feeders for the collector benches: real client records packed by the real sender.

Records are made by calling tracecar-decorated agent-loop functions (so every field is what a
worker sends) and packed into request bodies by the client's own ``Sender._build_body``, with
the client's default batch bounds, so the bodies are byte-for-byte the client's wire format.
A body is built once with a placeholder id prefix; each post swaps in a fresh prefix, which
makes every span id unique at the cost of one ``bytes.replace``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import httpx

TEMPLATE_PREFIX = "feedc0defeedc0de"  # 16 hex chars, like the client's random process prefix


def _decorated() -> tuple[Any, Any]:
    from tracecar.client import rollout_trace_attr, rollout_trace_op

    class Server:
        @rollout_trace_op
        def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
            return {"token_ids": self.reply, "stop_reason": "stop"}

    class Tool:
        @rollout_trace_op
        def execute(self, instance_id: str, parameters: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
            return "stdout: 42\n" * 8, 0.0, {"exit_code": 0}

    class Loop:
        def __init__(self) -> None:
            self.server, self.tool = Server(), Tool()

        @rollout_trace_op
        def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
            return self.body(sampling_params, **kwargs)

    return Loop, rollout_trace_attr


class BodyMaker:
    """Builds request bodies in this process with a tracer whose sender never posts."""

    def __init__(self, url: str, seed: int) -> None:
        from tracecar.client import spans, tracer

        self.tracer = tracer.configure(url=url, experiment="bench", flush_interval_s=1e9,
                                       batch_max_spans=10**9, queue_max_spans=10**9)
        spans.ids.prefix = TEMPLATE_PREFIX
        self.rng = random.Random(seed)
        self.Loop, self.attr = _decorated()
        self.sender = self.tracer.sender
        self.content_type = self.sender._client().headers["content-type"]

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(100_000) for _ in range(n)]

    def generate_spans(self, n: int, prompt: int = 1500, response: int = 500) -> None:
        """``n`` generate spans of ``prompt + response`` ids each, in trajectories of 4."""
        loop = self.Loop()
        for i in range(0, n, 4):
            with self.attr(sample_index=i // 32, step=1, rollout_n=(i // 4) % 8):
                for _ in range(min(4, n - i)):
                    loop.server.reply = self.ids(response)
                    loop.server.generate(f"r{i}", prompt_ids=self.ids(prompt), sampling_params={"temperature": 1.0})

    def step_spans(self, trajectories: int, turns: int, first_index: int = 0) -> None:
        """A full step: per trajectory run + ``turns`` × (generate, execute) + its root."""
        loop = self.Loop()

        def body(sampling_params: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
            prompt, response = self.ids(self.rng.randint(1000, 1500)), []
            for k in range(turns):
                loop.server.reply = self.ids(self.rng.randint(200, 500))
                loop.server.generate(kwargs["request_id"], prompt_ids=prompt + response, sampling_params=sampling_params)
                response += loop.server.reply
                loop.tool.execute(f"{kwargs['request_id']}-{k}", {"code": "print(6 * 7)"})
                response += self.ids(self.rng.randint(50, 150))
            return {"prompt_ids": prompt, "response_ids": response, "num_turns": turns}

        loop.body = body
        for t in range(first_index, first_index + trajectories):
            with self.attr(sample_index=t // 8, step=1, rollout_n=t % 8):
                loop.run({"temperature": 1.0}, request_id=f"t{t}")

    def bodies(self, max_spans: int | None = None) -> list[tuple[bytes, int]]:
        """Everything recorded so far, packed with the client's default batch bounds (or at most
        ``max_spans`` spans a body)."""
        sender = self.sender
        defaults = type(sender.config)()
        sender.config = replace(sender.config, batch_max_spans=max_spans if max_spans is not None else defaults.batch_max_spans,
                                batch_max_bytes=defaults.batch_max_bytes)
        out = []
        while sender.queue:
            built = sender._build_body()
            if built is not None:
                out.append(built)
        return out

    def close(self) -> None:
        from tracecar.client import tracer

        tracer.shutdown(0.1)


def fresh(body: bytes, worker: int, n: int) -> bytes:
    """``body`` with unique span ids: ``worker`` must be unique per feeder and phase (< 65,536)."""
    return body.replace(TEMPLATE_PREFIX.encode(), f"{worker:04x}{n:012x}".encode())


def post_loop(url: str, worker: int, bodies: list[tuple[bytes, int]], content_type: str, *, seconds: float,
              max_posts: int, on_status: Callable[[int], None] | None = None, repeat: bool = True) -> dict[str, Any]:
    """Posts the bodies (fresh ids each time) back to back until ``seconds`` or ``max_posts``."""
    statuses: dict[int, int] = {}
    spans = posts = 0
    retry_after_seen = 0
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=120, headers={"Content-Type": content_type}) as client:
        while posts < max_posts and time.monotonic() < deadline:
            body, n = bodies[posts % len(bodies)]
            if not repeat and posts >= len(bodies):
                break
            r = client.post(url + "/v1/spans", content=fresh(body, worker, posts))
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code == 503:
                retry_after_seen += "retry-after" in r.headers
                time.sleep(min(float(r.headers.get("retry-after", 1)), 2))
                continue
            posts += 1
            spans += n if r.status_code < 300 else 0
    return {"posts": posts, "spans": spans, "statuses": statuses, "retry_after_seen": retry_after_seen}


def client_loop(url: str, worker: int, *, seconds: float, max_spans: int) -> dict[str, Any]:
    """The real client: decorated generate calls in trajectories of 4, the sender posting them.

    Calls are made only while the sender's queue holds under two batches, so the sender (and
    the collector behind it), not the queue bound, sets the pace.
    """
    from tracecar.client import tracer

    tr = tracer.configure(url=url, experiment="bench")
    Loop, attr = _decorated()
    loop = Loop()
    rng = random.Random(worker)
    prompts = [[rng.randrange(100_000) for _ in range(1500)] for _ in range(16)]
    replies = [[rng.randrange(100_000) for _ in range(500)] for _ in range(16)]
    queue, high = tr.sender.queue, 2 * tr.config.batch_max_spans
    n, deadline = 0, time.monotonic() + seconds
    while n < max_spans and time.monotonic() < deadline:
        if len(queue) >= high:
            time.sleep(0.002)
            continue
        with attr(sample_index=n // 32, step=1, rollout_n=(n // 4) % 8):
            for k in range(4):
                loop.server.reply = replies[(n + k) & 15]
                loop.server.generate(f"r{n}", prompt_ids=prompts[(n + k) & 15], sampling_params={"temperature": 1.0})
        n += 4
    tr.flush(120)
    stats = tr.stats()
    tracer.shutdown(1)
    return {"produced": n, **stats}
