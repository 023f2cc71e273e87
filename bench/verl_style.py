"""VERL's in-process rollout tracing (weave backend), reproduced for the benchmarks.

Same behaviour as ``verl.utils.rollout_trace`` (VERL 0.5-0.7) on the paths the benches use:
``RolloutTraceConfig.init`` calls ``weave.init(project_name)``; ``rollout_trace_attr`` opens
``weave.attributes({sample_index, step, rollout_n, validate, experiment_name})``; each
``rollout_trace_op`` call binds ``inspect.signature(func)`` on every call, drops ``self``, and
calls ``client.create_call(op=func.__qualname__, inputs=..., attributes=current attributes)``
then ``client.finish_call(call, output=result)`` (or ``exception=``) on the caller's thread.
With no backend the wrapper falls through to the call, as VERL's does. token2text (VERL decodes
in the worker with ``run_in_executor``) is left off: it would only add to weave's cost here.
VERL itself is not imported (it is not a dependency of this project).

Bench-only addition: ``trace_until`` (a perf_counter deadline) makes every call started later run
untraced, and calls traced before it that finish after it are finished without their output,
so a bench can bound a weave run's time; ``traced_calls`` counts the calls traced.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from common import init_weave_like_verl

_trace_enabled: ContextVar[bool] = ContextVar("_trace_enabled", default=True)


class RolloutTraceConfig:
    backend: str | None = None
    client: Any = None
    experiment_name: str | None = None
    trace_until: float | None = None
    traced_calls: int = 0

    @classmethod
    def tracing(cls) -> bool:
        if not _trace_enabled.get() or cls.backend is None:
            return False
        if cls.trace_until is not None and time.perf_counter() > cls.trace_until:
            return False
        cls.traced_calls += 1
        return True

    @classmethod
    def output(cls, result: Any) -> Any:
        """The result, or None once past ``trace_until`` (finishing a call with a big output costs seconds)."""
        if cls.trace_until is not None and time.perf_counter() > cls.trace_until:
            return None
        return result

    @classmethod
    def init(cls, project_name: str, experiment_name: str, backend: str | None) -> None:
        cls.backend, cls.experiment_name = backend, experiment_name
        cls.client = init_weave_like_verl(project_name) if backend == "weave" else None


def _current_attributes() -> dict[str, Any]:
    from weave.trace.context import call_context

    return {**call_context.call_attributes.get()}


@contextlib.contextmanager
def rollout_trace_attr(sample_index: int | None = None, step: int | None = None, rollout_n: int | None = None,
                       name: str = "rollout_trace", validate: bool = False, trace: bool = True) -> Iterator[None]:
    backend = RolloutTraceConfig.backend
    if backend is not None and not trace:
        token = _trace_enabled.set(False)
        try:
            yield
        finally:
            _trace_enabled.reset(token)
        return
    if backend != "weave":
        yield
        return
    import weave

    attributes: dict[str, Any] = {}
    for key, value in (("sample_index", sample_index), ("step", step), ("rollout_n", rollout_n)):
        if value is not None:
            attributes[key] = value
    attributes["validate"] = validate
    attributes["experiment_name"] = RolloutTraceConfig.experiment_name
    with weave.attributes(attributes):
        yield


def _inputs(func: Callable[..., Any], self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = inspect.signature(func).bind(self, *args, **kwargs)
    bound.apply_defaults()
    inputs = dict(bound.arguments)
    del inputs["self"]
    return inputs


def rollout_trace_op(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    async def async_wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not RolloutTraceConfig.tracing():
            return await func(self, *args, **kwargs)
        inputs = _inputs(func, self, args, kwargs)
        client = RolloutTraceConfig.client
        call = client.create_call(op=func.__qualname__, inputs=inputs, attributes=_current_attributes())
        try:
            result = await func(self, *args, **kwargs)
            client.finish_call(call, output=RolloutTraceConfig.output(result))
            return result
        except Exception as e:
            client.finish_call(call, exception=e)
            raise

    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not RolloutTraceConfig.tracing():
            return func(self, *args, **kwargs)
        inputs = _inputs(func, self, args, kwargs)
        client = RolloutTraceConfig.client
        call = client.create_call(op=func.__qualname__, inputs=inputs, attributes=_current_attributes())
        try:
            result = func(self, *args, **kwargs)
            client.finish_call(call, output=RolloutTraceConfig.output(result))
            return result
        except Exception as e:
            client.finish_call(call, exception=e)
            raise

    return async_wrapper if inspect.iscoroutinefunction(func) else wrapper
