"""The OpenAI-compatible capture proxy, end to end: the real ``openai`` client → ``tracecar proxy`` →
a vLLM-shaped upstream on 127.0.0.1 (tests/support/openai_upstream.py), recording to a real
collector; read back through the store, the viewer API (/v1/trajectories, tokens, /v1/groups),
the JSONL export and the OTLP exporter (into a second collector's OTLP receiver).

What must hold: the upstream's answer reaches the agent as the upstream sent it (status, headers,
bytes; streamed chunk by chunk), whatever happens to recording (collector down, restarted); errors
are the upstream's own, or a clear 502/504 naming it; each request of a rollout is a ``generate``
span with messages, tool calls, token ids and logprobs; the reward makes the rollout a scored
trajectory; the agent's API key reaches the upstream and nothing else.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.support import clean_env, free_port, stop_process, wait_http
from tests.support.openai_upstream import OpenAIUpstream, ServedApp
from tracecar.client.config import ClientConfig
from tracecar.client.integrations.proxy_app import ProxyApp
from tracecar.client.integrations.proxy_config import ProxyConfig
from tracecar.client.integrations.proxy_rollouts import rollout_trace_id
from tracecar.client.tracer import Tracer

pytestmark = pytest.mark.timeout(180)

API_KEY = "sk-agent-" + "5ecret0123456789abcdefXYZ"
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluates an arithmetic expression.",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
VLLM_EXTRA = {"return_token_ids": True, "return_tokens_as_token_ids": True}


@pytest.fixture
def tokenizer(small_bpe_path: str) -> Tokenizer:
    return Tokenizer.from_file(small_bpe_path)


@pytest.fixture
def upstream(tokenizer: Tokenizer) -> Iterator[ServedApp]:
    served = ServedApp(OpenAIUpstream(tokenizer), free_port())
    yield served
    served.stop()


@pytest.fixture
def start_proxy() -> Iterator[Callable[..., ServedApp]]:
    """start_proxy(upstream_url, collector_url, experiment=..., **ProxyConfig fields) -> the proxy on 127.0.0.1."""
    started: list[ServedApp] = []

    def start(upstream_url: str, collector_url: str, experiment: str = "proxy-test", **settings: Any) -> ServedApp:
        config = ProxyConfig(upstream=upstream_url, port=free_port(), **settings)
        tracer = Tracer(ClientConfig.from_env(env={}, url=collector_url, flush_interval_s=0.02, experiment=experiment,
                                              worker_id="proxy-test", retry_max_s=0.5, retry_probe_s=0.2))
        served = ServedApp(ProxyApp(config, tracer), config.port)
        started.append(served)
        return served

    yield start
    for served in started:
        served.stop()


def agent(base_url: str, question: str, stream_last: bool = False) -> tuple[list[dict[str, Any]], str]:
    """A tool-using agent loop with the real openai client: the model calls the calculator, the agent
    runs it, the model answers. Returns the conversation and the final answer."""
    client = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=30)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": question}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, logprobs=True,  # type: ignore[arg-type]
                                           extra_body=VLLM_EXTRA)
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "4"}]
    if stream_last:
        chunks = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, stream=True,  # type: ignore[arg-type]
                                                stream_options={"include_usage": True}, extra_body=VLLM_EXTRA)
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        last = client.chat.completions.create(model="tiny", messages=messages, logprobs=True,  # type: ignore[arg-type]
                                              extra_body=VLLM_EXTRA)
        answer = last.choices[0].message.content or ""
    return messages, answer


def wait_for(what: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.05)


def listed(collector_url: str, **params: Any) -> list[dict[str, Any]]:
    return httpx.get(collector_url + "/v1/trajectories", params=params, timeout=10).json()["trajectories"]


def _generates(tree: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted((c for c in tree["root"]["children"] if c["name"] == "generate"), key=lambda s: s["start_time"])


def test_a_rollout_through_the_proxy_is_a_scored_trajectory_in_the_store_the_views_and_the_exporters(
        start_collector, start_proxy, upstream, tokenizer, small_bpe_path):
    destination = start_collector()  # the OTLP exporter's destination: a real OTLP/HTTP receiver
    collector = start_collector(tokenizer=small_bpe_path, token2text=True, backend="otlp",
                                otlp_endpoint=destination.url + "/v1/traces", otlp_content=True)
    proxy = start_proxy(upstream.url + "/v1", collector.url)
    answers = {}
    for n, reward in ((0, 1.0), (1, 0.0)):  # one GRPO group: two rollouts of sample 7 at step 3
        rollout = f"ro-{n}"
        messages, answers[n] = agent(f"{proxy.url}/rollout/{rollout}/v1", "What is 2 plus 2 today?", stream_last=n == 1)
        answer = httpx.post(f"{proxy.url}/rollout/{rollout}/reward", json={"reward": reward, "step": 3, "sample_index": 7,
                                                                             "rollout_n": n}, timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"trace_id": rollout_trace_id("proxy-test", rollout, None), "rollout": "closed"}
    assert answers[0] == answers[1] == "answer 4 done"  # the streamed answer is the non-streamed one

    rows = wait_for(lambda: (r := listed(collector.url, experiment="proxy-test", step=3)) and len(r) == 2 and r)
    by_n = {r["rollout_n"]: r for r in rows}
    assert by_n[0]["reward"] == 1.0 and by_n[1]["reward"] == 0.0
    assert {r["sample_index"] for r in rows} == {7} and {r["name"] for r in rows} == {"rollout"}
    assert all(r["turns"] == 2 and r["span_count"] == 3 and not r["has_error"] for r in rows)
    assert by_n[0]["response_preview"] == "answer 4 done"

    tree = httpx.get(f"{collector.url}/v1/trajectories/{by_n[0]['trace_id']}", timeout=10).json()
    assert tree["root"]["attributes"]["rollout_id"] == "ro-0" and tree["root"]["kind"] == "trajectory"
    call, final = _generates(tree)
    # the model's tool call: request, tool call, token ids, logprobs, usage, timings
    assert call["inputs"]["messages"] == messages[:2] and call["inputs"]["tools"] == TOOLS
    assert call["inputs"]["sampling_params"]["return_token_ids"] is True
    request_sent = json.loads(upstream.app.requests[0][2])
    turn = upstream.app.generate(request_sent, chat=True)
    assert call["inputs"]["prompt_ids"] == turn["prompt_ids"]
    assert call["output"]["token_ids"] == turn["ids"]
    assert call["output"]["tool_calls"][0]["function"]["name"] == "calculator"
    assert call["output"]["finish_reason"] == "tool_calls"
    assert call["output"]["usage"]["completion_tokens"] == len(turn["ids"])
    assert call["output"]["response_text"] == tokenizer.decode(turn["ids"], skip_special_tokens=False)  # decoded by the collector
    assert call["output"]["prompt_text"] == tokenizer.decode(turn["prompt_ids"], skip_special_tokens=False)
    assert 0 < call["output"]["first_byte_s"] <= call["output"]["latency_s"] < 30
    # the answer after the tool ran: the whole conversation so far, the content
    assert final["inputs"]["messages"] == messages and final["output"]["content"] == "answer 4 done"
    assert final["output"]["response_text"] == "answer 4 done"

    tokens = httpx.get(f"{collector.url}/v1/trajectories/{by_n[0]['trace_id']}/tokens", timeout=10).json()
    [first_tokens, _] = tokens["spans"]
    assert [t["id"] for t in first_tokens["tokens"]] == turn["ids"]
    assert [t["logprob"] for t in first_tokens["tokens"]] == pytest.approx(turn["logprobs"], abs=1e-6)

    streamed = _generates(httpx.get(f"{collector.url}/v1/trajectories/{by_n[1]['trace_id']}", timeout=10).json())[1]
    assert streamed["output"]["stream"] is True and streamed["output"]["content"] == "answer 4 done"
    assert streamed["output"]["token_ids"] == final["output"]["token_ids"]  # reassembled from the chunks
    assert streamed["output"]["usage"] == final["output"]["usage"] and streamed["output"]["chunks"] > 3

    groups = httpx.get(collector.url + "/v1/groups", params={"step": 3, "experiment": "proxy-test"}, timeout=10).json()
    [group] = groups["groups"]
    assert group["sample_index"] == 7 and group["n"] == 2 and group["mean"] == 0.5 and group["best"] == by_n[0]["trace_id"]

    export = httpx.get(collector.url + "/v1/export", params={"format": "jsonl", "experiment": "proxy-test", "step": 3}, timeout=30)
    exported = [json.loads(line) for line in export.text.splitlines()]
    assert sorted(e["reward"] for e in exported) == [0.0, 1.0]

    def arrived() -> Any:  # the OTLP exporter's copy, read back from the destination
        r = httpx.get(f"{destination.url}/v1/trajectories/{by_n[0]['trace_id']}", timeout=10)
        return r.status_code == 200 and r.json()["span_count"] >= 3 and r.json()
    copy = wait_for(arrived)
    names = sorted(s["name"] for s in copy["root"]["children"])
    assert names == ["generate", "generate"]
    assert copy["root"]["children"][0]["attributes"]["gen_ai.operation.name"] == "chat"

    # the agent's key went to the upstream, and nowhere into the store
    assert {h.get("authorization") for _, h, _ in upstream.app.requests} == {f"Bearer {API_KEY}"}
    stored = b"".join(p.read_bytes() for p in Path(collector.settings.data_dir).rglob("*") if p.is_file())
    assert API_KEY.encode() not in stored and b"calculator" in stored


def test_the_answer_passes_through_byte_for_byte_streamed_or_not(start_collector, start_proxy, upstream):
    collector = start_collector()
    proxy = start_proxy(upstream.url, collector.url)  # an upstream URL without /v1 means the same server
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count the rollout steps"}], "logprobs": True,
            **VLLM_EXTRA}
    for request in (body, {**body, "stream": True, "stream_options": {"include_usage": True}}):
        direct = httpx.post(upstream.url + "/v1/chat/completions", json=request, timeout=10)
        chunks = []
        with httpx.stream("POST", proxy.url + "/rollout/bytes/v1/chat/completions", json=request, timeout=10) as through:
            chunks = list(through.iter_raw())
        assert through.status_code == direct.status_code == 200
        assert b"".join(chunks) == direct.content  # body bytes untouched
        for name in ("content-type", "x-request-id", "x-upstream-marker"):
            assert through.headers[name] == direct.headers[name]
        assert "server" not in through.headers and "date" not in through.headers  # the proxy adds none of its own
        if request.get("stream"):
            assert len(chunks) > 3  # forwarded event by event, not gathered into one body
    models = httpx.get(proxy.url + "/v1/models", timeout=10)  # other routes pass through, unrecorded
    assert models.json()["data"][0]["id"] == "tiny"
    stats = httpx.get(proxy.url + "/tracecar/stats", timeout=10).json()
    assert stats["forwarded"] == 3 and stats["recorded"] == 2


def test_a_keep_alive_connection_the_upstream_closed_while_idle_is_replaced_without_an_error(start_collector, start_proxy,
                                                                                            tokenizer):
    upstream = ServedApp(OpenAIUpstream(tokenizer), free_port(), timeout_keep_alive=0.2)  # closes idle connections fast
    try:
        proxy = start_proxy(upstream.url + "/v1", start_collector().url)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(3):
            answer = httpx.post(proxy.url + "/rollout/idle/v1/chat/completions", json=body, timeout=10)
            assert answer.status_code == 200, answer.text
            time.sleep(0.6)  # the upstream drops the pooled connection meanwhile
        stats = httpx.get(proxy.url + "/tracecar/stats", timeout=10).json()
        assert stats["forwarded"] == 3 and "upstream_unreachable" not in stats
        for _ in range(5):  # back to back: one connection, kept alive and reused
            assert httpx.post(proxy.url + "/rollout/idle/v1/chat/completions", json=body, timeout=10).status_code == 200
        assert len({port for port in upstream.app.client_ports[-5:]}) == 1
    finally:
        upstream.stop()


def test_an_answer_past_the_recording_bound_is_forwarded_whole_and_recorded_as_truncated(start_collector, start_proxy, upstream):
    collector = start_collector()
    proxy = start_proxy(upstream.url + "/v1", collector.url, max_record_bytes=1500)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell the rollout reward story"}], "stream": True,
            "logprobs": True, **VLLM_EXTRA}
    direct = httpx.post(upstream.url + "/v1/chat/completions", json=body, timeout=10).content
    through = httpx.post(proxy.url + "/rollout/big/v1/chat/completions", json=body, timeout=10).content
    assert through == direct and len(direct) > 1500
    httpx.post(f"{proxy.url}/rollout/big/reward", json={"reward": 1}, timeout=10)
    [row] = wait_for(lambda: listed(collector.url, experiment="proxy-test"))
    [span] = _generates(httpx.get(f"{collector.url}/v1/trajectories/{row['trace_id']}", timeout=10).json())
    assert span["output"]["recording_truncated"] is True and span["inputs"]["messages"] == body["messages"]
    assert span["output"]["chunks"] >= 1  # the events kept before the bound are still read
    assert httpx.get(proxy.url + "/tracecar/stats", timeout=10).json()["recordings_truncated"] == 1


def test_upstream_errors_pass_through_and_no_answer_is_a_clear_502_or_504(start_collector, start_proxy, upstream):
    collector = start_collector()
    proxy = start_proxy(upstream.url + "/v1", collector.url, read_timeout_s=0.5)
    client = openai.OpenAI(base_url=f"{proxy.url}/rollout/errors/v1", api_key=API_KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as bad:  # the upstream's 400, as the upstream gave it
        client.chat.completions.create(model="error-400", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert bad.value.status_code == 400 and "max_tokens must be at least 1" in str(bad.value.message)
    direct = httpx.post(upstream.url + "/v1/chat/completions", json={"model": "error-400", "messages": []}, timeout=10)
    through = httpx.post(proxy.url + "/rollout/errors/v1/chat/completions", json={"model": "error-400", "messages": []}, timeout=10)
    assert (through.status_code, through.content) == (direct.status_code, direct.content)

    with pytest.raises(openai.APIStatusError) as slow:  # slower than the proxy's read timeout: 504 naming the upstream
        client.chat.completions.create(model="slow-2", messages=[{"role": "user", "content": "hi"}])
    assert slow.value.status_code == 504 and upstream.url in str(slow.value.message)

    closed = free_port()  # nothing listens there
    dead = start_proxy(f"http://127.0.0.1:{closed}/v1", collector.url)
    gone = httpx.post(dead.url + "/rollout/errors/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=10)
    assert gone.status_code == 502
    assert f"127.0.0.1:{closed}" in gone.json()["error"]["message"] and "unreachable" in gone.json()["error"]["message"]

    httpx.post(f"{proxy.url}/rollout/errors/reward", json={"reward": 0}, timeout=10)
    [row] = wait_for(lambda: listed(collector.url, experiment="proxy-test"))
    assert row["has_error"] is True
    tree = httpx.get(f"{collector.url}/v1/trajectories/{row['trace_id']}", timeout=10).json()
    failures = sorted(s["exception"] for s in _generates(tree))
    assert any(f.startswith("UpstreamError: HTTP 400: max_tokens must be at least 1") for f in failures)
    assert any("did not answer" in f for f in failures)


def test_requests_never_wait_for_the_collector_and_spans_arrive_after_it_restarts(start_proxy, upstream, tmp_path):
    from tests.support import serve_in_thread
    from tracecar.collector.settings import CollectorSettings

    port = free_port()  # the collector is down when the agent runs
    proxy = start_proxy(upstream.url + "/v1", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    _, answer = agent(f"{proxy.url}/rollout/while-down/v1", "What is 3 plus 1?")
    assert answer == "answer 4 done" and time.monotonic() - started < 5
    assert httpx.post(f"{proxy.url}/rollout/while-down/reward", json={"reward": 1.0}, timeout=10).status_code == 200
    stats = httpx.get(proxy.url + "/tracecar/stats", timeout=10).json()
    assert stats["sender"]["sent"] == 0 and stats["sender"]["dropped_total"] == 0

    collector = serve_in_thread(CollectorSettings(host="127.0.0.1", port=port, data_dir=tmp_path / "late", backend="local"))
    try:
        [row] = wait_for(lambda: listed(collector.url, experiment="proxy-test"), timeout=30)
        assert row["reward"] == 1.0 and row["span_count"] == 3
    finally:
        collector.stop()


def test_a_rollout_without_a_reward_closes_when_idle_and_a_late_reward_still_scores_it(start_collector, start_proxy, upstream):
    collector = start_collector()
    proxy = start_proxy(upstream.url + "/v1", collector.url, rollout_idle_s=0.3)
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=API_KEY, max_retries=0,  # the plain /v1 with headers
                           default_headers={"X-Tracecar-Rollout": "by-header", "X-Tracecar-Step": "5",
                                            "X-Tracecar-Sample-Index": "q-12", "X-Tracecar-Rollout-N": "x"})
    client.completions.create(model="tiny", prompt="Say the rollout words", logprobs=1, extra_body=VLLM_EXTRA)
    [row] = wait_for(lambda: listed(collector.url, experiment="proxy-test"))
    assert (row["step"], row["sample_index"], row["rollout_n"], row["reward"]) == (5, "q-12", None, None)  # the bad header: ignored
    tree = httpx.get(f"{collector.url}/v1/trajectories/{row['trace_id']}", timeout=10).json()
    [span] = _generates(tree)
    assert span["inputs"]["endpoint"] == "/v1/completions" and span["inputs"]["prompt"] == "Say the rollout words"
    assert span["output"]["text"] == "answer say the rollout words done"
    [tokens] = httpx.get(f"{collector.url}/v1/trajectories/{row['trace_id']}/tokens", timeout=10).json()["spans"]
    assert tokens["count"] == len(span["output"]["token_ids"]) > 3 and tokens["has"]["logprobs"]  # completions' logprobs shape
    stats = httpx.get(proxy.url + "/tracecar/stats", timeout=10).json()
    assert stats["rollouts_closed"] == {"idle": 1} and stats["headers_ignored"] == 1

    late = httpx.post(f"{proxy.url}/rollout/by-header/reward", json={"reward": 0.25}, timeout=10).json()
    assert late == {"trace_id": row["trace_id"], "rollout": "unknown"}
    wait_for(lambda: listed(collector.url, experiment="proxy-test")[0]["reward"] == 0.25)


def test_a_bad_reward_is_refused_naming_the_field(start_collector, start_proxy, upstream):
    collector = start_collector()
    proxy = start_proxy(upstream.url + "/v1", collector.url)
    for body, field in (({"reward": "high"}, "reward"), ({"score": 1}, "reward"), ({"reward": 1, "step": 1.5}, "step"),
                        ([1], "body"), ({"reward": 1, "trained": "yes"}, "trained")):
        answer = httpx.post(f"{proxy.url}/rollout/r/reward", json=body, timeout=10)
        assert answer.status_code == 422 and answer.json()["error"]["field"] == field, (body, answer.text)
    assert httpx.post(f"{proxy.url}/rollout/r/reward", content=b"{", timeout=10).status_code == 400
    assert httpx.get(f"{proxy.url}/rollout/r/reward", timeout=10).status_code == 405
    assert httpx.get(proxy.url + "/tracecar/stats", timeout=10).json()["rewards_rejected"] == 5


def test_tracecar_proxy_command_serves_and_a_misconfiguration_is_one_line(start_collector, upstream, tmp_path):
    tracecar = str(Path(sys.executable).parent / "tracecar")
    bad = subprocess.run([tracecar, "proxy", "--upstream", "ftp://x", "--collector", "http://127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60, env=clean_env())
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "TRACECAR_PROXY_UPSTREAM='ftp://x'" in bad.stderr
    none = subprocess.run([tracecar, "proxy", "--upstream", upstream.url], capture_output=True, text=True, timeout=60,
                          env=clean_env())
    assert none.returncode == 2 and "TRACECAR_URL" in none.stderr

    collector = start_collector()
    port = free_port()
    log = (tmp_path / "proxy.log").open("wb")
    proc = subprocess.Popen([tracecar, "proxy", "--upstream", upstream.url + "/v1", "--port", str(port), "--experiment", "cli"],
                            stdout=log, stderr=log, env=clean_env(TRACECAR_URL=collector.url, TRACECAR_FLUSH_INTERVAL_S="0.05"))
    try:
        wait_http(f"http://127.0.0.1:{port}/tracecar/healthz", proc, timeout=60)
        _, answer = agent(f"http://127.0.0.1:{port}/rollout/cli-1/attempt/a2/v1", "What is 1 plus 3?")
        assert answer == "answer 4 done"
        reward = httpx.post(f"http://127.0.0.1:{port}/rollout/cli-1/attempt/a2/reward", json={"reward": 1}, timeout=10).json()
        assert reward["trace_id"] == rollout_trace_id("cli", "cli-1", "a2")
        [row] = wait_for(lambda: listed(collector.url, experiment="cli"))
        assert row["trace_id"] == reward["trace_id"] and row["reward"] == 1 and row["worker"].startswith("proxy:")
        agent(f"http://127.0.0.1:{port}/rollout/cli-open/v1", "What is 0 plus 4?")  # no reward: open at shutdown
    finally:
        code = stop_process(proc)  # SIGTERM: open rollouts closed, the sender flushed; uvicorn then re-raises the signal
        log.close()
    text = (tmp_path / "proxy.log").read_text()
    assert code in (0, -15) and "1 open rollouts closed, spans flushed" in text and "Traceback" not in text, text
    wait_for(lambda: len(listed(collector.url, experiment="cli")) == 2)

