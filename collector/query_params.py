"""Query parameters: one bounded integer type for every endpoint, and one way to say what is wrong.

Every integer a request can put in the query ends up as an SQLite parameter, and SQLite holds
signed 64-bit integers: Python's sqlite3 raises ``OverflowError`` past them (a 500). So every
integer query parameter is declared with :data:`Int64` / :data:`OptionalInt64` (or a narrower ``Query(ge=, le=)``
inside that range), and :func:`check_bounded_ints` refuses, at app creation, a route whose
integer query parameter lacks such a bound: a new endpoint cannot forget it.

A parameter that fails validation answers 422 with ``{"error": {"field", "reason"}}`` naming
the parameter, like every other error of the API (:func:`validation_error_body`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Annotated, Any

from fastapi import Query
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what an SQLite INTEGER (and the store's index) holds

Int64 = Annotated[int, Query(ge=INT64_MIN, le=INT64_MAX)]
"""A required integer parameter: any value an SQLite INTEGER column can hold."""
OptionalInt64 = Annotated[int | None, Query(ge=INT64_MIN, le=INT64_MAX)]
"""An optional integer filter (``None`` when absent), bounded the same way."""

_INT = re.compile(r"^[+-]?\d+$")


class SampleIndexError(ValueError):
    pass


def sample_index_filter(value: str | None) -> int | str | None:
    """``sample_index`` is an int or a string: an int when it parses as one (then int64-bounded)."""
    if value is None or not value.strip():  # blank: no filter, as the viewer's empty fields send
        return None
    text = value.strip()
    if _INT.match(text):
        number = int(text) if len(text) <= 40 else None  # (int() itself refuses past 4300 digits)
        if number is None or not INT64_MIN <= number <= INT64_MAX:
            raise SampleIndexError(f"must fit in a signed 64-bit integer ({INT64_MIN}..{INT64_MAX}), got {text[:40]}")
        return number
    return value


def validation_error_body(errors: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The API's error shape for a refused request: the first field at fault and why, then all."""
    found = list(errors)
    described = [{"field": _field(e.get("loc", ())), "reason": _reason(e)} for e in found]
    first = described[0] if described else {"field": None, "reason": "invalid request"}
    return {"error": first, "errors": described}


def _field(loc: Iterable[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("query", "path", "header", "cookie", "body"):
        parts = parts[1:]
    return ".".join(parts) or "request"


def _reason(error: dict[str, Any]) -> str:
    message = str(error.get("msg", "invalid"))
    given = error.get("input")
    if isinstance(given, str) and len(given) <= 64:
        return f"{message}, got {given!r}"
    return message


def _int_bounds(field: Any) -> tuple[Any, Any]:
    low = high = None
    for meta in getattr(field.field_info, "metadata", ()):
        low = getattr(meta, "ge", None) if getattr(meta, "ge", None) is not None else low
        high = getattr(meta, "le", None) if getattr(meta, "le", None) is not None else high
    return low, high


def api_routes(routes: Iterable[BaseRoute], prefix: str = "") -> Iterator[tuple[str, APIRoute]]:
    """Every API route with its full path, included routers too (FastAPI may keep them nested)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield prefix + route.path, route
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from api_routes(included.routes, prefix + route.include_context.prefix)  # type: ignore[attr-defined]


def int_query_params(route: APIRoute) -> Iterator[Any]:
    """The route's query parameters typed as integers (``bool`` excluded)."""
    for param in route.dependant.query_params:
        annotation = param.field_info.annotation
        args = getattr(annotation, "__args__", (annotation,))
        if int in args and bool not in args:
            yield param


def check_bounded_ints(routes: Iterable[BaseRoute]) -> None:
    """Refuses routes whose integer query parameters could overflow SQLite (no int64 bound)."""
    unbounded = []
    for path, route in api_routes(routes):
        for param in int_query_params(route):
            low, high = _int_bounds(param)
            if low is None or high is None or low < INT64_MIN or high > INT64_MAX:
                unbounded.append(f"{path}?{param.alias}")
    if unbounded:
        raise RuntimeError("integer query parameters without an int64 bound (use query_params.Int64): " + ", ".join(unbounded))


def attribute_filters(raw: list[str] | None) -> tuple[tuple[str, str], ...] | None:
    """``attr=key=value`` query parameters (repeatable) as the filter's pairs; a mistake is a 422 naming ``attr``."""
    from fastapi import HTTPException

    from .trajectory_filter import parse_attribute_filters

    try:
        return parse_attribute_filters(raw)
    except ValueError as exc:
        raise HTTPException(422, detail={"field": "attr", "reason": str(exc)}) from None


def _attr_query() -> Any:
    from fastapi import Query

    return Query(None, max_length=512, description="key=value: the root's attribute equals the value (repeatable)")


ATTR_QUERY = _attr_query()  # one Query object for every route that takes attr=
