"""The ``gateway`` sink: a node collector forwards its decoded spans to the job's gateway.

Over tracecar's own wire format (``POST <gateway>/v1/spans``, zstd), marked with the node's name
in the ``X-Tracecar-Node`` header and the envelope. Each span travels as the node spooled it:
decoded texts, rewards, annotations, warnings, and the fields the node's batches gave it (worker,
project, entity, client, W&B run), plus each response token's end offset in its text
(``token_ends``, from the node's token view) — so the gateway never decodes again and stores
what one collector that saw the workers directly would have stored (receivers/forwarded.py).

Delivery is the shared Forwarder's (own cursor in the node's spool, retries with backoff,
Retry-After, dead letters); a span is delivered once the gateway committed it or knew it
(its duplicates, by span id, also across restarts of either side). What the gateway refuses by
name is dead-lettered with its reason; everything else (connection errors, 5xx, 503 at its
bounds, a wrong token, a collector that is not a gateway) is retried, never lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import orjson
import zstandard

from tracecar.client.retry_after import parse_retry_after

from .forward import RawJSON, SendResult

log = logging.getLogger("tracecar.collector.gateway_sink")

#: the HTTP header that marks a batch as forwarded by a node collector (value: the node's name)
NODE_HEADER = "X-Tracecar-Node"
#: "<acknowledged through>,<delivered through>": the node's spool sequence numbers (service/roles.py NodeMarks)
PROGRESS_HEADER = "X-Tracecar-Node-Progress"
_MAX_REASON = 300


def _default(value: Any) -> Any:
    if isinstance(value, RawJSON):  # inputs/output as spooled: spliced, never parsed
        return orjson.Fragment(bytes(value))
    raise TypeError(f"cannot forward a {type(value).__name__}")


class GatewaySink:
    """Posts spans to a gateway collector, chunked by bytes; classifies its answer per span."""

    name = "gateway"

    def __init__(self, url: str, *, node: str, token: str | None = None, timeout_s: float = 30.0,
                 batch_bytes: int = 8 * 2**20, client: httpx.AsyncClient | None = None, name: str = "gateway") -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.endpoint = url.rstrip("/") + "/v1/spans"
        self.heartbeat_endpoint = url.rstrip("/") + "/v1/cluster/heartbeat"
        self.node = node
        self.batch_bytes = batch_bytes
        headers = {"Content-Type": "application/json", "Content-Encoding": "zstd", NODE_HEADER: node}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._client = client or httpx.AsyncClient(timeout=timeout_s, headers=headers)
        self._zstd = zstandard.ZstdCompressor(level=3)
        # set by the collector (service/roles.py): span id -> each response token's end offset in its text
        self.token_ends: Callable[[list[str]], dict[str, list[int]]] = lambda span_ids: {}
        # set by the collector: (acknowledged through, delivered through once the oldest n pending are) of the node's spool
        self.progress: Callable[[int], tuple[int, int] | None] = lambda n: None
        # set by the collector: the gateway's budgets (its heartbeat answer), for a node sending candidates only
        self.on_budgets: Callable[[Any], None] | None = None
        # set by the collector: a node sending candidates only reports the steps it holds (the heartbeat's body)
        self.holding: Callable[[], dict[str, Any]] | None = None
        self._budgets: Any = None

    async def send(self, spans: Sequence[Mapping[str, Any]]) -> SendResult:
        result = SendResult()
        ends = await asyncio.to_thread(self.token_ends, [s["span_id"] for s in spans])
        chunk: list[bytes] = []
        ids: list[str] = []
        size = through = 0  # through: how many of the batch's oldest spans are in the chunks so far
        for position, span in enumerate(spans):
            item = dict(span)
            if span["span_id"] in ends:
                item["token_ends"] = ends[span["span_id"]]
            encoded = orjson.dumps(item, default=_default)
            if chunk and size + len(encoded) > self.batch_bytes:
                await self._post_in_order(chunk, ids, result, through)
                chunk, ids, size = [], [], 0
            chunk.append(encoded)
            ids.append(span["span_id"])
            size += len(encoded)
            through = position + 1
        if chunk:
            await self._post_in_order(chunk, ids, result, through)
        return result

    async def _post_in_order(self, chunk: list[bytes], ids: list[str], result: SendResult, delivered: int) -> None:
        """After a chunk of this batch must be retried, the rest waits with it: spans stay in order, and no
        later chunk claims the earlier ones delivered."""
        if result.retryable:
            result.retryable.extend(ids)
            return
        await self._post(chunk, ids, result, delivered)

    async def _progress_headers(self, delivered: int) -> dict[str, str]:
        """How far this node has acknowledged, and delivered once the gateway commits the oldest ``delivered``
        pending spans: the gateway's steps wait for what the node acknowledged (service/roles.py NodeMarks)."""
        try:
            marks = await asyncio.to_thread(self.progress, delivered)
        except Exception:  # noqa: BLE001 - a read of the node's spool: never worth the batch
            marks = None
        if marks is None:
            return {}
        return {PROGRESS_HEADER: f"{marks[0]},{marks[1]}"}

    async def heartbeat(self) -> bool:
        """Tells the gateway this node's progress between batches; True when it answered 200."""
        body = b""
        if self.holding is not None:
            try:
                body = orjson.dumps(await asyncio.to_thread(self.holding))
            except Exception:  # noqa: BLE001 - a read of the node's spool: the heartbeat goes without it
                body = b""
        try:
            response = await self._client.post(self.heartbeat_endpoint, content=body, headers=await self._progress_headers(0))
        except httpx.HTTPError:
            return False
        if response.status_code != 200:
            return False
        try:
            budgets = response.json().get("budgets")
        except (ValueError, AttributeError):
            budgets = None
        if budgets is not None and budgets != self._budgets and self.on_budgets is not None:
            await asyncio.to_thread(self.on_budgets, budgets)  # the node's selector: its lock, a file write
            self._budgets = budgets
        return True

    async def _post(self, chunk: list[bytes], ids: list[str], result: SendResult, delivered: int) -> None:
        """One request; on 413 the chunk is split in halves (a single span too large is dead-lettered).

        ``delivered``: how many of the oldest pending spans are delivered once this one is committed."""
        envelope = orjson.dumps({"v": 1, "worker": self.node, "node": self.node, "token2text": False})
        body = envelope[:-1] + b',"spans":[' + b",".join(chunk) + b"]}"
        try:
            response = await self._client.post(self.endpoint, content=self._zstd.compress(body),
                                                headers=await self._progress_headers(delivered))
        except httpx.HTTPError as exc:
            result.retryable.extend(ids)
            result.retry_reason = f"gateway {self.endpoint} unreachable: {type(exc).__name__}"
            return
        status = response.status_code
        if status == 413 and len(chunk) > 1:
            half = len(chunk) // 2
            await self._post(chunk[:half], ids[:half], result, delivered - (len(chunk) - half))
            await self._post(chunk[half:], ids[half:], result, delivered)
            return
        answer: Any = None
        try:
            answer = response.json()
        except ValueError:
            pass
        if status in (200, 422) and isinstance(answer, dict) and isinstance(answer.get("rejected"), list):
            refused = {}
            for r in answer["rejected"]:
                if isinstance(r, dict) and r.get("span_id") in ids:
                    refused[r["span_id"]] = f"gateway refused {r.get('field')}: {r.get('reason')}"[:_MAX_REASON]
            result.rejected.update(refused)
            result.delivered.extend(sid for sid in ids if sid not in refused)
            return
        reason = _reason(answer) or response.text[:_MAX_REASON]
        if status == 413 or status == 400:  # the gateway cannot take this span (or batch) at all: named, kept aside
            for sid in ids:
                result.rejected[sid] = f"gateway answered {status}: {reason}"[:_MAX_REASON]
            return
        # 401/403 (token), 421 (not a gateway), 429, 5xx, 503 at its bounds: retried, never lost
        result.retryable.extend(ids)
        result.retry_reason = f"gateway answered {status}: {reason}"[:_MAX_REASON]
        retry_after = parse_retry_after(response.headers.get("retry-after"))
        if retry_after is not None:
            result.retry_after = max(result.retry_after or 0.0, retry_after)

    async def aclose(self) -> None:
        await self._client.aclose()


def _reason(answer: Any) -> str | None:
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        error = answer["error"]
        return f"{error.get('field')}: {error.get('reason')}" if error.get("field") else str(error.get("reason"))
    return None
