"""What the trainer trained on: each kept trajectory's row of VERL's batch, sent to the collector off the step.

After ``compute_advantage`` (tracecar.client.verl_trainer) the batch holds what the actor update
will train on: ``prompts`` / ``responses`` (the sequence), ``response_mask`` (the tokens the loss
covers; VERL's v1 trainers call it ``loss_mask`` too), ``old_log_probs`` (the trainer's
recomputation, or the rollout's in bypass mode) and, when present, ``ref_log_prob`` and
``entropys``. For each trajectory the trainer kept (a mask with a token), its row goes to the
collector as an annotation whose ``output.trainer_tokens`` holds little-endian base64 arrays
(ids int32, mask uint8, log-probabilities float32: ~10 bytes a token), where it is compared with
the rollout's own tokens and log-probabilities (collector/processors/trainer_compare.py).

Off the critical path: the step's thread only takes references to the batch's tensors (no copy:
VERL replaces a batch's tensors, it does not write into them after ``compute_advantage``) and
queues them; a daemon thread slices, packs and annotates. The queue holds ``MAX_PENDING`` steps;
a step that finds it full is dropped, counted in :data:`stats` and logged once a minute, never
waited for. ``background=False`` (``hook_trainer(trainer_tokens="sync")``) does the work inline,
for tests and measurements.
"""

from __future__ import annotations

import base64
import logging
import queue
import threading
import time
from typing import Any

from .. import tracer as _tracer
from ..spans import KIND_ANNOTATION, SpanRecord
from ..tracing import ROUTE_ATTR, _now, _TraceRef

log = logging.getLogger("tracecar.verl")

MAX_PENDING = 4  # steps queued for the packing thread
MASK_KEYS = ("response_mask", "loss_mask")
OPTIONAL = (("ref_log_prob", "ref_log_prob"), ("entropys", "entropy"), ("rollout_log_probs", "rollout_log_probs"))
stats = {"steps": 0, "rows": 0, "dropped_steps": 0, "failed_steps": 0}

_queue: queue.Queue[tuple[dict[str, Any], list[tuple[int, str]], dict[str, str] | None]] = queue.Queue(MAX_PENDING)
_thread: threading.Thread | None = None
_thread_lock = threading.Lock()
_warned_at = 0.0


def _numpy(tensor: Any) -> Any:
    return tensor.detach().cpu().numpy() if hasattr(tensor, "detach") else tensor


def _b64(values: Any, dtype: str) -> str:
    return base64.b64encode(values.astype(dtype, copy=False).tobytes()).decode()


def rows_of(tensors: dict[str, Any], kept: list[tuple[int, str]]) -> list[tuple[str, dict[str, str]]]:
    """(trace id, trainer_tokens) per kept row: valid prompt (left-padded) and response (right-padded) parts."""
    arrays = {k: _numpy(v) for k, v in tensors.items()}
    prompts, responses, attention = arrays.get("prompts"), arrays["responses"], arrays.get("attention_mask")
    if prompts is None and attention is None:
        raise ValueError("a row needs prompts or attention_mask to find its response")
    width = prompts.shape[-1] if prompts is not None else attention.shape[-1] - responses.shape[-1]  # type: ignore[union-attr]
    mask = arrays["mask"]
    out = []
    for i, trace_id in kept:
        if attention is not None:
            n_prompt, n_response = int(attention[i, :width].sum()), int(attention[i, width:].sum())
        else:
            n_prompt, n_response = width, int(mask[i].sum())
        row = {"response_ids": _b64(responses[i, :n_response], "<i4"), "mask": _b64(mask[i, :n_response], "u1"),
               "old_log_probs": _b64(arrays["old_log_probs"][i, :n_response], "<f4")}
        if prompts is not None:
            row["prompt_ids"] = _b64(prompts[i, width - n_prompt:], "<i4")
        for key, name in OPTIONAL:
            if key in arrays:
                row[name] = _b64(arrays[key][i, :n_response], "<f4")
        out.append((trace_id, row))
    return out


def send(trace_id: str, row: dict[str, str], route: str | None = None) -> None:
    """One annotation carrying the trainer's row (queued like every span: never blocks); ``route``: its
    trajectory's (client.tracing.ROUTE_ATTR), for a node with several gateways."""
    tracer = _tracer.active
    if tracer is None:
        return
    record = SpanRecord("trainer_tokens", KIND_ANNOTATION, _now(), None, {ROUTE_ATTR: route} if route else {})
    record.trace = _TraceRef(trace_id)  # type: ignore[assignment]
    record.end = record.start
    record.output = {"trainer_tokens": row}
    tracer.emit(record)


def _work(tensors: dict[str, Any], kept: list[tuple[int, str]], routes: dict[str, str] | None = None) -> None:
    for trace_id, row in rows_of(tensors, kept):
        send(trace_id, row, (routes or {}).get(trace_id))
    stats["rows"] += len(kept)


def _loop() -> None:
    while True:
        tensors, kept, routes = _queue.get()
        try:
            _work(tensors, kept, routes)
        except Exception:  # noqa: BLE001 - a malformed batch costs its rows, never the thread
            stats["failed_steps"] += 1
            log.debug("tracecar.verl: trainer rows not sent", exc_info=True)
        finally:
            _queue.task_done()


def _start() -> None:
    global _thread
    with _thread_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_loop, name="tracecar-trainer-tokens", daemon=True)
            _thread.start()


def tensors_of(batch: Any) -> dict[str, Any] | None:
    """References to the tensors a row needs (None when the batch lacks ids, a mask or old_log_probs)."""
    keys = batch.keys() if hasattr(batch, "keys") else ()
    mask = next((k for k in MASK_KEYS if k in keys), None)
    if "responses" not in keys or "old_log_probs" not in keys or mask is None:
        return None
    out = {"responses": batch["responses"], "old_log_probs": batch["old_log_probs"], "mask": batch[mask]}
    for key in ("prompts", "attention_mask", *(k for k, _ in OPTIONAL)):
        if key in keys:
            out[key] = batch[key]
    return out


def submit(batch: Any, kept: list[tuple[int, str]], background: bool = True, routes: dict[str, str] | None = None) -> bool:
    """Queues the kept rows of one step (False: nothing to send, or the queue was full and the step dropped)."""
    if not kept or _tracer.active is None:
        return False
    tensors = tensors_of(batch)
    if tensors is None:
        return False
    stats["steps"] += 1
    if not background:
        _work(tensors, kept, routes)
        return True
    _start()
    try:
        _queue.put_nowait((tensors, kept, routes))
    except queue.Full:
        stats["dropped_steps"] += 1
        _warn(f"tracecar: trainer rows of a step dropped ({stats['dropped_steps']} so far): the packing thread is "
              f"{MAX_PENDING} steps behind")
        return False
    return True


def drain(timeout_s: float = 30.0) -> bool:
    """Waits (bounded) until the queued steps are sent to the tracer (for tests and shutdown)."""
    deadline = time.monotonic() + timeout_s
    while _queue.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _queue.unfinished_tasks


def _warn(message: str) -> None:
    global _warned_at
    now = time.monotonic()
    if now - _warned_at >= 60 or not _warned_at:
        _warned_at = now
        log.warning(message)
