"""The span record the hot path creates, and the conversion to wire form done later.

The hot path stores references only (the callable's signature, the raw args, the result);
binding arguments, flattening outputs and packing token ids happen on the sender thread.
Lists passed as arguments are captured by length: agent loops grow ``prompt_ids`` in place
turn by turn, so the sender slices them back to what the call actually saw.
"""

from __future__ import annotations

import inspect
import os
import secrets
import threading
from itertools import count
from typing import Any, Callable


KIND_OP = "op"
KIND_TRAJECTORY = "trajectory"
KIND_ANNOTATION = "annotation"


class _IdSource:
    """64-bit random process prefix + a counter: unique ids at the cost of one ``next()``."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.prefix = secrets.token_hex(8)
        self.counter = count(1)

    def format(self, number: int) -> str:
        return f"{self.prefix}{number:016x}"


ids = _IdSource()
os.register_at_fork(after_in_child=ids.reset)


class SpanRecord:
    """One traced call or trajectory, as captured on the caller's path (cheap: slots, refs)."""

    __slots__ = (
        "number", "prefix", "trace", "parent", "name", "kind", "start", "end",
        "attributes", "signature", "args", "kwargs", "list_lens", "output", "exception",
    )

    def __init__(
        self,
        name: str,
        kind: str,
        start: float,
        parent: "SpanRecord | None",
        attributes: dict[str, Any] | None,
        signature: "_LazySignature | None" = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.number = next(ids.counter)
        self.prefix = ids.prefix
        self.parent = parent
        self.trace = parent.trace if parent is not None else self
        self.name = name
        self.kind = kind
        self.start = start
        self.end: float | None = None
        self.attributes = attributes
        self.signature = signature
        self.args = args
        self.kwargs = kwargs
        self.list_lens = _list_lengths(args, kwargs) if signature is not None else None
        self.output: Any = None
        self.exception: BaseException | str | None = None

    @property
    def span_id(self) -> str:
        return f"{self.prefix}{self.number:016x}"

    def to_wire(self) -> dict[str, Any]:
        """Wire dict for this span (values as captured); runs on the sender thread."""
        parent = self.parent
        exc = self.exception
        return {
            "span_id": self.span_id,
            "trace_id": self.trace.span_id,
            "parent_id": parent.span_id if parent is not None else None,
            "name": self.name,
            "kind": self.kind,
            "start_time": self.start,
            "end_time": self.end,
            "attributes": self.attributes or {},
            "inputs": self._inputs(),
            "output": self.output,
            "exception": None if exc is None else (exc if isinstance(exc, str) else _describe(exc)),
        }

    def _inputs(self) -> dict[str, Any]:
        if self.signature is None:
            return self.kwargs or {}
        args, kwargs = _restore_lists(self.args, self.kwargs or {}, self.list_lens)
        return self.signature.bind_inputs(args, kwargs)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _list_lengths(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> tuple[Any, ...] | None:
    lens = None
    for i, a in enumerate(args):
        if type(a) is list:
            lens = (lens or ()) + ((i, len(a)),)
    if kwargs:
        for k, v in kwargs.items():
            if type(v) is list:
                lens = (lens or ()) + ((k, len(v)),)
    return lens


def _restore_lists(
    args: tuple[Any, ...], kwargs: dict[str, Any], lens: tuple[Any, ...] | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not lens:
        return args, kwargs
    args_list, kwargs = list(args), dict(kwargs)
    for key, n in lens:
        if isinstance(key, int):
            if len(args_list[key]) != n:  # grown since the call: slice back to what it saw
                args_list[key] = args_list[key][:n]
        elif len(kwargs[key]) != n:
            kwargs[key] = kwargs[key][:n]
    return tuple(args_list), kwargs


class _LazySignature:
    """How to bind a traced callable's arguments, planned once, on the sender thread.

    ``inspect.Signature.bind`` costs tens of microseconds a call; this plan binds the common
    shapes (positional, keyword, defaults, ``*args``, ``**kwargs``) with dict operations and
    falls back to ``inspect`` for anything it cannot place.
    """

    __slots__ = ("func", "_plan", "_lock")

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self._plan: _BindPlan | None = None
        self._lock = threading.Lock()

    def bind_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Bound arguments with defaults applied, minus ``self``/``cls`` (as VERL does)."""
        plan = self._plan
        if plan is None:
            with self._lock:
                plan = self._plan = self._plan or _BindPlan(inspect.signature(self.func))
        inputs = plan.bind(args, kwargs)
        inputs.pop("self", None)
        inputs.pop("cls", None)
        return inputs


class _BindPlan:
    __slots__ = ("signature", "positional", "named", "var_positional", "var_keyword", "defaults")

    def __init__(self, signature: inspect.Signature) -> None:
        P = inspect.Parameter
        params = list(signature.parameters.values())
        self.signature = signature
        self.positional = [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        self.named = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
        self.var_positional = next((p.name for p in params if p.kind is P.VAR_POSITIONAL), None)
        self.var_keyword = next((p.name for p in params if p.kind is P.VAR_KEYWORD), None)
        self.defaults = [(p.name, p.default) for p in params if p.default is not P.empty]

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        positional = self.positional
        inputs = dict(zip(positional, args))
        if len(args) > len(positional):
            if self.var_positional is None:
                return self._slow(args, kwargs)
            inputs[self.var_positional] = args[len(positional):]
        extra = {}
        for key, value in kwargs.items():
            if key in self.named and key not in inputs:
                inputs[key] = value
            else:
                extra[key] = value
        if extra:
            if self.var_keyword is None or any(k in inputs for k in extra):
                return self._slow(args, kwargs)
            inputs[self.var_keyword] = extra
        for name, default in self.defaults:
            if name not in inputs:
                inputs[name] = default
        if self.var_positional is not None and self.var_positional not in inputs:
            inputs[self.var_positional] = ()
        if self.var_keyword is not None and self.var_keyword not in inputs:
            inputs[self.var_keyword] = {}
        return inputs

    def _slow(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """What inspect makes of it; a call the function itself would reject is kept raw."""
        try:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return dict(bound.arguments)
        except TypeError:
            return {"args": list(args), **kwargs}
