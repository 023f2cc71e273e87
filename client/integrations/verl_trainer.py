"""VERL trainer hook: tell the collector what the trainer did with each trajectory.

Rollouts are traced in the agent-loop workers; what happens to them next happens in the
trainer process: ``ray_trainer.compute_advantage`` gives each sequence its advantage, rollout
correction or a loss-mask rule may leave a sequence no token to train on, and under fully-async
training the weights that generated a trajectory are older than the step that trains on it.
:func:`hook_trainer` wraps ``verl.trainer.ppo.ray_trainer.compute_advantage`` (looked up by name
in ``RayPPOTrainer.fit`` at call time, so wrapping the module attribute is enough) and, after it
ran, annotates every traced trajectory of the batch::

    advantage           mean of data.batch["advantages"] over the sequence's response_mask
    trained             False when the mask left it no token (filtered_by="loss_mask"), else True
    policy_version      non_tensor_batch["min_global_steps"] (fully-async), when VERL set it
    trained_on_version  the trainer's global step
    reward_extra_info   the reward's components per sample (``meta_info["reward_extra_keys"]``: what
                        VERL's reward managers return beside the score, e.g. ``acc``, ``format``, ``pred``)
    ground_truth        ``non_tensor_batch["reward_model"][i]["ground_truth"]`` when the dataset has one
    fate                "trained", or "filtered" (``fate_reason="loss_mask"``) when the mask left no token
    min/max_global_steps  the policy versions that generated it (VERL v1 async ``extra_fields``)
    refill_of           the evicted group's uid, when this sample's group replaces one (verl_fate.py)

The link is the trajectory id the worker-side adapter (tracecar.client.verl) puts in each
``AgentLoopOutput.extra_fields["tracecar_trace_id"]``; VERL carries every extra field into the
batch's ``non_tensor_batch``. Trajectories the trainer drops before computing advantages (e.g.
DAPO's dynamic sampling) never reach this hook: annotate them with ``trained=False`` and
``filtered_by=...`` where they are dropped. Annotations are queued like spans: the hook costs
the driver a few vector sums per batch and never raises into the training loop.

Call ``hook_trainer()`` in the trainer process (e.g. at the top of your ``main_ppo`` entry, or
set ``TRACECAR_VERL_HOOK_TRAINER=1`` with the Ray ``worker_process_setup_hook`` so that
``tracecar.client.verl.install`` calls it where ``ray_trainer`` is importable).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from typing import Any

from .. import tracer as _tracer
from ..tracing import ROUTE_ATTR, annotate
from . import verl_fate, verl_tokens

TRACE_KEY = "tracecar_trace_id"
#: the trajectory's route (client.tracing.current_trajectory_route), carried beside its id: annotations posted
#: from the driver's node reach the gateway that holds the trajectory when nodes have several
ROUTE_KEY = "tracecar_route"
_FLAG = "__tracecar_trainer_hook__"
_MODULE = "verl.trainer.ppo.ray_trainer"

log = logging.getLogger("tracecar.verl")


def _plain(value: Any) -> Any:
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return value.item()
    return value


def _vector(values: Any) -> list[Any]:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _caller_step(depth: int = 2) -> int | None:
    """``self.global_steps`` of the trainer whose ``fit`` called compute_advantage."""
    try:
        trainer = sys._getframe(depth).f_locals.get("self")
    except ValueError:
        return None
    step = getattr(trainer, "global_steps", None)
    return step if type(step) is int else None


_SCALARS = (bool, int, float, str)


def _component(value: Any) -> Any:
    """A reward component as JSON: scalars as themselves (numpy's unwrapped), anything else dropped."""
    value = _plain(value)
    return value if type(value) in _SCALARS else None


def _reward_extras(data: Any, non_tensor: Any, n: int) -> list[dict[str, Any]]:
    """Per sample, the reward manager's extra info (the keys VERL's ``extract_reward`` reads)."""
    keys = list((getattr(data, "meta_info", None) or {}).get("reward_extra_keys") or [])
    columns = {k: non_tensor[k] for k in keys if k in non_tensor and len(non_tensor[k]) == n}
    out = []
    for i in range(n):
        info = {k: v for k, v in ((k, _component(c[i])) for k, c in columns.items()) if v is not None}
        out.append(info)
    return out


def _ground_truths(non_tensor: Any, n: int) -> list[Any]:
    models = non_tensor.get("reward_model")
    if models is None or len(models) != n:
        return [None] * n
    out = []
    for entry in models:
        truth = entry.get("ground_truth") if isinstance(entry, dict) else None
        truth = _plain(truth)
        if hasattr(truth, "tolist"):
            truth = truth.tolist()
        out.append(truth if isinstance(truth, (str, int, float, list, dict)) else None)
    return out


def annotate_batch(data: Any, step: int | None = None, trainer_tokens: bool | str = False) -> int:
    """Annotates each traced trajectory of a batch after ``compute_advantage``; returns how many."""
    non_tensor = getattr(data, "non_tensor_batch", None) or {}
    ids = non_tensor.get(TRACE_KEY)
    batch = getattr(data, "batch", None)
    if ids is None or batch is None or "advantages" not in batch.keys():
        return 0
    if step is None:
        step = _plain((getattr(data, "meta_info", None) or {}).get("global_steps"))
    advantages = batch["advantages"]
    mask = batch["response_mask"] if "response_mask" in batch.keys() else None
    if mask is None:
        totals, counts = _vector(advantages.sum(-1)), [advantages.shape[-1]] * len(ids)
    else:
        mask = mask.to(advantages.dtype) if hasattr(mask, "to") else mask.astype(advantages.dtype)
        totals, counts = _vector((advantages * mask).sum(-1)), _vector(mask.sum(-1))
    versions = non_tensor.get("min_global_steps")
    last_versions = non_tensor.get("max_global_steps")
    uids = non_tensor.get("uid")
    routes = non_tensor.get(ROUTE_KEY)
    trace_ids = _vector(ids)
    extras = _reward_extras(data, non_tensor, len(trace_ids))
    truths = _ground_truths(non_tensor, len(trace_ids))
    done = 0
    kept: list[tuple[int, str]] = []
    kept_routes: dict[str, str] = {}
    for i, trace_id in enumerate(trace_ids):
        trace_id = _plain(trace_id)
        if not isinstance(trace_id, str) or not trace_id:
            continue  # not traced (sampled out in the worker)
        count = float(counts[i])
        version = _plain(versions[i]) if versions is not None else None
        more: dict[str, Any] = {}
        if extras[i]:
            more["reward_extra_info"] = extras[i]
        if truths[i] is not None:
            more["ground_truth"] = truths[i]
        more["fate"] = "trained" if count > 0 else "filtered"
        if count <= 0:
            more["fate_reason"] = "loss_mask"
        for key, column in (("min_global_steps", versions), ("max_global_steps", last_versions)):
            value = _plain(column[i]) if column is not None else None
            if type(value) is int:
                more[key] = value
        route = _plain(routes[i]) if routes is not None else None
        if isinstance(route, str) and route:
            more[ROUTE_ATTR] = route
            kept_routes[trace_id] = route
        refill = verl_fate.refill_of(_plain(uids[i])) if uids is not None else None
        if refill is not None:
            more["refill_of"] = refill[0]
        annotate(trace_id, advantage=float(totals[i]) / count if count else None, trained=count > 0,
                 filtered_by=None if count > 0 else "loss_mask", trained_on_version=step if type(step) is int else None,
                 policy_version=version if type(version) is int else None, **more)
        if count > 0:
            kept.append((i, trace_id))
        done += 1
    if trainer_tokens:
        verl_tokens.submit(batch, kept, background=trainer_tokens != "sync", routes=kept_routes)
    return done


def _tokens_mode() -> bool | str:
    value = os.environ.get("TRACECAR_VERL_TRAINER_TOKENS", "1").strip().lower()
    return "sync" if value == "sync" else value not in ("0", "false", "no", "off")


def hook_trainer(module: Any = None, trainer_tokens: bool | str | None = None) -> bool:
    """Wraps ``ray_trainer.compute_advantage`` (idempotent); False when VERL's trainer is not importable.

    ``trainer_tokens`` (default ``TRACECAR_VERL_TRAINER_TOKENS``, on): also send each kept
    trajectory's row of the batch (ids, mask, old_log_probs; tracecar.client.verl_tokens) from a
    background thread; ``"sync"`` inline; False not at all.

    At its first call the wrapper configures the tracecar client from the environment
    (``TRACECAR_URL``) if this process has none yet: the trainer is not an agent-loop worker.
    """
    if module is None:
        try:
            module = importlib.import_module(_MODULE)
        except Exception:  # noqa: BLE001 - no VERL here: nothing to hook
            return False
    original = getattr(module, "compute_advantage", None)
    if original is None:
        return False
    if getattr(original, _FLAG, False):
        return True
    configured = [False]
    tokens = _tokens_mode() if trainer_tokens is None else trainer_tokens

    @functools.wraps(original)
    def compute_advantage(data: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(data, *args, **kwargs)
        try:
            if _tracer.active is None and not configured[0]:  # first call: this process's client, from the env
                configured[0] = True
                _tracer.configure()
            annotate_batch(result if result is not None else data, _caller_step(), trainer_tokens=tokens)
        except Exception:  # noqa: BLE001 - tracing never fails a training step
            log.debug("tracecar.verl: trainer annotations not sent", exc_info=True)
        return result

    setattr(compute_advantage, _FLAG, True)
    compute_advantage.__tracecar_original__ = original  # type: ignore[attr-defined]
    module.compute_advantage = compute_advantage
    verl_fate.hook_replay_buffer()  # v1 trainers: evictions and refills (a no-op where the v1 buffer is absent)
    return True


def unhook_trainer(module: Any = None) -> None:
    module = module or sys.modules.get(_MODULE)
    wrapped = getattr(module, "compute_advantage", None) if module is not None else None
    if getattr(wrapped, _FLAG, False):
        module.compute_advantage = wrapped.__tracecar_original__  # type: ignore[union-attr]
