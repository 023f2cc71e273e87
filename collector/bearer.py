"""The one parser of ``Authorization: Bearer <token>``, shared by the API's and the viewer's checks."""

from __future__ import annotations

import hmac


def presented_bearer(header: str) -> str | None:
    """The token a request presents, or None when the header is absent or not a bearer one."""
    scheme, _, presented = header.partition(" ")
    return presented.strip() if scheme.lower() == "bearer" else None


def bearer_matches(header: str, token: bytes) -> bool:
    """Constant-time: does ``header`` present exactly ``token``?"""
    presented = presented_bearer(header)
    return presented is not None and hmac.compare_digest(presented.encode(), token)
