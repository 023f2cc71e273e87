"""VERL-compatible tracing helpers: ``rollout_trace_op`` and ``rollout_trace_attr``.

Same call pattern as ``verl.utils.rollout_trace``: decorate agent-loop and tool methods with
``rollout_trace_op``; wrap each trajectory in ``rollout_trace_attr(sample_index, step,
rollout_n, name, validate, trace)``. The context manager opens a trajectory span (the root of
its trace) carrying those attributes plus the experiment name; every decorated call inside it
becomes a child of the innermost enclosing call. Context lives in a ContextVar, so concurrent
asyncio tasks never mix their trajectories.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import numbers
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from . import tracer as _tracer
from .spans import KIND_ANNOTATION, KIND_OP, KIND_TRAJECTORY, SpanRecord, _LazySignature, outer_stack

KIND_MEMBERSHIP = "membership"

F = TypeVar("F", bound=Callable[..., Any])
_now = time.time

#: Attribute key of a span's place in its trajectory, for Weave (VERL's weave backend makes no
#: call for ``rollout_trace_attr``, so a trajectory's top-level calls are the trace roots there):
#: ``{"trajectory": True}`` on a root trajectory (not a Weave call), ``{"top": True}`` on its
#: top-level calls, ``{"root": <top-level call>, "turn": <its child>}`` on everything under one
#: (a child's dict is shared by reference with its descendants, so this costs a dict copy only
#: per trajectory and per direct child of a top-level call).
MARK = "tracecar"
_TRAJECTORY = {"trajectory": True}
_TOP = {"top": True}
# open root trajectories (by record number) -> the attributes their top-level calls share:
# made once per trajectory, not once per call
_top_attributes: dict[int, dict[str, Any]] = {}


def rollout_trace_op(func: F) -> F:
    """Traces a sync or async function or method: inputs (bound args minus self), output, exception."""
    name = getattr(func, "__qualname__", getattr(func, "__name__", "op"))
    signature = _LazySignature(func)
    current = _tracer.current

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            tracer = _tracer.active
            if tracer is None:  # tracing off: one global read
                return await func(*args, **kwargs)
            parent = current.get()
            if parent is _tracer.DISABLED:
                return await func(*args, **kwargs)
            attributes = _attributes_of(parent)
            deep = tracer.deep_inputs  # TRACECAR_SNAPSHOT=deep: every argument copied all the way down now
            if deep is None:
                record = SpanRecord(name, KIND_OP, _now(), parent, attributes, signature, args, kwargs, tracer.copy_dicts)
            else:
                record = SpanRecord(name, KIND_OP, _now(), parent, attributes, signature, *deep(args, kwargs))
            if attributes is not None and attributes.get(MARK) is _TOP and parent.kind is KIND_OP:
                _mark_turn(record, parent)
            tracer.opened(record)
            token = current.set(record)
            try:
                result = await func(*args, **kwargs)
            except BaseException as exc:
                _failed(tracer, record, exc)
                raise
            finally:
                current.reset(token)
            record.output = tracer.snapshot(result)  # weave records the output as it was at finish
            record.end = _now()
            tracer.emit(record)
            return result

        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tracer = _tracer.active
        if tracer is None:  # tracing off: one global read
            return func(*args, **kwargs)
        parent = current.get()
        if parent is _tracer.DISABLED:
            return func(*args, **kwargs)
        attributes = _attributes_of(parent)
        deep = tracer.deep_inputs  # TRACECAR_SNAPSHOT=deep: every argument copied all the way down now
        if deep is None:
            record = SpanRecord(name, KIND_OP, _now(), parent, attributes, signature, args, kwargs, tracer.copy_dicts)
        else:
            record = SpanRecord(name, KIND_OP, _now(), parent, attributes, signature, *deep(args, kwargs))
        if attributes is not None and attributes.get(MARK) is _TOP and parent.kind is KIND_OP:
            _mark_turn(record, parent)
        tracer.opened(record)
        token = current.set(record)
        try:
            result = func(*args, **kwargs)
        except BaseException as exc:
            _failed(tracer, record, exc)
            raise
        finally:
            current.reset(token)
        record.output = tracer.snapshot(result)  # weave records the output as it was at finish
        record.end = _now()
        tracer.emit(record)
        return result

    return wrapper  # type: ignore[return-value]


def _failed(tracer: _tracer.Tracer, record: SpanRecord, exception: BaseException) -> None:
    """Ends a call that raised and queues it: the exception by reference and the (code, line) pairs
    of the frames above; weave's traceback shape is built on the sender thread. (A call that
    returns is ended inline in the wrappers: a shallow snapshot of the output, the end time.)"""
    record.exception = exception
    record.exc_stack = outer_stack(exception)
    record.end = _now()
    tracer.emit(record)


def _attributes_of(parent: SpanRecord | None) -> dict[str, Any] | None:
    """The parent's attributes (shared, not copied); a trajectory root's children get a copy
    marked top-level."""
    if parent is None:
        return None
    if parent.kind is KIND_TRAJECTORY and parent.parent is None and parent.attributes is not None:
        marked = _top_attributes.get(parent.number)
        if marked is None:  # e.g. a call made after its trajectory closed
            marked = {**parent.attributes, MARK: _TOP}
        return marked
    return parent.attributes


def _mark_turn(record: SpanRecord, top: SpanRecord) -> None:
    """A direct child of a top-level call: a turn of the trajectory's thread in Weave."""
    record.attributes = {**(top.attributes or {}), MARK: {"root": top.span_id, "turn": record.span_id}}


@contextlib.contextmanager
def rollout_trace_attr(
    sample_index: int | str | None = None,
    step: int | None = None,
    rollout_n: int | None = None,
    name: str = "rollout_trace",
    validate: bool = False,
    trace: bool = True,
    **extra_attributes: Any,
) -> Iterator[SpanRecord | None]:
    """Marks one trajectory: its calls share a trace whose root carries these attributes.

    ``None`` attributes are left out (as VERL does); ``trace=False`` runs everything inside
    untraced. Yields the trajectory record (or None when tracing is off), whose ``span_id`` can
    be passed to :func:`annotate` after the context ends (e.g. to attach the reward).
    """
    tracer = _tracer.active
    current = _tracer.current
    if not trace:
        token = current.set(_tracer.DISABLED)
        try:
            yield None
        finally:
            current.reset(token)
        return
    if tracer is None or current.get() is _tracer.DISABLED:
        yield None
        return
    parent = current.get()
    attributes: dict[str, Any] = dict(parent.attributes or {}) if parent is not None else {}
    for key, value in (("sample_index", _index(sample_index)), ("step", step), ("rollout_n", rollout_n)):
        if value is not None:
            attributes[key] = value
    attributes["validate"] = validate
    if tracer.config.experiment is not None:
        attributes["experiment_name"] = tracer.config.experiment
    attributes.update({k: v for k, v in extra_attributes.items() if v is not None})
    record = SpanRecord(name, KIND_TRAJECTORY, _now(), parent, attributes)
    if attributes.get(MARK) is _TOP and parent is not None:  # nested right under a top-level call
        attributes[MARK] = {"root": parent.span_id, "turn": record.span_id}
    if parent is None:
        _top_attributes[record.number] = {**attributes, MARK: _TOP}
        attributes[MARK] = _TRAJECTORY
    tracer.opened(record)
    token = current.set(record)
    try:
        yield record
    except BaseException as exc:
        record.exception = exc
        record.exc_stack = outer_stack(exc)
        raise
    finally:
        current.reset(token)
        _top_attributes.pop(record.number, None)
        record.end = _now()
        tracer.emit(record)


def _index(sample_index: Any) -> Any:
    """A sample index the collector can budget by (an int within 64 bits, or a string): a float one
    (pandas reads an integer column with gaps as float64, and VERL passes ``extra_info.index`` on)
    or a numpy integer would cost the whole trajectory, refused by name; a whole number becomes
    that int, anything else numeric its text."""
    if isinstance(sample_index, (str, bool)) or sample_index is None:
        return sample_index
    if isinstance(sample_index, numbers.Integral):  # np.int64 included
        whole = int(sample_index)
        return whole if _INT64_MIN <= whole <= _INT64_MAX else str(whole)
    if isinstance(sample_index, numbers.Real):  # float, np.float64
        real = float(sample_index)
        if real.is_integer() and _INT64_MIN <= real <= _INT64_MAX:
            return int(real)
        return str(sample_index)
    return sample_index


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def announce_step(step: int, sample_indices: Any, *, validate: bool = False, **extra_attributes: Any) -> None:
    """Tells the collector every sample index one rollout call of ``step`` will trace.

    Call it before the call's trajectories start (VERL's adapter does, per
    ``generate_sequences``): with the whole list the collector's head budget keeps a uniform,
    seeded choice of N indices (as VERL's ``np.random.choice``), whichever trajectory finishes
    first. Repeated indices (``rollout_n`` rollouts of one sample) are sent once. Never stored
    or forwarded; without it the budget falls back to first come.
    """
    tracer = _tracer.active
    if tracer is None:
        return
    attributes: dict[str, Any] = {"step": step, "validate": bool(validate),
                                  "sample_indices": list(dict.fromkeys(map(_index, sample_indices)))}
    if tracer.config.experiment is not None:
        attributes["experiment_name"] = tracer.config.experiment
    attributes.update({k: v for k, v in extra_attributes.items() if v is not None})
    record = SpanRecord("step_membership", KIND_MEMBERSHIP, _now(), None, attributes)
    record.end = record.start
    tracer.emit(record)


#: Attribute key of the request ids a call sent to an inference engine (:func:`engine_request`).
ENGINE_REQUESTS = "engine_request_ids"
_MAX_ENGINE_REQUESTS = 64  # per call: a resumed or retried generate sends a few, never more than this


def engine_request(request_id: str) -> None:
    """Notes that the current call sent request ``request_id`` to an inference engine.

    vLLM names its per-request ``llm_request`` span's ``gen_ai.request.id`` after the id it was
    given; with this note the collector joins that span to this call without any propagated
    context (VERL's ``enable_otel`` sends none). Cheap (a context read and a small dict copy:
    the call's attributes are shared with its parent by reference, so they are replaced, not
    changed), never raises; a no-op outside a traced call.
    """
    record = _tracer.current.get()
    if _tracer.active is None or record is None or record is _tracer.DISABLED or type(request_id) is not str:
        return
    attributes = record.attributes or {}
    known = attributes.get(ENGINE_REQUESTS)
    if type(known) is list:
        if request_id in known or len(known) >= _MAX_ENGINE_REQUESTS:
            return
        ids = [*known, request_id]
    else:
        ids = [request_id]
    record.attributes = {**attributes, ENGINE_REQUESTS: ids}


def current_trajectory_id() -> str | None:
    """Id of the enclosing trajectory (to annotate it later), or None outside one."""
    span = _tracer.current.get()
    if span is None or span is _tracer.DISABLED:
        return None
    return span.trace.span_id


#: an annotation's attribute naming its trajectory's (experiment, validate, step): what a node with several
#: gateways routes the annotation by when it does not hold the trajectory (collector/exporters/gateway_route.py)
ROUTE_ATTR = "tracecar_route"


def current_trajectory_route() -> str | None:
    """The enclosing trajectory's route (its (experiment_name, validate, step) as JSON text), or None outside
    one or without an int step: VERL carries it to the trainer beside the trajectory's id."""
    span = _tracer.current.get()
    if span is None or span is _tracer.DISABLED:
        return None
    attrs = span.trace.attributes or {}
    step, experiment = attrs.get("step"), attrs.get("experiment_name")
    if type(step) is not int:
        return None
    try:
        return json.dumps([experiment if type(experiment) in (str, int) else None, bool(attrs.get("validate")), step],
                          separators=(",", ":"), ensure_ascii=False)
    except ValueError:
        return None


def annotate(trajectory: SpanRecord | str | None = None, *, reward: float | None = None,
             advantage: float | None = None, trained: bool | None = None, filtered_by: str | None = None,
             policy_version: int | None = None, trained_on_version: int | None = None, **values: Any) -> None:
    """Attaches a reward, what the trainer did with the trajectory, and other scalars to it.

    VERL computes rewards after the agent loop returns, outside ``rollout_trace_attr``: keep the
    record it yielded (or its ``span_id``) and call this when the score is known. The collector
    merges annotations into the trajectory root before it samples and forwards it.

    The trainer's side, from the trainer process (``tracecar.client.verl_trainer`` does it for
    VERL): ``advantage`` (the sequence's advantage), ``trained`` (False when the trainer dropped
    it), ``filtered_by`` (why: e.g. ``"dynamic_sampling"``, ``"overlong"``), ``policy_version``
    (the weights that generated it) and ``trained_on_version`` (the step that trained on it: the
    difference is its staleness). Queued like every span: never blocks, never raises.
    """
    tracer = _tracer.active
    if tracer is None:
        return
    if trajectory is None:
        trajectory = current_trajectory_id()
        if trajectory is None:
            return
    payload = dict(values)
    if reward is not None:
        payload["reward"] = reward
    for key, value in (("advantage", advantage), ("trained", trained), ("filtered_by", filtered_by),
                       ("policy_version", policy_version), ("trained_on_version", trained_on_version)):
        if value is not None:
            if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy / torch scalars from a trainer
                try:
                    value = value.item()
                except Exception:  # noqa: BLE001 - e.g. a tensor of many values: sent as is, the collector names the field
                    pass
            payload[key] = value
    record = SpanRecord("annotation", KIND_ANNOTATION, _now(), None, payload)
    record.trace = _TraceRef(trajectory if isinstance(trajectory, str) else trajectory.trace.span_id)  # type: ignore[assignment]
    record.end = record.start
    tracer.emit(record)


class _TraceRef:
    """Stands in for a trajectory record that may be long gone: only its id is needed."""

    __slots__ = ("span_id",)

    def __init__(self, span_id: str) -> None:
        self.span_id = span_id
