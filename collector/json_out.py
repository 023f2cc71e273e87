"""JSON out: orjson for any depth the store can hold.

orjson refuses to serialise containers nested deeper than 255 levels, while the store accepts
values up to that depth inside a span, and a trajectory tree adds two levels per generation
(the span object and its ``children`` list). :func:`dumps_deep` takes orjson's fast path and,
only when that hits the depth limit, walks the value iteratively and serialises every
container found at :data:`CUT_DEPTH` on its own, embedding the result as an
``orjson.Fragment``: the document is the same JSON, just written in pieces.
"""

from __future__ import annotations

from typing import Any

import orjson

CUT_DEPTH = 128  # containers at this depth are serialised apart (well inside orjson's 255)


def dumps_deep(value: Any, option: int = 0) -> bytes:
    """``orjson.dumps(value)``, also when ``value`` nests deeper than orjson allows."""
    try:
        return orjson.dumps(value, option=option)
    except orjson.JSONEncodeError as exc:
        if "Recursion limit" not in str(exc):
            raise
    return orjson.dumps(_cut(value, option), option=option)


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, tuple))


def _shallow(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else list(value)


def _cut(value: Any, option: int) -> Any:
    """A copy of ``value`` down to CUT_DEPTH; each container below is an already-serialised Fragment.

    Iterative (an explicit stack): the depth of the input is bounded by nothing but the store.
    A piece that is itself too deep is cut again by :func:`dumps_deep`; each round consumes
    CUT_DEPTH levels, so the recursion between the two stays shallow (depth / CUT_DEPTH).
    """
    if not _is_container(value):
        return value
    top = _shallow(value)
    stack: list[tuple[Any, int]] = [(top, 1)]
    while stack:
        node, depth = stack.pop()
        keys = node.keys() if isinstance(node, dict) else range(len(node))
        for key in list(keys):
            child = node[key]
            if not _is_container(child):
                continue
            if depth >= CUT_DEPTH:
                node[key] = orjson.Fragment(dumps_deep(child, option))
            else:
                node[key] = copy = _shallow(child)
                stack.append((copy, depth + 1))
    return top
