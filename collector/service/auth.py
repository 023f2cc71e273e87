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

    async def __call__(self, request: Request) -> None:
        """A coroutine: FastAPI runs a plain function dependency in its thread pool, a thread
        hand-off per request (~0.3 ms of CPU each on /v1/spans); this check does no I/O."""
        self.check(request)

    def check(self, request: Request) -> None:
        """Raises 401 unless the request carries the token (or none is configured)."""
        if self._token is None:
            return
        header = request.headers.get("authorization", "")
        if not bearer_matches(header, self._token):
            if self._on_failure is not None:
                from ..loudness import client_of, route_of

                self._on_failure(route_of(request.scope), client_of(request.scope), not header)
            raise HTTPException(status_code=401, detail={"field": "Authorization", "reason": "missing or wrong bearer token"},
                                headers={"WWW-Authenticate": "Bearer"})
