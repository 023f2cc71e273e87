"""Receive on a gateway: batches a node collector forwarded (exporters/gateway_sink.py).

A forwarded batch is tracecar's wire format (version 1) whose spans went through a node's
pipeline already: validated, prompt references rebuilt, decoded, head-sampled. Each span carries
what the node's batches gave it (``worker``, ``project``, ``entity``, ``client``,
``wandb_run_id``), the node's ``warnings`` and each response token's end offset in its text
(``token_ends``). They are restored here, so the gateway's stages (tail budgets, the store, the
exporters) see each span exactly as one collector fed by the workers directly would have, and
the gateway never decodes again (the envelope says ``token2text: false``). Spans are validated
again (the node may be older, or not a node), with the relaxed root rule of engine spans (a node
may forward OTLP spans it took).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from tracecar.client.redact import REDACTED, RedactKeys

from ..processors.validate import EnvelopeError, Rejection, Validated, validate_batch
from . import receive
from .otlp_translate import OtlpSpanIn

_MAX_NAME = 256


@dataclass
class ForwardedBatch(Validated):
    """A validated forwarded batch: the node's name and its carried token offsets."""

    node: str = ""
    carried_ends: dict[str, list[int]] = field(default_factory=dict)


class ForwardedRequest:
    """One forwarded request's receive stage (a :data:`~.pipeline.Receiver`)."""

    def __init__(self, node: str, max_decompressed_bytes: int, max_batch_spans: int, redact: RedactKeys,
                 on_spans: Callable[[int], Any] = lambda n: None) -> None:
        self.node = node
        self.on_spans = on_spans  # counts the node's valid spans (tracecar_gateway_spans_received{node})
        self.max_decompressed_bytes = max_decompressed_bytes
        self.max_batch_spans = max_batch_spans
        self.redact = redact

    def __call__(self, body: bytes | bytearray, content_type: str | None, content_encoding: str | None) -> Validated:
        plain = receive.decompress(body, content_encoding, self.max_decompressed_bytes)
        # the gateway never decodes (below): its id lists stay the bytes the node sent (raw_ids.py)
        raw = receive.parse(plain, content_type, receive.max_containers(self.max_decompressed_bytes), keep_ids=True)
        if not isinstance(raw, dict):
            raise EnvelopeError("body", f"expected an object with 'worker' and 'spans', got {type(raw).__name__}")
        items = raw.get("spans")
        if isinstance(items, list) and len(items) > self.max_batch_spans:
            raise receive.BodyError(413, "spans", f"{len(items)} spans exceed TRACECAR_MAX_BATCH_SPANS={self.max_batch_spans}; "
                                    "split the batch")
        raw["token2text"] = False  # decoded on the node: never twice
        raw.pop("max_samples_per_step_per_worker", None)  # the node's head budget decided already
        validated = validate_batch(raw, self.max_batch_spans, self.redact, plain, span_model=OtlpSpanIn)
        out = ForwardedBatch(**{f.name: getattr(validated, f.name) for f in fields(Validated)}, node=self.node)
        items = validated.batch.spans  # the raw items, by position (validate_batch keeps the list)
        kept = []
        for span in out.spans:
            index = out.index_of[span["span_id"]]
            problem = self._restore(span, items[index], out)
            if problem is None:
                kept.append(span)
                continue
            name, reason = problem
            out.rejected.append(Rejection(index, span["span_id"], f"spans[{index}].{name}", reason))
            out.warnings.pop(span["span_id"], None)
        out.spans = kept
        self.on_spans(len(kept))
        return out

    def _restore(self, span: Any, item: dict[str, Any], out: ForwardedBatch) -> tuple[str, str] | None:
        """The node's fields back on the span (in the order validation sets them); or what is wrong."""
        worker = item.get("worker")
        if not isinstance(worker, str) or not 0 < len(worker) <= _MAX_NAME:
            return "worker", f"must be a string of 1 to {_MAX_NAME} characters (the worker the node took the span from)"
        for key in ("project", "entity"):
            value = item.get(key)
            if value is not None and (not isinstance(value, str) or len(value) > _MAX_NAME):
                return key, f"must be a string of at most {_MAX_NAME} characters or null"
        client = item.get("client")
        if client is not None and not (isinstance(client, dict) and len(client) <= 32
                                       and all(isinstance(k, str) and isinstance(v, str) for k, v in client.items())):
            return "client", "must be a map of at most 32 strings to strings"
        run_id = item.get("wandb_run_id")
        if run_id is not None and (not isinstance(run_id, str) or not 0 < len(run_id) <= _MAX_NAME):
            return "wandb_run_id", f"must be a string of 1 to {_MAX_NAME} characters"
        notes = item.get("warnings")
        if notes is not None and not (isinstance(notes, list) and all(isinstance(n, str) for n in notes)):
            return "warnings", "must be a list of strings"
        ends = item.get("token_ends")
        if ends is not None and not (isinstance(ends, list) and all(type(e) is int and 0 <= e < 2**32 for e in ends)):
            return "token_ends", "must be a list of non-negative 32-bit integers"
        span["worker"], span["project"], span["entity"] = worker, item.get("project"), item.get("entity")
        if client:
            span["client"] = {k: (REDACTED if k in self.redact else v) for k, v in client.items()}
        if run_id is not None:
            span["wandb_run_id"] = run_id
        sid = span["span_id"]
        if notes:
            added = [n for n in out.warnings.get(sid, []) if n not in notes]
            out.warnings[sid] = list(notes) + added
        if ends is not None:
            out.carried_ends[sid] = ends
        return None
