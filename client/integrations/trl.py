"""TRL's ``GRPOTrainer``: every scored completion becomes a tracecar trajectory.

    from tracecar.client.integrations.trl import TracecarCallback

    trainer = GRPOTrainer(model=..., reward_funcs=[...], args=GRPOConfig(...), train_dataset=...)
    trainer.add_callback(TracecarCallback(trainer))      # TRACECAR_URL set in the trainer's environment
    trainer.train()

TRL's own callbacks that need more than the ``TrainerCallback`` events (``LogCompletionsCallback``,
``WeaveCallback``) take the trainer; so does this one. The events alone do not carry what GRPO
computes per completion, so the callback wraps, on this trainer instance only, the two methods
where it is computed: ``_generate`` (the prompt and completion token ids, the tool mask, the
sampling log-probabilities when vLLM returns them) and ``_generate_and_score_completions`` (after
which TRL's completion log, ``trainer._logs``, holds the batch's prompts, completions, each reward
function's reward and the advantages, gathered from every process). Each process sends its own
rows; nothing is gathered for tracecar and nothing waits on the network.

Per completion (docs/integrations.md, TRL): a root ``grpo_rollout`` with ``step`` (the global
step that generated it), ``sample_index`` (its GRPO group: a running group number, as TRL's async
GRPO ``group_id``), ``rollout_n`` (its place in the group), ``validate`` (evaluation) and the
experiment (``TRACECAR_EXPERIMENT``, else the run name); a ``generate`` child with the prompt
(``messages`` when conversational), the completion, ``prompt_ids`` / ``response_ids`` /
``response_mask`` (tool tokens 0) / ``response_logprobs``; and an annotation with the total
``reward`` (TRL's weighted sum), ``rewards/<function>`` per reward function, the ``advantage`` and
``policy_version`` (the global step).
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from .. import tracer as _tracer
from ..spans import KIND_ANNOTATION, KIND_OP, KIND_TRAJECTORY, SpanRecord
from ..tracing import _TraceRef

try:  # by name: the thin client neither needs transformers nor type-checks against it
    TrainerCallback: Any = importlib.import_module("transformers").TrainerCallback
except ImportError:  # without transformers the module still imports (and the callback says what it needs)
    TrainerCallback = object

log = logging.getLogger("tracecar.client")

ROOT_NAME = "grpo_rollout"


SPANS_PER_COMPLETION = 3  # its generate call, its trajectory, its annotation (TracecarCallback._send)


def _count_lost(inputs: Any, sent: int) -> None:
    """A batch whose completions could not all be traced (``sent`` of them were): the others'
    spans counted as the sender's ``integration_error`` drops (``get_tracer().stats()``, and
    ``tracecar_client_dropped_spans_total`` on the collector with the sender's next report), so the
    gap is not silent. Never raises (it runs in the handler that keeps tracing out of training)."""
    try:
        tracer = _tracer.active
        lost = len(inputs) - sent
        if tracer is None or lost <= 0:
            return
        sender = tracer.sender
        with sender._lock:  # as the caller's own drops (sender.enqueue)
            sender.stats.drop("integration_error", lost * SPANS_PER_COMPLETION)
    except Exception:  # noqa: BLE001 - an input without a length: the log line already says the batch failed
        log.debug("tracecar: TRL losses not counted", exc_info=True)


class TracecarCallback(TrainerCallback):
    """Sends each completion a ``GRPOTrainer`` scores to the collector (see the module)."""

    def __init__(self, trainer: Any, experiment: str | None = None) -> None:
        if TrainerCallback is object:
            raise ImportError("tracecar's TRL callback needs transformers (pip install trl)")
        self.trainer = trainer
        self.experiment = experiment
        self.groups_seen = 0  # GRPO groups sent so far (every process counts the same): the next group's id
        self.sent = 0
        self.failures = 0
        self._generation: tuple[float, float, Any] | None = None
        self._wrap()

    # ---- the two wrapped methods --------------------------------------------------------------
    def _wrap(self) -> None:
        trainer = self.trainer
        if getattr(trainer, "_tracecar_callback", None) is not None:
            raise ValueError("this trainer already has a TracecarCallback")
        missing = [name for name in ("_generate", "_generate_and_score_completions", "_logs", "accelerator", "num_generations")
                   if not hasattr(trainer, name)]
        if missing:
            raise TypeError(f"TracecarCallback needs TRL's GRPOTrainer (trl 1.x); {type(trainer).__name__} has no {', '.join(missing)}")
        generate, score = trainer._generate, trainer._generate_and_score_completions

        def traced_generate(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            result = generate(*args, **kwargs)
            self._generation = (start, time.time(), result)
            return result

        def traced_score(inputs: Any, *args: Any, **kwargs: Any) -> Any:
            self._generation = None
            output = score(inputs, *args, **kwargs)
            sent = self.sent
            try:
                self._send(inputs)
            except Exception:  # noqa: BLE001 - tracing never raises into training
                self.failures += 1
                _count_lost(inputs, self.sent - sent)
                if self.failures == 1:
                    log.exception("tracecar: TRL completions of this batch not traced (later failures counted only, "
                                  "as integration_error drops)")
            return output

        trainer._generate = traced_generate
        trainer._generate_and_score_completions = traced_score
        trainer._tracecar_callback = self

    # ---- one generation batch -----------------------------------------------------------------
    def _send(self, inputs: Sequence[Any]) -> None:
        tracer = _tracer.active
        trainer = self.trainer
        logs = trainer._logs
        n_local = len(inputs)
        processes = trainer.accelerator.num_processes
        rank = trainer.accelerator.process_index
        evaluating = not trainer.model.training
        group_size = (getattr(trainer, "num_generations_eval", None) if evaluating else None) or trainer.num_generations
        n_global = n_local * processes
        first_group = self.groups_seen
        self.groups_seen += max(1, n_global // max(1, group_size))
        if tracer is None or n_local == 0:
            return
        step = int(trainer.state.global_step)
        experiment = self.experiment or tracer.config.experiment or getattr(trainer.args, "run_name", None)
        names = list(getattr(trainer, "reward_func_names", []) or [])
        weights = [float(w) for w in trainer.reward_weights.tolist()] if hasattr(trainer, "reward_weights") else [1.0] * len(names)
        prompts, completions = _tail(logs["prompt"], n_global), _tail(logs["completion"], n_global)
        advantages = _tail(logs["advantages"], n_global)
        rewards = {name: _tail(logs["rewards"][name], n_global) for name in names}
        extra = {column: _tail(values, n_global) for column, values in logs.get("extra", {}).items()}
        generation = self._generation
        start, end, generated = generation if generation is not None else (time.time(), time.time(), None)
        ids = _generated_ids(generated, n_local)
        for row in range(n_local):
            at = rank * n_local + row  # this row's place in the gathered lists: its group is at // group_size
            root = SpanRecord(ROOT_NAME, KIND_TRAJECTORY, start, None, None)
            attributes: dict[str, Any] = {"step": step, "sample_index": first_group + at // group_size,
                                          "rollout_n": at % group_size, "validate": evaluating, "source": "trl"}
            if experiment is not None:
                attributes["experiment_name"] = str(experiment)
            root.attributes = {**attributes, "tracecar": {"trajectory": True}}
            call = SpanRecord("generate", KIND_OP, start, root, {**attributes, "tracecar": {"top": True}})
            call.kwargs = _prompt_inputs(_at(prompts, at), ids[0][row] if ids else None)
            call.output = _completion_output(_at(completions, at), ids, row)
            call.end = end
            root.end = time.time()
            note_values: dict[str, Any] = {"policy_version": step}
            total, scored = 0.0, False
            for i, name in enumerate(names):
                value = _number(_at(rewards[name], at))
                note_values[f"rewards/{name}"] = value
                if value is not None:
                    total += value * (weights[i] if i < len(weights) else 1.0)
                    scored = True
            if scored:
                note_values["reward"] = total
            advantage = _number(_at(advantages, at))
            if advantage is not None:
                note_values["advantage"] = advantage
            for column, values in extra.items():
                value = _at(values, at)
                if value is None or type(value) in (str, int, bool) or (type(value) is float and math.isfinite(value)):
                    note_values[f"extra/{column}"] = value
            note = SpanRecord("annotation", KIND_ANNOTATION, root.end, None, {k: v for k, v in note_values.items() if v is not None})
            note.trace = _TraceRef(root.span_id)  # type: ignore[assignment]
            note.end = note.start
            tracer.emit(call)
            tracer.emit(root)
            tracer.emit(note)
            self.sent += 1

    # ---- TrainerCallback events ---------------------------------------------------------------
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Waits (bounded by TRACECAR_SHUTDOWN_TIMEOUT_S) for the last batches to be sent."""
        tracer = _tracer.active
        if tracer is not None:
            tracer.flush(tracer.config.shutdown_timeout_s)


def _tail(values: Any, n: int) -> list[Any]:
    """The last ``n`` entries of one of TRL's log deques (those the batch just added); fewer if the
    deque is shorter (its bound is the generation batch): rows before them are then unknown."""
    items = list(values)
    return items[-n:] if len(items) >= n else [None] * (n - len(items)) + items


def _at(values: list[Any], i: int) -> Any:
    return values[i] if 0 <= i < len(values) else None


def _number(value: Any) -> float | None:
    """A finite float (TRL logs a reward function's None as NaN), else None."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _generated_ids(generated: Any, n: int) -> tuple[list[Any], list[Any], Any, Any] | None:
    """(prompt ids, completion ids, tool masks, sampling logprobs) per local row from ``_generate``'s
    result (TRL ≥ 1.0: prompt_ids, completion_ids, tool_mask, completions, logprobs, ...); None when
    it is not that shape."""
    if not isinstance(generated, tuple) or len(generated) < 5:
        return None
    prompt_ids, completion_ids, tool_mask, _, logprobs = generated[:5]
    if not (isinstance(prompt_ids, list) and isinstance(completion_ids, list) and len(prompt_ids) == len(completion_ids) == n):
        return None
    return prompt_ids, completion_ids, tool_mask if isinstance(tool_mask, list) else None, logprobs if isinstance(logprobs, list) else None


def _prompt_inputs(prompt: Any, prompt_ids: Any) -> dict[str, Any]:
    inputs: dict[str, Any] = {"messages": prompt} if _is_chat(prompt) else {"prompt": prompt}
    if prompt_ids is not None:
        inputs["prompt_ids"] = list(prompt_ids)
    return inputs


def _completion_output(completion: Any, ids: tuple[list[Any], list[Any], Any, Any] | None, row: int) -> dict[str, Any]:
    output: dict[str, Any] = {"completion": completion}
    text = completion if isinstance(completion, str) else _chat_text(completion)
    if text is not None:
        output["response_text"] = text  # the collector's decode of response_ids replaces it when it has the tokenizer
    if ids is not None:
        output["response_ids"] = list(ids[1][row])
        if ids[2] is not None and row < len(ids[2]) and ids[2][row] is not None:
            output["response_mask"] = list(ids[2][row])
        if ids[3] is not None and row < len(ids[3]) and ids[3][row] is not None:
            output["response_logprobs"] = [float(v) for v in ids[3][row]]
    return output


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _chat_text(messages: Any) -> str | None:
    if not _is_chat(messages):
        return None
    parts = []
    for message in messages:
        content = message.get("content")
        parts.append(content if isinstance(content, str) else str(content))
    return "\n".join(parts)
