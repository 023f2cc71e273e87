"""A fast loopback stand-in for W&B (GraphQL) and the Weave trace server, run as its own process.

It answers every route 200 with the smallest body the caller accepts: the GraphQL viewer query
``weave.init`` sends to resolve the default entity, ``/server_info``, the create routes with a
digest, ``/call/start`` with ids, and ``{}`` for everything else (``calls/complete`` included).
``--rate SPANS_PER_S`` makes ``calls/complete`` slow: each batch is answered only after
``calls_in_batch / rate`` seconds, which is how bench/overload_memory.py builds a sink slower
than the feed. ``GET /_stats`` reports requests, calls and bytes seen.

    python bench/sink_stub.py --port 9999 [--rate 500]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import time

import orjson
import uvicorn

ENTITY = "bench-entity"
SERVER_INFO = orjson.dumps({"min_required_weave_python_version": "0.0.0", "trace_server_version": "999.0.0"})
EMPTY = b"{}"
CALL_MARK = b'"op_name"'  # one per call in a calls/complete or upsert batch


class Stub:
    """Raw ASGI app (no framework) so the stub is never the bottleneck it measures against."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.requests = 0
        self.calls = 0
        self.body_bytes = 0
        self.started = time.time()
        self.paths: dict[str, int] = {}
        self._drain_lock = asyncio.Lock()

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI signature
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        chunks = []
        more = True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        self.requests += 1
        self.body_bytes += len(body)
        key = "/v2/*/calls/complete" if path.endswith("/calls/complete") else path
        self.paths[key] = self.paths.get(key, 0) + 1
        answer = await self._answer(path, body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    async def _answer(self, path: str, body: bytes) -> bytes:
        if path == "/graphql":
            return graphql_answer(body)
        if path == "/server_info":
            return SERVER_INFO
        if path == "/_stats":
            return orjson.dumps({"requests": self.requests, "calls": self.calls, "body_bytes": self.body_bytes,
                                 "paths": self.paths, "uptime_s": time.time() - self.started})
        if path.endswith(("/obj/create", "/file/create", "/table/create")) or path.endswith("/op/create"):
            return orjson.dumps({"digest": hashlib.sha256(body).hexdigest()[:32], "row_digests": []})
        if path.endswith("/call/start"):
            return orjson.dumps({"id": "0" * 32, "trace_id": "0" * 32})
        if path.endswith(("/calls/complete", "/call/upsert_batch", "/calls/upsert_batch")):
            n = body.count(CALL_MARK)
            self.calls += n
            if self.rate:
                async with self._drain_lock:  # one drain at a time: a fixed spans/s however many connections
                    await asyncio.sleep(n / self.rate)
        return EMPTY


def graphql_answer(body: bytes) -> bytes:
    """One answer that satisfies every query weave.init sends: viewer, serverInfo, project, upsert."""
    try:
        variables = orjson.loads(body).get("variables") or {}
    except (orjson.JSONDecodeError, AttributeError):
        variables = {}
    project = {"name": variables.get("name") or "bench-project", "description": None}
    return orjson.dumps({"data": {
        "viewer": {"username": "bench-user", "defaultEntity": {"name": ENTITY}},
        "serverInfo": {"frontendHost": "http://127.0.0.1"},
        "project": project,
        "upsertModel": {"model": project},
    }})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rate", type=float, default=None, help="calls/complete drain rate in calls/s (default: unlimited)")
    args = parser.parse_args()
    uvicorn.run(Stub(args.rate), host="127.0.0.1", port=args.port, log_level="warning", access_log=False,
                loop="uvloop", http="httptools", lifespan="on")


if __name__ == "__main__":
    main()
