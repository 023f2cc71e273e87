"""The truth route resolves its decoder off the event loop: the first call loads the tokenizer and
checks its byte table (about a second), which on the loop would stall every ingest answer."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from tracecar.collector.viewer import truth_api


async def _no_auth() -> None:
    return None


def test_the_decoder_is_resolved_in_a_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, int] = {}

    def decoder_of(collector: Any) -> Any:
        seen["decoder"] = threading.get_ident()
        return None

    monkeypatch.setattr(truth_api, "decoder_of", decoder_of)
    monkeypatch.setattr(truth_api, "caught_up", lambda index, catch_up_s: None)
    monkeypatch.setattr(truth_api, "read_by_id", lambda spool, trace_id, summary: {"trace_id": trace_id})
    monkeypatch.setattr(truth_api, "_turn_order", lambda collector, trace_id: [])
    monkeypatch.setattr(truth_api, "trajectory_truth", lambda index, trace_id, decode, rows: {"turns": [], "decoded": decode is not None})

    class Collector:
        spool = None

    class Index:
        summary = None

    app = FastAPI()
    app.include_router(truth_api.build_router(Collector(), Index(), _no_auth, 0.0))  # type: ignore[arg-type]

    async def call() -> tuple[httpx.Response, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return await client.get("/v1/trajectories/abc/truth"), threading.get_ident()

    r, loop_thread = asyncio.run(call())
    assert r.status_code == 200, r.text
    assert r.json() == {"trace_id": "abc", "summary": {"trace_id": "abc"}, "turns": [], "decoded": False}
    assert seen["decoder"] != loop_thread
