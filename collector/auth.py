"""Access: an optional shared bearer token, compared in constant time."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request


class BearerAuth:
    """FastAPI dependency; a no-op when no token is configured."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    def __call__(self, request: Request) -> None:
        if self._token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), self._token):
            raise HTTPException(status_code=401, detail={"field": "Authorization", "reason": "missing or wrong bearer token"},
                                headers={"WWW-Authenticate": "Bearer"})
