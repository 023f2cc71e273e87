"""Wire version 3 (short span ids, tracecar.client.short_ids): v1, v2 and v3 bodies of the same
trajectory store identical spans at a real collector; the real client moves to v3 once the
collector lists it, and an id that is not this process's counter form is sent in full.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import httpx
import orjson
import pytest

from tracecar.client import annotate, rollout_trace_attr, rollout_trace_op
from tracecar.client import sender as sender_module
from tracecar.client.prompt_delta import PromptDeltas
from tracecar.client.redact import RedactKeys
from tracecar.client.short_ids import expand, expand_wire, shorten, shorten_wire
from tracecar.client.wire import WireEncoder, batch_body, pack_span
from tracecar.collector.spool.full_payloads import conn_loader, full_payloads

pytestmark = pytest.mark.timeout(120)

PREFIX = "5760f8774f9e4165"
ENCODER = WireEncoder(1_000_000, 32, RedactKeys())


def sid(n: int, prefix: str = PREFIX) -> str:
    return f"{prefix}{n:016x}"


def trajectory(turns: int = 6, seed: int = 3) -> list[dict[str, Any]]:
    """VERL's shape as tracecar's client marks it: root, the agent loop's run, its generate turns
    (a growing prompt, the turn mark), a tool call; plus a child of a foreign (traceparent) parent."""
    rng = random.Random(seed)
    root, run = sid(0x12), sid(0x13)
    attrs = {"sample_index": 0, "step": 1, "validate": False}
    spans = [{"span_id": root, "trace_id": root, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
              "start_time": 1.0, "end_time": 99.0, "attributes": {**attrs, "tracecar": {"trajectory": True}}, "inputs": {},
              "output": None, "exception": None},
             {"span_id": run, "trace_id": root, "parent_id": root, "name": "Agent.run", "kind": "op", "start_time": 1.5,
              "end_time": 98.0, "attributes": {**attrs, "tracecar": {"top": True}}, "inputs": {"request_id": "r"},
              "output": None, "exception": None}]
    prompt = [rng.randrange(100_000) for _ in range(300)]
    for turn in range(turns):
        me = sid(0x100 + turn)
        reply = [rng.randrange(100_000) for _ in range(80)]
        spans.append({"span_id": me, "trace_id": root, "parent_id": run, "name": "Agent.generate", "kind": "op",
                      "start_time": 2.0 + turn, "end_time": 2.5 + turn,
                      "attributes": {**attrs, "tracecar": {"root": run, "turn": me}},
                      "inputs": {"request_id": "r", "prompt_ids": list(prompt), "sampling_params": {"t": 1.0}},
                      "output": {"token_ids": reply, "log_probs": None}, "exception": None})
        prompt += reply + [rng.randrange(100_000) for _ in range(50)]
    spans[1]["output"] = {"prompt_ids": prompt[:300], "response_ids": prompt[300:], "num_turns": turns}
    foreign = "ab" * 16  # a parent from another process (traceparent): not this prefix
    spans.append({"span_id": sid(0x999), "trace_id": root, "parent_id": run, "name": "tool", "kind": "op", "start_time": 3.0,
                  "end_time": 3.1, "attributes": {**attrs, "tracecar": {"root": foreign, "turn": sid(0x999)}},
                  "inputs": {"instance_id": sid(0x13)}, "output": "ok", "exception": None})  # an id in data: left as is
    return spans[2:] + spans[:2]  # the order the client sends them: children end first


def bodies(version: int, per_batch: int) -> list[bytes]:
    spans = trajectory()
    deltas = PromptDeltas(4096, 1_000_000)
    deltas.set_enabled(version >= 2)
    header = {"v": version, "worker": "w-v3", "project": None, "entity": None, "tokenizer": None}
    if version >= 3:
        header["id_prefix"] = PREFIX
    packed = []
    for span in spans:
        wire = copy.deepcopy(span)
        if version >= 2:
            deltas.apply(wire)
        if version >= 3:
            shorten_wire(wire, PREFIX)
        packed.append(pack_span(wire, ENCODER, 1_000_000))
    assert version < 2 or deltas.counts["sent"] >= 5  # references were used
    return [batch_body(header, packed[i:i + per_batch]) for i in range(0, len(packed), per_batch)]


def spooled(data_dir: Any) -> dict[str, Any]:
    """Each spooled span's payload by id, without the receive time (it differs between runs)."""
    import sqlite3

    with sqlite3.connect(f"file:{data_dir}/spool.sqlite3?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT payload FROM spans").fetchall()
        # as every reader gets them: stored prompt references rebuilt (spool.full_payloads)
        rows = [(p,) for p in full_payloads([r[0] for r in rows], conn_loader(conn, "spans"))]
    out = {}
    for (payload,) in rows:
        span = orjson.loads(payload)
        span.pop("received_at", None)
        out[span["span_id"]] = span
    return out


def test_v1_v2_and_v3_bodies_store_identical_spans(start_collector: Any, kit: Any) -> None:
    trees, payloads, sizes = [], [], {}
    for version, per_batch in ((1, 100), (2, 100), (3, 100), (3, 2)):
        col = start_collector()
        sent = bodies(version, per_batch)
        sizes[(version, per_batch)] = sum(map(len, sent))
        for body in sent:
            answer = httpx.post(col.url + "/v1/spans", content=body, headers={"Content-Type": "application/json"}, timeout=30)
            assert answer.status_code == 200 and answer.json()["rejected_count"] == 0, answer.text
            assert 3 in answer.json()["wire_versions"]
        tree = kit.wait_for(lambda: (r := httpx.get(f"{col.url}/v1/trajectories/{sid(0x12)}", timeout=10)).status_code == 200
                            and len(r.json()["root"]["children"]) == 1 and len(r.json()["root"]["children"][0]["children"]) == 7
                            and r.json())
        assert tree, f"v{version}: trajectory not stored"
        trees.append(tree)
        payloads.append(spooled(col.settings.data_dir))
    for tree in trees[1:]:
        assert orjson.dumps(tree, option=orjson.OPT_SORT_KEYS) == orjson.dumps(trees[0], option=orjson.OPT_SORT_KEYS)
    assert len(payloads[0]) == 9
    for spool in payloads[1:]:  # what the forwarder hands Weave and every exporter
        assert spool == payloads[0]
    generate = payloads[2][sid(0x105)]
    assert generate["attributes"]["tracecar"] == {"root": sid(0x13), "turn": sid(0x105)}
    assert payloads[2][sid(0x999)]["attributes"]["tracecar"]["root"] == "ab" * 16
    assert len(generate["inputs"]["prompt_ids"]) == 300 + 5 * 130
    assert sizes[(3, 100)] < sizes[(2, 100)] < sizes[(1, 100)]


def test_short_ids_round_trip_and_only_the_counter_form_is_shortened() -> None:
    rng = random.Random(5)
    for _ in range(2000):
        n = rng.choice((0, 1, rng.randrange(2**64), 2**64 - 1, 0x10, 0x100000))
        full = sid(n)
        short = shorten(full, PREFIX)
        assert short.startswith("~") and len(short) <= 17 and expand(short, PREFIX) == full
    for other in (sid(5, "ffffffffffffffff"), PREFIX + "ABCDEF0123456789", PREFIX + "0" * 15, PREFIX + "g" * 16, "x", None, 7,
                  PREFIX + "0" * 17):
        assert shorten(other, PREFIX) == other
    assert expand("plain-id", PREFIX) == "plain-id"


def test_shortening_copies_what_it_shares() -> None:
    attributes = {"tracecar": {"root": sid(1), "turn": sid(2)}, "step": 1}
    ref = {"$ref": sid(3), "n": 40, "add": [1]}
    wire = {"span_id": sid(2), "trace_id": sid(0), "parent_id": sid(1), "attributes": attributes,
            "inputs": {"prompt_ids": ref}, "output": None}
    shorten_wire(wire, PREFIX)
    assert attributes == {"tracecar": {"root": sid(1), "turn": sid(2)}, "step": 1} and ref["$ref"] == sid(3)
    assert (wire["span_id"], wire["attributes"]["tracecar"]["turn"], wire["inputs"]["prompt_ids"]["$ref"]) == ("~2", "~2", "~3")
    expand_wire(wire, PREFIX)
    assert wire["span_id"] == sid(2) and wire["inputs"]["prompt_ids"]["$ref"] == sid(3) and wire["trace_id"] == sid(0)


def test_a_short_id_without_its_prefix_is_refused_by_field(start_collector: Any) -> None:
    col = start_collector()
    body = orjson.dumps({"v": 3, "worker": "w", "spans": [{"span_id": "~5", "trace_id": "~5", "name": "x", "kind": "trajectory",
                                                           "start_time": 1.0}]})
    answer = httpx.post(col.url + "/v1/spans", content=body, headers={"Content-Type": "application/json"}, timeout=30).json()
    assert answer["rejected_count"] == 1 and answer["rejected"][0]["field"].endswith("span_id")


@rollout_trace_op
async def generate(request_id: str, prompt_ids: list[int]) -> dict[str, Any]:
    return {"token_ids": list(range(len(prompt_ids), len(prompt_ids) + 40))}


def test_the_real_client_moves_to_v3_and_the_store_has_full_ids(start_collector: Any, tracer_to: Any) -> None:
    import asyncio

    col = start_collector()
    tracer = tracer_to(col.url)
    sent: list[dict[str, Any]] = []
    original = sender_module.Sender._post_with_retries

    def capture(self: Any, body: bytes, n: int) -> bool:
        sent.append(orjson.loads(body))
        return original(self, body, n)

    sender_module.Sender._post_with_retries = capture  # type: ignore[method-assign]
    try:
        async def one(i: int) -> str:
            with rollout_trace_attr(step=1, sample_index=i, name="agent_loop") as traj:
                prompt = list(range(200))
                for _ in range(4):
                    prompt += (await generate(f"r{i}", prompt))["token_ids"]
                    await asyncio.sleep(0.05)  # turns in different batches
            assert traj is not None
            return traj.span_id

        async def main() -> list[str]:
            return list(await asyncio.gather(*(one(i) for i in range(3))))

        roots = asyncio.run(main())
        assert tracer.flush(20)  # the first answers listed 3: the rewards below go out as v3
        annotate(roots[0], reward=0.5)  # by id: the trajectory is only an id here (tracing._TraceRef)
        annotate(roots[1], reward=1.0, trained=True)
        assert tracer.flush(20)
    finally:
        sender_module.Sender._post_with_retries = original  # type: ignore[method-assign]
    assert sent[0]["v"] == 2 and "id_prefix" not in sent[0]  # before the first answer: nothing short
    later = [b for b in sent if b["v"] == 3]
    assert later and all(s["span_id"].startswith("~") for b in later for s in b["spans"])
    stats = tracer.stats()
    assert stats["dropped_total"] == 0 and stats["prompt_refs"]["sent"] >= 6
    for root in roots:
        tree = httpx.get(f"{col.url}/v1/trajectories/{root}", timeout=10).json()
        turns = sorted(tree["root"]["children"], key=lambda c: c["start_time"])
        assert len(turns) == 4 and all(len(c["span_id"]) == 32 and "~" not in orjson.dumps(c).decode() for c in turns)
        assert [len(c["inputs"]["prompt_ids"]) for c in turns] == [200, 240, 280, 320]
    listed = {t["trace_id"]: t for t in httpx.get(f"{col.url}/v1/trajectories", params={"step": 1}, timeout=10).json()["trajectories"]}
    assert [listed[r]["reward"] for r in roots] == [0.5, 1.0, None]  # annotations sent short reach their trajectory


def test_shortening_a_record_equals_shortening_its_ids() -> None:
    from tracecar.client.short_ids import shorten_record
    from tracecar.client.spans import SpanRecord, ids

    root = SpanRecord("agent_loop", "trajectory", 1.0, None, {"step": 1})
    top = SpanRecord("run", "op", 1.0, root, {"step": 1, "tracecar": {"top": True}})
    turn = SpanRecord("generate", "op", 1.0, top, None)
    turn.attributes = {"tracecar": {"root": top.span_id, "turn": turn.span_id}}
    foreign = SpanRecord("tool", "op", 1.0, turn, None)
    foreign.prefix, foreign._sid = "f" * 16, None  # made in another process (a fork's parent)
    for record in (root, top, turn, foreign):
        a, b = record.to_wire(), record.to_wire()
        shorten_record(a, record, ids.prefix)
        shorten_wire(b, ids.prefix)
        assert a == b
        expand_wire(a, ids.prefix)
        assert a == record.to_wire()


def test_an_open_marker_keeps_its_own_id_when_short() -> None:
    """A marker's span_id is the call's + ".open": shortened by the strings it stays distinct from
    the call's own span (the same batch may carry both when the call ends meanwhile)."""
    from tracecar.client.sender import open_marker_wire
    from tracecar.client.spans import SpanRecord, ids

    root = SpanRecord("agent_loop", "trajectory", 1.0, None, {"step": 1})
    call = SpanRecord("generate", "op", 1.0, root, {"step": 1})
    marker = open_marker_wire(call)
    shorten_wire(marker, ids.prefix)
    expand_wire(marker, ids.prefix)
    assert marker["span_id"] == call.span_id + ".open" and marker["trace_id"] == root.span_id


def test_the_sender_writes_a_markers_short_id_with_its_suffix() -> None:
    from tracecar.client.config import ClientConfig
    from tracecar.client.sender import Sender
    from tracecar.client.spans import SpanRecord

    s = Sender(ClientConfig(url="http://127.0.0.1:9", worker_id="w-unit"))
    s.deltas.set_enabled(True)
    s._short_ids = s._markers_ok = True  # as after an answer listing 3
    root = SpanRecord("agent_loop", "trajectory", 1.0, None, {"step": 1})
    running, done = SpanRecord("generate", "op", 1.0, root, {"step": 1}), SpanRecord("tool", "op", 1.0, root, {"step": 1})
    done.end = 2.0
    s.opens.append(running)
    s.queue.append(done)  # not enqueue(): no thread, this test builds the body itself
    built = s._build_body()
    assert built is not None
    batch = orjson.loads(built[0])
    assert batch["v"] == 3
    for span in batch["spans"]:
        expand_wire(span, batch["id_prefix"])
    assert [x["span_id"] for x in batch["spans"]] == [running.span_id + ".open", done.span_id]
