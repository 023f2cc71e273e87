"""collector/service/auth.py: the bearer dependency, with and without a configured token."""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI, HTTPException
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
    threads: list[int] = []

    class Recording(BearerAuth):
        def check(self, request: Request) -> None:
            threads.append(threading.get_ident())
            super().check(request)

    app = FastAPI()

    @app.get("/guarded", dependencies=[Depends(Recording("s3cret"))])
    async def guarded() -> dict[str, Any]:
        return {"loop": threading.get_ident()}

    async def calls() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return (await client.get("/guarded", headers={"Authorization": "Bearer s3cret"}),
                    await client.get("/guarded", headers={"Authorization": "Bearer wrong"}))

    ok, refused = asyncio.run(calls())
    assert ok.status_code == 200 and threads[0] == ok.json()["loop"]  # checked on the event loop's thread
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
