"""The shapes that flow through the pipeline, named once (as starlette keeps its ``types.py``).

A :class:`Span` is one span as it flows receive -> validate -> sample -> decode -> spool: the
fields :class:`~tracecar.collector.processors.validate.SpanIn` checked, plus what validation
adds from the batch envelope. It stays a plain dict at run time (no copies, no classes on the
hot path); the TypedDict only tells readers and mypy which keys it has.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

import orjson
from typing_extensions import NotRequired  # typing has it from Python 3.11

# membership: a step's sample indices; open: a call still running (processors.open_calls)
SpanKind = Literal["op", "trajectory", "annotation", "membership", "open"]


class Span(TypedDict):
    """One validated span (``SpanIn``'s fields) with its batch's worker, project and entity."""

    span_id: str
    trace_id: str
    parent_id: str | None
    name: str
    kind: SpanKind
    start_time: float
    end_time: float | None
    attributes: dict[str, Any]
    inputs: dict[str, Any]
    output: Any
    exception: str | None
    exception_info: NotRequired[dict[str, Any]]  # weave's exception shape, when the client sent one
    worker: str
    project: str | None
    entity: str | None
    client: NotRequired[dict[str, str]]  # weave's capture_info keys, when the client sent them
    wandb_run_id: NotRequired[str]  # the batch's W&B run, when it named a valid one
    warnings: NotRequired[list[str]]  # what was fixed up on the way (kept with the span)
    route: NotRequired[str]  # an annotation's trajectory route (a trainer's, for a node's gateways: exporters/gateway_route.py)


class RawIds:
    """A list of token ids as received: the JSON array's bytes and its length.

    ``len()`` is free; :meth:`tolist` parses it (the few places that need the ints). The store's
    payload writer splices ``data`` in as it is (:func:`tracecar.collector.spool.payload.pack_payload`)."""

    __slots__ = ("data", "n")

    def __init__(self, data: bytes, n: int) -> None:
        self.data = data
        self.n = n

    def __len__(self) -> int:
        return self.n

    def tolist(self) -> list[int]:
        ids: list[int] = orjson.loads(self.data)
        return ids

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RawIds):
            return self.data == other.data
        if isinstance(other, list):
            return self.tolist() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list, so unhashable like one

    def __repr__(self) -> str:
        return f"RawIds({self.n} ids)"


def as_list(value: Any) -> Any:
    """``value``, with a :class:`RawIds` turned into its list (for code that needs the ints)."""
    return value.tolist() if type(value) is RawIds else value
