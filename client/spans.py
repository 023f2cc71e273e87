"""The span record the hot path creates, and the conversion to wire form done later.

The hot path stores references only (the callable's signature, the raw args, the result);
binding arguments, flattening outputs and packing token ids happen on the sender thread.
Lists passed as arguments are captured by length: agent loops grow ``prompt_ids`` in place
turn by turn, so the sender slices them back to what the call actually saw.

Outputs are snapshotted when the call returns (:func:`snapshot`), because callers change them
afterwards (VERL sets ``reward_score`` and ``extra_fields["raw_prompt"]`` on the returned
``AgentLoopOutput``) and weave records a call's output as it was at finish: the top-level fields
of a dict, pydantic model or dataclass are copied, dict-valued fields one level further, lists
by length. An exception keeps the exception object and the (code, line) pairs of the frames
above the one that caught it; weave's traceback shape is built from them on the sender thread.
"""

from __future__ import annotations

import inspect
import linecache
import os
import secrets
import threading
import traceback
from collections.abc import Callable
from itertools import count
from typing import Any

from .wire import ids_as_lists, value_shape

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
        "attributes", "signature", "args", "kwargs", "list_lens", "dict_copies", "output", "exception", "exc_stack", "_sid", "_short",
    )

    def __init__(
        self,
        name: str,
        kind: str,
        start: float,
        parent: SpanRecord | None,
        attributes: dict[str, Any] | None,
        signature: _LazySignature | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        copy_dicts: bool = False,
    ) -> None:
        self.number = next(ids.counter)
        self.prefix = ids.prefix
        self.parent = parent
        self.trace: SpanRecord = parent.trace if parent is not None else self
        self.name = name
        self.kind = kind
        self.start = start
        self.end: float | None = None
        self.attributes = attributes
        self.signature = signature
        self.args = args
        self.kwargs = kwargs
        # list arguments' lengths in order (positional, then keyword): inline, as this runs on every call
        # and, with ``copy_dicts`` (TRACECAR_SNAPSHOT=shallow), copies of the dict arguments, in the
        # same order (put back in their places on the sender thread)
        lens: list[int] | None = None
        copies: Any = None  # None, the one dict copy, or a list of them
        if signature is not None:
            for value in (*args, *kwargs.values()) if kwargs else args:
                if type(value) is list:
                    if lens is None:
                        lens = [len(value)]
                    else:
                        lens.append(len(value))
                elif copy_dicts and type(value) is dict:  # one copy is kept bare (no list to allocate)
                    if copies is None:
                        copies = value.copy()
                    elif type(copies) is dict:
                        copies = [copies, value.copy()]
                    else:
                        copies.append(value.copy())
        self.list_lens = lens
        self.dict_copies = copies
        self.output: Any = None
        self.exception: BaseException | str | None = None
        self.exc_stack: tuple[tuple[Any, int | None], ...] | None = None
        self._sid: str | None = None
        self._short: str | None = None  # wire v3's short form of the id (short_ids.shorten_record), made once

    @property
    def span_id(self) -> str:
        """Formatted once, when first asked (on the sender thread, mostly): a span's, its parent's and
        its trace's ids are read for every span sent."""
        sid = self._sid
        if sid is None:
            sid = self._sid = f"{self.prefix}{self.number:016x}"
        return sid

    @property
    def short_id(self) -> str:
        """``~`` + the counter in hex (wire v3, tracecar.client.short_ids): made once, as a span's id
        is written for itself and again for each child (its parent and trajectory ids)."""
        short = self._short
        if short is None:
            short = self._short = f"~{self.number:x}"
        return short

    def to_wire(self, max_frames: int = 200) -> dict[str, Any]:
        """Wire dict for this span (values as captured); runs on the sender thread."""
        parent = self.parent
        exc = self.exception
        wire = {
            "span_id": self.span_id,
            "trace_id": self.trace.span_id,
            "parent_id": parent.span_id if parent is not None else None,
            "name": self.name,
            "kind": self.kind,
            "start_time": self.start,
            "end_time": self.end,
            "attributes": self.attributes or {},
            "inputs": self._inputs(),
            "output": restore(self.output),
            "exception": None if exc is None else (exc if isinstance(exc, str) else _describe(exc)),
        }
        if isinstance(exc, BaseException):
            wire["exception_info"] = exception_info(exc, self.exc_stack, max_frames)
        return wire

    def _inputs(self) -> dict[str, Any]:
        if self.signature is None:
            return self.kwargs or {}
        args, kwargs = _restore_lists(self.args, self.kwargs or {}, self.list_lens, self.dict_copies)
        return self.signature.bind_inputs(args, kwargs)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {safe_str(exc)}"


# ---- output snapshot (caller's path: cheap, one level) ------------------------------------
_SCALARS = frozenset({str, int, float, bool, type(None), bytes})
_NESTED = frozenset({dict, list})


class Snapshot(tuple):
    """A dict, pydantic model or dataclass as it was when the call returned: (shape, fields, lens).

    ``shape`` is None for a dict; ``fields`` is a fresh dict of the top-level values (dict values
    copied one level); ``lens`` the (key, length) of list values, sliced back on the sender.
    A tuple subclass because building one is a single C call on the caller's path.
    """

    __slots__ = ()


class ListSnapshot:
    """A returned list and its length at return (an agent loop may keep appending to it)."""

    __slots__ = ("items", "n")

    def __init__(self, items: list[Any], n: int) -> None:
        self.items = items
        self.n = n


def _freeze(fields: dict[str, Any]) -> tuple[Any, ...] | None:
    """Copies dict values one level (in place, on a fresh dict) and notes list lengths."""
    lens: tuple[Any, ...] | None = None
    for key, value in fields.items():
        kind = type(value)
        if kind is dict:
            fields[key] = dict(value)
        elif kind is list:
            lens = (lens or ()) + ((key, len(value)),)
    return lens


def snapshot(value: Any) -> Any:
    """The output as weave would see it at finish, at the cost of a shallow copy (or nothing)."""
    kind = type(value)
    if kind is dict:  # the common case, inline: a dict without list values is its own snapshot
        fields = value.copy()
        if _NESTED.isdisjoint(map(type, fields.values())):
            return fields
        lens: tuple[Any, ...] | None = None
        for key, item in fields.items():
            item_kind = type(item)
            if item_kind is dict:
                fields[key] = item.copy()
            elif item_kind is list:
                lens = (lens or ()) + ((key, len(item)),)
        return fields if lens is None else Snapshot((None, fields, lens))
    if kind in _SCALARS:
        return value
    if kind is tuple:  # e.g. BaseTool.execute's (ToolResponse, reward, metrics)
        return tuple(snapshot(v) if type(v) is not tuple else v for v in value)
    if kind is list:
        return ListSnapshot(value, len(value))
    shape = value_shape(kind)
    if shape is None:
        return value  # a plain object is written as its repr, as weave does
    fields = dict(value.__dict__) if shape.pydantic else shape.fields_of(value)
    return Snapshot((shape, fields, _freeze(fields)))


def restore(value: Any) -> Any:
    """Sender thread: a snapshot back to plain values (models as weave's envelope)."""
    kind = type(value)
    if kind is Snapshot:
        shape, fields, lens = value
        if lens:
            fields = dict(fields)
            for key, n in lens:
                if len(fields[key]) != n:
                    fields[key] = fields[key][:n]
        return fields if shape is None else shape.envelope(fields)
    if kind is tuple:
        return [restore(v) for v in value]
    if kind is ListSnapshot:
        items = value.items
        return items if len(items) == value.n else items[: value.n]
    return value


# ---- TRACECAR_SNAPSHOT: how much of a call's values is copied on the caller's path ----------
# weave (VERL's weave backend) copies a call's containers when the call starts (its
# ``redact_sensitive_keys`` and ``map_to_refs`` rebuild every dict, list and tuple, and a pydantic
# model or dataclass as a record of its fields) and its output's when it returns, and serialises
# the copies later; tracecar records references and serialises on the sender thread, so what is
# copied here decides which later changes a span shows (docs/weave.md).
SNAPSHOT_MODES = ("refs", "shallow", "deep")


def _numbers_or_texts(items: list[Any]) -> bool:
    """All numbers, or all strings: checked in C (``sum`` / ``str.join`` stop at the first item that
    is not), ~10 ns an item where a per-item type check costs ~20."""
    first = type(items[0])
    try:
        if first is int or first is float:
            sum(items)
            return True
        if first is str:
            "".join(items)
            return True
    except TypeError:
        pass
    return False


def _deep(value: Any, depth: int) -> Any:
    """weave's copy at call time: dicts, lists, tuples and models (as weave's envelope) rebuilt all
    the way down (to ``depth`` levels), numpy arrays copied, other objects by reference."""
    kind = type(value)
    if kind in _SCALARS or depth <= 0:
        return value
    if kind is list:
        if value and _numbers_or_texts(value):  # token ids, log-probabilities: one C copy
            return value.copy()
        return [_deep(v, depth - 1) for v in value]
    if kind is dict:
        return {k: _deep(v, depth - 1) for k, v in value.items()}
    if kind is tuple:
        return tuple(_deep(v, depth - 1) for v in value)
    shape = value_shape(kind)
    if shape is not None:
        fields = dict(value.__dict__) if shape.pydantic else shape.fields_of(value)
        return shape.envelope(ids_as_lists({k: _deep(v, depth - 1) for k, v in fields.items()}))
    if kind.__module__ == "numpy" and callable(getattr(value, "copy", None)):
        try:
            return value.copy()
        except Exception:  # noqa: BLE001 - an odd array: by reference, as weave keeps it
            return value
    return value


def deep_inputs(args: tuple[Any, ...], kwargs: dict[str, Any] | None,
                depth: int = 32) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """``deep``: every argument as it was when the call started (see :func:`_deep`)."""
    return tuple(_deep(v, depth) for v in args), ({k: _deep(v, depth) for k, v in kwargs.items()} if kwargs else kwargs)


def deep_snapshot(value: Any, depth: int = 32) -> Any:
    """``deep``: the output as it was when the call returned, all the way down."""
    return _deep(value, depth)


# ---- exceptions in weave's shape -----------------------------------------------------------
_MAX_OUTER_FRAMES = 256


def outer_stack(exc: BaseException) -> tuple[tuple[Any, int | None], ...] | None:
    """Caller's path: (code, line) of the frames above the one the exception reached.

    weave's ``exception_to_dict`` lists ``extract_stack(tb.tb_frame)[:-1]`` then the traceback;
    the outer frames keep running, so their current lines are read now, their text later.
    """
    tb = exc.__traceback__
    if tb is None:
        return None
    frames: list[tuple[Any, int]] = []
    frame = tb.tb_frame.f_back
    while frame is not None and len(frames) < _MAX_OUTER_FRAMES:
        frames.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    frames.reverse()
    return tuple(frames)


def _frame_dict(filename: str, lineno: int | None, name: str) -> dict[str, Any]:
    line = linecache.getline(filename, lineno).strip() if lineno else ""
    return {"filename": filename, "line_number": lineno, "function_name": name, "text": line}


def exception_info(exc: BaseException, outer: tuple[tuple[Any, int | None], ...] | None, max_frames: int) -> dict[str, Any]:
    """weave's ``exception_to_dict``: type, message and (when raised) the traceback frames.

    At most ``max_frames`` frames are kept: the innermost ones (where it was raised).
    """
    info: dict[str, Any] = {"type": type(exc).__name__, "message": safe_str(exc)}
    if exc.__traceback__ is not None:
        frames = [_frame_dict(code.co_filename, lineno, code.co_name) for code, lineno in (outer or ())]
        frames.extend(_frame_dict(fs.filename, fs.lineno, fs.name)
                      for fs in traceback.extract_tb(exc.__traceback__, limit=None))
        info["traceback"] = frames[-max_frames:] if max_frames > 0 else []
    return info


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when its ``__str__`` raises (logging or recording it must not)."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not cost the span
        return f"<unprintable {type(exc).__name__}>"


def _restore_lists(
    args: tuple[Any, ...], kwargs: dict[str, Any], lens: list[int] | None, copies: Any = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The list arguments as the call saw them: ``lens`` holds each list argument's length at the
    call, in order (positional, then keyword; the args tuple and the kwargs dict are the call's own,
    so the order is the same here); one grown since is sliced back. ``copies`` holds the dict
    arguments as copied at the call (``TRACECAR_SNAPSHOT=shallow``), in the same order (one bare)."""
    if not lens and copies is None:
        return args, kwargs
    lengths = iter(lens or ())
    dicts = iter([copies] if type(copies) is dict else copies or ())
    copied = copies is not None
    restored = list(args)
    for i, value in enumerate(restored):
        kind = type(value)
        if kind is list:
            n = next(lengths)
            if len(value) != n:
                restored[i] = value[:n]
        elif kind is dict and copied:
            restored[i] = next(dicts)
    if kwargs:  # (none: the caller's empty dict is only read)
        kwargs = dict(kwargs)
        for key, value in kwargs.items():
            kind = type(value)
            if kind is list:
                n = next(lengths)
                if len(value) != n:
                    kwargs[key] = value[:n]
            elif kind is dict and copied:
                kwargs[key] = next(dicts)
    return tuple(restored), kwargs


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
    __slots__ = ("signature", "order", "positional", "named", "var_positional", "var_keyword", "defaults", "plain")

    def __init__(self, signature: inspect.Signature) -> None:
        P = inspect.Parameter
        params = list(signature.parameters.values())
        self.signature = signature
        self.order = tuple(p.name for p in params)
        self.positional = [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        self.named = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
        self.var_positional = next((p.name for p in params if p.kind is P.VAR_POSITIONAL), None)
        self.var_keyword = next((p.name for p in params if p.kind is P.VAR_KEYWORD), None)
        self.defaults = [(p.name, p.default) for p in params if p.default is not P.empty]
        # only positional parameters (no *args, **kwargs, keyword-only): a call that gives them all by
        # position binds as one zip, in signature order
        self.plain = len(self.positional) == len(params)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        positional = self.positional
        if not kwargs and len(args) == len(positional) and self.plain:
            return dict(zip(positional, args))  # every parameter given by position: already in order
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
        # signature order, as BoundArguments.apply_defaults leaves it (keywords and defaults
        # were added in call order above; weave shows inputs in the order they are stored)
        return {name: inputs[name] for name in self.order if name in inputs}

    def _slow(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """What inspect makes of it; a call the function itself would reject is kept raw."""
        try:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return dict(bound.arguments)
        except TypeError:
            return {"args": list(args), **kwargs}
