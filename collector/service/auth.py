"""Access: an optional shared bearer token, compared in constant time."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import HTTPException, Request

from ..bearer import bearer_matches


class BearerAuth:
    """FastAPI dependency; a no-op when no token is configured.

    ``on_failure(route, client, missing)`` is told of each refusal (counted and logged,
    rate-limited, by :mod:`tracecar.collector.loudness`); the presented value never is.
    """

    def __init__(self, token: str | None, on_failure: Callable[[str, str | None, bool], None] | None = None) -> None:
        self._token = token.encode() if token else None
        self._on_failure = on_failure

    def __call__(self, request: Request) -> None:
        if self._token is None:
            return
        header = request.headers.get("authorization", "")
        if not bearer_matches(header, self._token):
            if self._on_failure is not None:
                from ..loudness import client_of, route_of

                self._on_failure(route_of(request.scope), client_of(request.scope), not header)
            raise HTTPException(status_code=401, detail={"field": "Authorization", "reason": "missing or wrong bearer token"},
                                headers={"WWW-Authenticate": "Bearer"})
