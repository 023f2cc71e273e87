"""VERL v1 replay buffer hook: tell the collector which trajectories were evicted, why, and which groups refill them.

VERL's v1 trainers (``trainer.v1.trainer_mode``) keep rollouts in a replay buffer
(``verl.trainer.ppo.v1.replay_buffer.ReplayBuffer``) and evict whole prompt groups before they
are trained on: *stale* (their policy versions span more than ``max_off_policy_threshold``),
*filter* (DAPO: every rollout scored the same) or *failure* (a session raised); each evicted
group is replaced by a fresh prompt (``refill_fn``). :func:`hook_replay_buffer` wraps the
buffer's ``_evict_terminal_groups`` and, before the groups are cleared, reads their
trajectories' ``extra_fields`` (one ``kv_batch_get`` of the evicted keys only: where the
worker-side adapter put ``tracecar_trace_id``) and annotates each::

    fate="evicted", fate_reason="stale" | "filter" | "failure", evicted_at_step=<global step>,
    min_global_steps / max_global_steps (the buffer's tags: the policy versions that generated it)

It also wraps the buffer's ``refill_fn`` so that the prompts submitted to replace evicted groups
are remembered by their ``uid`` (through the trainer's ``_submit_batch_to_rollout``); when such
a group reaches the trainer, :func:`tracecar.client.verl_trainer.annotate_batch` marks its
trajectories ``refill_of=<the evicted group's uid>``. Never raises into the trainer; bounded
memory (``MAX_REFILLS`` uids).
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from collections import OrderedDict, deque
from typing import Any

from ..tracing import annotate

_MODULE = "verl.trainer.ppo.v1.replay_buffer"
_FLAG = "__tracecar_fate_hook__"
TRACE_KEY = "tracecar_trace_id"
MAX_REFILLS = 65536

log = logging.getLogger("tracecar.verl")

_lock = threading.Lock()
_evicted: deque[tuple[str, str]] = deque(maxlen=MAX_REFILLS)  # (evicted uid, reason) awaiting a refill
_refills: OrderedDict[str, tuple[str, str]] = OrderedDict()  # refill uid -> (evicted uid, reason)
_refilling = threading.local()


def refill_of(uid: Any) -> tuple[str, str] | None:
    """(evicted group uid, reason) when ``uid`` is a group submitted to replace an evicted one."""
    if not _refills or uid is None:  # no refill noted (the common case): no lock, no string
        return None
    with _lock:
        return _refills.get(str(uid))


def _extra_fields(value: Any) -> dict[str, Any]:
    value = getattr(value, "data", value)  # tensordict's NonTensorData
    return value if isinstance(value, dict) else {}


def _reasons(eviction_reasons: Any) -> dict[str, str]:
    stale, dapo, failed = (set(eviction_reasons[i] or ()) for i in range(3))
    reasons = {uid: "failure" for uid in failed}
    reasons.update({uid: "filter" for uid in dapo})
    reasons.update({uid: "stale" for uid in stale})  # the first reason VERL counts
    return reasons


def note_evictions(buffer: Any, tq: Any, global_steps: int, partition_id: str, eviction_reasons: Any) -> int:
    """Annotates the trajectories of the groups about to be evicted; returns how many."""
    reasons = _reasons(eviction_reasons)
    if not reasons:
        return 0
    tags = buffer.partitions[partition_id]
    keys = [k for k in tags if k.split("_")[0] in reasons]
    done = 0
    if keys:
        data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["extra_fields"])
        for key, extra in zip(keys, list(data["extra_fields"]), strict=True):
            trace_id = _extra_fields(extra).get(TRACE_KEY)
            if not isinstance(trace_id, str) or not trace_id:
                continue  # not traced
            tag = tags.get(key) or {}
            versions = {k: tag[k] for k in ("min_global_steps", "max_global_steps") if type(tag.get(k)) is int}
            annotate(trace_id, fate="evicted", fate_reason=reasons[key.split("_")[0]], evicted_at_step=global_steps, **versions)
            done += 1
    with _lock:
        _evicted.extend(sorted(reasons.items()))
    return done


def _remember_refills(batch: Any) -> None:
    """The uids of a batch submitted while a refill runs: each replaces one evicted group, oldest first."""
    uids = list((getattr(batch, "non_tensor_batch", None) or {}).get("uid", ()))
    with _lock:
        for uid in dict.fromkeys(str(u) for u in uids):
            if not _evicted:
                break
            _refills[uid] = _evicted.popleft()
            while len(_refills) > MAX_REFILLS:
                _refills.popitem(last=False)


def _watch_refills(buffer: Any) -> None:
    """Wraps (once) the buffer's refill_fn and its trainer's ``_submit_batch_to_rollout``."""
    refill = getattr(buffer, "refill_fn", None)
    if refill is None or getattr(refill, _FLAG, False):
        return
    trainer = getattr(refill, "__self__", None)
    submit = getattr(trainer, "_submit_batch_to_rollout", None) if trainer is not None else None
    if submit is not None and not getattr(submit, _FLAG, False):
        @functools.wraps(submit)
        def submit_batch(batch: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(_refilling, "on", False):
                try:
                    _remember_refills(batch)
                except Exception:  # noqa: BLE001 - tracing never fails a training step
                    log.debug("tracecar.verl: refill not noted", exc_info=True)
            return submit(batch, *args, **kwargs)

        setattr(submit_batch, _FLAG, True)
        trainer._submit_batch_to_rollout = submit_batch  # type: ignore[union-attr]

    @functools.wraps(refill)
    def refill_fn(*args: Any, **kwargs: Any) -> Any:
        _refilling.on = True
        try:
            return refill(*args, **kwargs)
        finally:
            _refilling.on = False

    setattr(refill_fn, _FLAG, True)
    buffer.refill_fn = refill_fn


def hook_replay_buffer(module: Any = None) -> bool:
    """Wraps ``ReplayBuffer._evict_terminal_groups`` (idempotent); False when VERL's v1 buffer is not importable."""
    if module is None:
        try:
            module = importlib.import_module(_MODULE)
        except Exception:  # noqa: BLE001 - no VERL v1 (or no transfer_queue) here: nothing to hook
            return False
    cls = getattr(module, "ReplayBuffer", None)
    original = getattr(cls, "_evict_terminal_groups", None)
    if original is None:
        return False
    if getattr(original, _FLAG, False):
        return True

    @functools.wraps(original)
    def _evict_terminal_groups(self: Any, global_steps: int, partition_id: str, eviction_reasons: Any) -> Any:
        try:
            _watch_refills(self)
            note_evictions(self, module.tq, global_steps, partition_id, eviction_reasons)
        except Exception:  # noqa: BLE001 - tracing never fails a training step
            log.debug("tracecar.verl: evictions not annotated", exc_info=True)
        return original(self, global_steps, partition_id, eviction_reasons)

    setattr(_evict_terminal_groups, _FLAG, True)
    _evict_terminal_groups.__tracecar_original__ = original  # type: ignore[attr-defined]
    cls._evict_terminal_groups = _evict_terminal_groups  # type: ignore[union-attr]
    return True


def unhook_replay_buffer(module: Any = None) -> None:
    module = module or importlib.import_module(_MODULE)
    cls = getattr(module, "ReplayBuffer", None)
    wrapped = getattr(cls, "_evict_terminal_groups", None)
    if getattr(wrapped, _FLAG, False):
        cls._evict_terminal_groups = wrapped.__tracecar_original__  # type: ignore[union-attr]
    with _lock:
        _evicted.clear()
        _refills.clear()
