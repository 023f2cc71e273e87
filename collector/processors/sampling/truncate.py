"""Truncate: fit a kept trajectory under ``max_trajectory_bytes`` instead of dropping it.

The largest values inside span ``inputs``/``output`` are cut first: a string keeps its head and
ends with ``…[truncated by tracecar: N chars]``; a list keeps its head and ends with
``"…[truncated by tracecar: N items]"``; a value that still does not fit becomes that marker
alone. Each cut span gains a warning, and the root's ``attributes.tracecar_truncated`` records
the sizes before and after, so a reader knows what they see is not everything. Names, ids,
attributes and timings are never cut.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from ...json_out import dumps_deep

_OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY
_CHARS = "…[truncated by tracecar: {n} chars]"
_ITEMS = "…[truncated by tracecar: {n} items]"
_MAX_PASSES = 64


def dumps(span: dict[str, Any]) -> bytes:
    """The span's stored form; a value nested to the store's limit must not fail the step decision."""
    return dumps_deep(span, option=_OPTS)


def _leaves(value: Any, path: tuple[Any, ...], out: list[tuple[int, tuple[Any, ...], Any]], depth: int = 0) -> None:
    """(encoded size, path, value) of every cuttable value: strings, lists and deep dicts."""
    if isinstance(value, str):
        if len(value) > 64:
            out.append((len(value.encode()), path, value))
    elif isinstance(value, list):
        if len(value) > 1:
            out.append((len(orjson.dumps(value, option=_OPTS)), path, value))
    elif isinstance(value, dict):
        if depth >= 8:
            out.append((len(orjson.dumps(value, option=_OPTS)), path, value))
            return
        for key, item in value.items():
            _leaves(item, path + (key,), out, depth + 1)


def _set(span: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    target: Any = span
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


def _cut(value: Any, size: int, excess: int) -> Any:
    """``value`` about ``excess`` encoded bytes smaller (or a bare marker)."""
    if isinstance(value, str):
        keep = int(len(value) * max(0, size - excess - 64) / max(size, 1))
        return value[:keep] + _CHARS.format(n=len(value) - keep) if keep > 0 else _CHARS.format(n=len(value))
    if isinstance(value, list):
        keep = int(len(value) * max(0, size - excess - 64) / max(size, 1))
        return value[:keep] + [_ITEMS.format(n=len(value) - keep)] if keep > 0 else [_ITEMS.format(n=len(value))]
    return _CHARS.format(n=size)


def truncate_trajectory(spans: list[dict[str, Any]], cap: int, root_id: str,
                        measure: Callable[[dict[str, Any]], bytes] = dumps) -> tuple[dict[str, bytes], int, int] | None:
    """Cuts the spans (dicts, changed in place) until their payloads total ``cap`` bytes or less.

    Returns (new payload by span id for the spans that changed, bytes before, bytes after), or
    None when even bare markers do not fit (the caller drops the trajectory). The root must be
    among ``spans``; it always gets a new payload carrying ``tracecar_truncated``.
    """
    root = next(s for s in spans if s["span_id"] == root_id)
    before = sum(len(measure(s)) for s in spans)
    root.setdefault("attributes", {})["tracecar_truncated"] = {"original_bytes": before, "bytes": 0, "cap": cap}
    payloads = {s["span_id"]: measure(s) for s in spans}
    changed: set[str] = {root_id}
    by_id = {s["span_id"]: s for s in spans}
    total = sum(len(p) for p in payloads.values())
    for _ in range(_MAX_PASSES):
        if total <= cap:
            break
        leaves: list[tuple[int, tuple[Any, ...], Any, str]] = []
        for s in spans:
            found: list[tuple[int, tuple[Any, ...], Any]] = []
            for field_name in ("inputs", "output"):
                _leaves(s.get(field_name), (field_name,), found)
            leaves.extend((size, path, value, s["span_id"]) for size, path, value in found)
        leaves = [leaf for leaf in leaves if not _is_marker(leaf[2])]
        if not leaves:
            break
        size, path, value, span_id = max(leaves, key=lambda leaf: (leaf[0], leaf[3], str(leaf[1])))
        span = by_id[span_id]
        _set(span, path, _cut(value, size, total - cap))
        if not _warned(span, path):
            span["warnings"] = [*(span.get("warnings") or []),
                                f"{'.'.join(map(str, path))}: truncated by tracecar (TRACECAR_MAX_TRAJECTORY_BYTES={cap})"]
        changed.add(span_id)
        new = measure(span)
        total += len(new) - len(payloads[span_id])
        payloads[span_id] = new
    for _ in range(3):  # the marker's own digits can move the total by a few bytes
        root["attributes"]["tracecar_truncated"]["bytes"] = total
        new = measure(root)
        total += len(new) - len(payloads[root_id])
        payloads[root_id] = new
    if total > cap:
        return None
    return {sid: payloads[sid] for sid in changed}, before, total


def _is_marker(value: Any) -> bool:
    if isinstance(value, str):
        return value.startswith("…[truncated by tracecar")
    if isinstance(value, list):
        return len(value) == 1 and isinstance(value[0], str) and value[0].startswith("…[truncated by tracecar")
    return False


def _warned(span: dict[str, Any], path: tuple[Any, ...]) -> bool:
    prefix = f"{'.'.join(map(str, path))}: truncated by tracecar"
    return any(isinstance(w, str) and w.startswith(prefix) for w in span.get("warnings") or ())
