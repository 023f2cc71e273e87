"""collector/service/auth.py: the bearer dependency, with and without a configured token."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from fastapi import HTTPException
from starlette.requests import Request

from tracecar.collector.service.auth import BearerAuth


def request(authorization: str | None = None) -> Request:
    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    return Request({"type": "http", "method": "POST", "path": "/v1/spans", "headers": headers, "client": ("10.0.0.7", 5555)})


def test_without_a_token_every_request_passes() -> None:
    auth = BearerAuth(None)
    auth.check(request())  # no exception: passes
    auth.check(request("Bearer anything"))


def test_the_right_token_passes_and_nothing_is_reported() -> None:
    told: list[Any] = []
    BearerAuth("s3cret", lambda *a: told.append(a)).check(request("Bearer s3cret"))
    assert told == []


@pytest.mark.parametrize("header, missing", [(None, True), ("Bearer wrong", False), ("s3cret", False), ("Basic s3cret", False)])
def test_a_missing_or_wrong_token_is_401_and_reported_without_the_value(header, missing) -> None:
    told: list[tuple[str, str | None, bool]] = []
    with pytest.raises(HTTPException) as e:
        BearerAuth("s3cret", lambda *a: told.append(a)).check(request(header))
    assert e.value.status_code == 401 and e.value.headers == {"WWW-Authenticate": "Bearer"}
    assert e.value.detail == {"field": "Authorization", "reason": "missing or wrong bearer token"}
    assert told == [("POST unmatched", "10.0.0.7", missing)]
    assert "wrong" not in repr(told) and "s3cret" not in repr(e.value.detail)



def test_the_dependency_is_a_coroutine_so_fastapi_runs_it_on_the_loop() -> None:
    """A plain-function dependency is run in FastAPI's thread pool: a thread hand-off per request."""
    auth = BearerAuth("s3cret")
    assert inspect.iscoroutinefunction(auth.__call__)
    assert asyncio.run(auth(request("Bearer s3cret"))) is None
    with pytest.raises(HTTPException) as e:
        asyncio.run(auth(request("Bearer wrong")))
    assert e.value.status_code == 401
