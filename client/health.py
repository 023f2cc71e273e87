"""Tracing health in the trainer's W&B run: ``health()``, ``health_metrics()``, ``log_health(step)``.

A gap in traces (spans a worker dropped, a budget sampled out, a batch rejected, a tokenizer
that failed, a spool filling up) is silent unless it lands where the user looks: the run page.
Call ``log_health(step)`` from the trainer once per step (VERL: next to ``logger.log``); it
asks the collector's ``GET /v1/health`` (one small request, ``timeout_s`` bound) and logs the
totals as ``tracecar/...`` metrics into the active ``wandb`` run. It runs on the trainer's
thread between steps, never in the generation loop, and never raises: a failure is logged
(once a minute) and returns None. With ``background=True`` it returns at once and does the
request and the log on a daemon thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import httpx

from . import tracer as _tracer
from .loud import check_url
from .redact import DEFAULT as DEFAULT_REDACT
from .spans import safe_str

log = logging.getLogger("tracecar.client.health")

PREFIX = "tracecar/"
_GROUPS = ("client_dropped", "sampled_out", "trajectories_dropped", "rejected", "batches_rejected",
           "decode_failures", "forward_failures")
_SCALARS = ("spans_received", "spans_accepted", "spans_forwarded", "spans_dead_lettered", "spool_depth",
            "held_spans", "backend_unreachable")
_warned_at = 0.0
_unsaid = 0  # failures since the last line
_warn_lock = threading.Lock()


def _settings(url: str | None, token: str | None) -> tuple[str | None, str | None]:
    tracer = _tracer.active
    if url is None:
        url = tracer.config.url if tracer is not None else os.environ.get("TRACECAR_URL")
    if token is None:
        token = tracer.config.token if tracer is not None else os.environ.get("TRACECAR_TOKEN")
    if url and "://" not in url:
        url = check_url(url.strip())[0]
    return (url.rstrip("/") if url else None), token


def health(url: str | None = None, *, token: str | None = None, timeout_s: float = 2.0, step: int | None = None) -> dict[str, Any]:
    """The collector's ``/v1/health`` totals, plus this process's own sender counters
    (``this_process``, when tracing is on here). Raises on failure (see :func:`log_health`).

    ``step``: also that step's numbers (``answer["step"]``: stored, trainer, turn drift, ...)."""
    base, token = _settings(url, token)
    if not base:
        raise RuntimeError("no collector URL: set TRACECAR_URL or pass url=")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(base + "/v1/health", headers=headers, timeout=timeout_s, params={"step": step} if step is not None else None)
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    tracer = _tracer.active
    if tracer is not None:
        answer["this_process"] = tracer.stats()
    return answer


def health_metrics(answer: dict[str, Any] | None = None, prefix: str = PREFIX, *, timeout_s: float = 2.0) -> dict[str, float]:
    """A ``/v1/health`` answer as flat metrics: ``tracecar/client_dropped/queue_full``,
    ``tracecar/client_dropped_total``, ``tracecar/spool_depth``, ...

    Without ``answer`` it asks the collector, and on failure logs (once a minute) and returns
    ``{}``: ``metrics.update(health_metrics())`` before VERL's ``logger.log(data=metrics, ...)``
    puts them on every tracking backend the trainer logs to, and never raises.
    """
    if answer is None:
        try:
            answer = health(timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001 - advisory: never break the trainer
            _warn(f"tracecar: could not read the collector's health: {type(exc).__name__}: {safe_str(exc)}")
            return {}
    out: dict[str, float] = {}
    for group in _GROUPS:
        for reason, value in sorted((answer.get(group) or {}).items()):
            out[f"{prefix}{group}/{reason or 'none'}"] = value
        out[f"{prefix}{group}_total"] = answer.get(group + "_total", 0)
    for key in _SCALARS:
        if key in answer:
            out[prefix + key] = answer[key]
    out.update(step_truth_metrics(answer.get("step"), prefix))
    return out


def step_truth_metrics(step: dict[str, Any] | None, prefix: str = PREFIX) -> dict[str, float]:
    """A step's training truth (issue 29) as ``tracecar/step/...`` metrics: turn drift (multi-turn
    trajectories whose turn k+1 prompt does not extend turn k's prompt + response, and their share)."""
    if not isinstance(step, dict):
        return {}
    out: dict[str, float] = {}
    drift = step.get("drift") or {}
    if drift:
        out[prefix + "step/multi_turn"] = drift.get("multi_turn", 0)
        out[prefix + "step/drift_trajectories"] = drift.get("with_drift", 0)
        out[prefix + "step/drift_share"] = drift.get("share") or 0.0
        out[prefix + "step/drift_turns"] = drift.get("turns_drifted", 0)
    trainer = step.get("trainer_vs_rollout") or {}
    if trainer.get("compared"):
        out[prefix + "step/trainer_compared"] = trainer["compared"]
        out[prefix + "step/token_mismatch"] = trainer.get("with_token_mismatch", 0)
        out[prefix + "step/token_mismatch_share"] = trainer.get("mismatch_share") or 0.0
        for key in ("mean", "p99", "max"):
            if trainer.get("logprob_diff_" + key) is not None:
                out[prefix + "step/logprob_diff_" + key] = trainer["logprob_diff_" + key]
    fates = step.get("fates") or {}
    if fates:
        for fate in ("trained", "filtered", "evicted", "not_reached"):
            out[prefix + "step/fate/" + fate] = fates.get(fate, 0)
        for reason, n in sorted((fates.get("evicted_by") or {}).items()):
            out[prefix + "step/evicted/" + reason] = n
        out[prefix + "step/refills"] = fates.get("refills", 0)
        out[prefix + "step/multi_version"] = fates.get("multi_version", 0)
        if fates.get("staleness_max") is not None:
            out[prefix + "step/staleness_mean"] = fates["staleness_mean"]
            out[prefix + "step/staleness_max"] = fates["staleness_max"]
    return out


def log_health(step: int | None = None, *, run: Any = None, url: str | None = None, token: str | None = None,
               timeout_s: float = 2.0, background: bool = False, truth_step: int | None = None) -> dict[str, float] | None:
    """Logs the collector's health totals into the W&B run (``run``, else ``wandb.run``).

    With ``step`` the metrics go to that step (call it before the trainer logs a later one);
    without, they join the run's next commit. With a step, the rollouts of step ``truth_step``
    (default: ``step``) add their training truth as ``tracecar/step/*`` (turn drift, ...).
    Returns the metrics logged (None on failure, or at once with ``background=True``). Never
    raises into the trainer.
    """
    if background:
        threading.Thread(target=log_health, args=(step,), daemon=True, name="tracecar-health",
                         kwargs={"run": run, "url": url, "token": token, "timeout_s": timeout_s, "truth_step": truth_step}).start()
        return None
    try:
        metrics = health_metrics(health(url, token=token, timeout_s=timeout_s, step=truth_step if truth_step is not None else step))
    except Exception as exc:  # noqa: BLE001 - health is advisory: never break the trainer
        _warn(f"tracecar: could not read the collector's health: {type(exc).__name__}: {safe_str(exc)}")
        return None
    try:
        target = run if run is not None else _wandb_run()
        if target is not None:
            if step is None:
                target.log(metrics, commit=False)
            else:
                target.log(metrics, step=step)
    except Exception as exc:  # noqa: BLE001
        _warn(f"tracecar: could not log health metrics to W&B: {type(exc).__name__}: {safe_str(exc)}")
        return None
    return metrics


def _wandb_run() -> Any:
    try:
        import wandb
    except ImportError:
        return None
    return wandb.run


def _warn(message: str) -> None:
    """At most one line a minute (a trainer calls this every step), with how many failed since the
    last line; ``key=value`` secrets an error's text may carry (``api_key=…``, an ``Authorization``
    header) scrubbed."""
    global _warned_at, _unsaid
    with _warn_lock:
        _unsaid += 1
        now = time.monotonic()
        if now - _warned_at < 60 and _warned_at:
            return
        _warned_at, count, _unsaid = now, _unsaid, 0
    log.warning("%s (%d failure(s) since the last such line; said at most once a minute)", DEFAULT_REDACT.scrub_text(message), count)
