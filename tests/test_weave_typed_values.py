"""Enums, datetimes and non-finite numbers as Weave shows them (issue 27 §8, §9), read back through
weave's own trace server (weave 0.52.42's SQLite server, ``tests/support/weave_server.py``).

The same call is recorded twice into two projects of that server: by weave 0.54's own client in
this process (``create_call`` / ``finish_call``, what VERL's weave backend calls), and by tracecar
(the real client → a real collector on 127.0.0.1 → its Weave sink). Inputs and outputs read back
through weave's query API must be equal, ``load_op`` refs included (their digest is the one weave
makes for its ``load_datetime.datetime`` op), apart from one documented decision: a NaN or
infinity at the top level of inputs / output is text in tracecar (weave: null).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import enum
import math
import os
import time
from typing import Any

import pytest
from pydantic import BaseModel

from tests.support.weave_stub import WeaveSqliteServer, weave_server_python
from tracecar.client import rollout_trace_attr, rollout_trace_op

pytest.importorskip("weave")
if weave_server_python() is None:
    pytest.skip("needs a venv with weave==0.52.42 (see weave_stub.weave_server_python)", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)

API_KEY = "t" * 40
ENTITY = "typed"
OP = "Loop.generate"


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    HIGH = 3


class Mode(str, enum.Enum):
    FAST = "fast"


class Job(BaseModel):
    color: Color
    at: datetime.datetime
    level: Level


NAIVE = datetime.datetime(2026, 12, 4, 18, 30, 5, 123456)
AWARE = datetime.datetime(2026, 12, 4, 20, 0, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))


def inputs() -> dict[str, Any]:
    return {"color": Color.RED, "level": Level.HIGH, "mode": Mode.FAST, "when": NAIVE, "aware": AWARE,
            "day": datetime.date(2026, 12, 4), "gap": datetime.timedelta(seconds=90),
            "nested": {"c": Color.BLUE, "at": AWARE, "deeper": {"colors": [Color.RED, Color.BLUE]}},
            "job": Job(color=Color.BLUE, at=NAIVE, level=Level.HIGH),
            "reward": math.nan, "scores": {"best": math.inf}}


def output() -> dict[str, Any]:
    return {"color": Color.BLUE, "finished": NAIVE, "job": Job(color=Color.RED, at=AWARE, level=Level.HIGH),
            "value": -math.inf, "trace": {"nan": math.nan}}


class Loop:
    @rollout_trace_op
    async def generate(self, color: Any, level: Any, mode: Any, when: Any, aware: Any, day: Any, gap: Any, nested: Any,
                       job: Any, reward: Any, scores: Any) -> dict[str, Any]:
        return output()


@contextlib.contextmanager
def Env(**values: str) -> Any:  # noqa: N802
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _weave_own(server_url: str) -> None:
    env = dict(WANDB_BASE_URL=server_url, WF_TRACE_SERVER_URL=server_url, WANDB_API_KEY=API_KEY, WEAVE_DISABLED="false",
               WEAVE_PRINT_CALL_LINK="false", WEAVE_IMPLICITLY_PATCH_INTEGRATIONS="false", WANDB_ERROR_REPORTING="false")
    with Env(**env):
        import weave

        client = weave.init(f"{ENTITY}/weave-own")
        try:
            call = client.create_call(op=OP, inputs=inputs())
            client.finish_call(call, output=output())
            client.flush()
        finally:
            weave.finish()
            from opentelemetry import trace as otel  # weave.init installs a global OTel provider

            provider = otel.get_tracer_provider()
            if hasattr(provider, "shutdown"):
                provider.shutdown()


def _query(server_url: str, project: str) -> list[Any]:
    from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

    client = RemoteHTTPTraceServer(server_url)
    client.set_auth(("api", API_KEY))
    return list(client.calls_query_stream({"project_id": f"{ENTITY}/{project}",
                                           "filter": {"op_names": [f"weave:///{ENTITY}/{project}/op/{OP}:*"]}}))


def _neutral(value: Any, project: str) -> Any:
    """Refs name their project: the same ref in either project reads the same."""
    if isinstance(value, dict):
        return {k: _neutral(v, project) for k, v in value.items()}
    if isinstance(value, list):
        return [_neutral(v, project) for v in value]
    if isinstance(value, str):
        return value.replace(f"weave:///{ENTITY}/{project}/", "weave:///PROJECT/")
    return value


def test_enums_and_datetimes_read_back_as_weaves_own_client_writes_them(start_collector, tracer_to):
    with WeaveSqliteServer(weave_server_python()) as server:  # type: ignore[arg-type]
        _weave_own(server.url)
        col = start_collector(backend="weave", wandb_api_key=API_KEY, wandb_entity=ENTITY, wandb_project="tracecar",
                              weave_server_url=server.url)
        tracer = tracer_to(col.url, experiment="typed")

        async def one() -> None:
            with rollout_trace_attr(sample_index=0, step=1, rollout_n=0, name="agent_loop"):
                await Loop().generate(**inputs())

        asyncio.run(one())
        assert tracer.flush(30)
        deadline = time.monotonic() + 60
        while not (ours := _query(server.url, "tracecar")):
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.2)
        [theirs] = _query(server.url, "weave-own")
        [mine] = ours
    want_in, want_out = _neutral(theirs.inputs, "weave-own"), _neutral(theirs.output, "weave-own")
    got_in, got_out = _neutral(mine.inputs, "tracecar"), _neutral(mine.output, "tracecar")
    # weave's forms, spelled out
    assert want_in["color"] == "<Color.RED: 'red'>" and want_in["level"] == 3 and want_in["mode"] == "fast"
    assert want_in["when"]["_type"] == "CustomWeaveType" and want_in["when"]["val"] == "2026-12-04T18:30:05.123456+00:00"
    assert want_in["when"]["load_op"].startswith("weave:///PROJECT/op/load_datetime.datetime:")
    assert want_in["day"] == "datetime.date(2026, 12, 4)" and want_in["gap"] == "datetime.timedelta(seconds=90)"
    # the one documented decision (docs/weave.md): top-level non-finite numbers are text in tracecar
    assert (want_in.pop("reward"), got_in.pop("reward")) == (None, "nan")
    assert (want_out.pop("value"), got_out.pop("value")) == (None, "-inf")
    assert want_in["scores"] == got_in["scores"] == {"best": None} and got_out["trace"] == {"nan": None}
    assert got_in == want_in
    assert got_out == want_out
