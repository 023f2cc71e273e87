"""Prompt deltas (wire version 2): each token of a growing prompt is sent once, the collector
rebuilds the full lists, decodes only the new ids, and nothing is lost when a reference fails.

Real client, real collector (uvicorn on 127.0.0.1, HTTP), real tokenizers: deepseek's byte-level
BPE from its package, and a Metaspace (Unigram) and a WordPiece tokenizer trained here.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tracecar.client import rollout_trace_attr, rollout_trace_op
from tracecar.client.prompt_delta import PromptDeltas
from tracecar.collector.processors.decoding import KnownPrefix, KnownSuffix, decode_spans
from tracecar.collector.spool.full_payloads import full_payloads, spool_loader

pytestmark = pytest.mark.timeout(180)

WORDS = ["tool", "call", "reward", "prompt", "answer", "step", "é", "数字", "🙂", "naïve", "don't", ".", ",", "?",
         "<|im_start|>", "\n", "  ", "▁x", "##ab", "123"]


def _corpus(seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(1500)]


@pytest.fixture(scope="module")
def tokenizers_under_test(deepseek_tokenizer_path: str) -> dict[str, Tokenizer]:
    metaspace = Tokenizer(models.Unigram())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    metaspace.train_from_iterator(_corpus(), trainers.UnigramTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<unk>"],
                                                                     unk_token="<unk>"))
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=False)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = decoders.WordPiece()
    wordpiece.train_from_iterator(_corpus(), trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"]))
    return {"byte_level_bpe": Tokenizer.from_file(deepseek_tokenizer_path), "metaspace": metaspace, "wordpiece": wordpiece}


@pytest.mark.parametrize("kind", ["byte_level_bpe", "metaspace", "wordpiece"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(WORDS), min_size=2, max_size=80), cut=st.floats(0, 1), turns=st.integers(1, 4))
def test_joined_text_equals_the_full_decode_at_random_cuts(tokenizers_under_test, kind, words, cut, turns):
    """earlier text + decode(new ids) is the full decode, or the full decode is used: never a wrong text."""
    tok = tokenizers_under_test[kind]
    ids = tok.encode(" ".join(words)).ids
    if len(ids) < 2:
        return
    # a few growing turns, each cut at a random place (multi-byte characters get split)
    cuts = sorted({max(1, min(len(ids) - 1, int(cut * len(ids)) + k * 7)) for k in range(turns)}) + [len(ids)]
    text = tok.decode(ids[:cuts[0]], skip_special_tokens=False)
    for before, now in zip(cuts, cuts[1:]):
        span = {"span_id": "s", "inputs": {"prompt_ids": ids[:now]}, "output": {}}
        outcomes: dict[str, int] = {}
        decoded = decode_spans([span], tok, {}, known={"s": KnownPrefix(before, text)}, outcomes=outcomes)
        full = tok.decode(ids[:now], skip_special_tokens=False)
        assert span["output"]["prompt_text"] == full
        assert sum(outcomes.values()) == 1
        if outcomes.get("reused"):
            assert decoded <= (now - before) + 2 * 8  # the new ids and the join window, not the whole prompt
        text = span["output"]["prompt_text"]


@pytest.mark.parametrize("kind", ["byte_level_bpe", "metaspace", "wordpiece"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(WORDS), min_size=3, max_size=80), cuts=st.tuples(st.floats(0, 1), st.floats(0, 1)))
def test_prompt_response_and_new_ids_join_to_the_full_decode(tokenizers_under_test, kind, words, cuts):
    """The next turn's prompt = earlier prompt + its response (both texts known, each decoded on its
    own) + new ids: the joined text is the full decode, or the full decode is used."""
    tok = tokenizers_under_test[kind]
    ids = tok.encode(" ".join(words)).ids
    if len(ids) < 3:
        return
    a, b = sorted(max(1, min(len(ids) - 1, int(c * len(ids)))) for c in cuts)
    if a == b:
        return
    prompt, response = ids[:a], ids[a:b]
    known = KnownPrefix(a, tok.decode(prompt, skip_special_tokens=False), len(response), tok.decode(response, skip_special_tokens=False))
    span = {"span_id": "s", "inputs": {"prompt_ids": ids}, "output": {}}
    outcomes: dict[str, int] = {}
    decoded = decode_spans([span], tok, {}, known={"s": known}, outcomes=outcomes)
    assert span["output"]["prompt_text"] == tok.decode(ids, skip_special_tokens=False)
    if outcomes.get("reused"):
        assert decoded <= len(ids) - b + 6 * 8  # the new ids and the windows at the two joins


@pytest.mark.parametrize("kind", ["byte_level_bpe", "metaspace", "wordpiece"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(WORDS), min_size=3, max_size=80), cuts=st.tuples(st.floats(0, 1), st.floats(0, 1)))
def test_a_response_cut_from_a_known_context_equals_its_full_decode(tokenizers_under_test, kind, words, cuts):
    """VERL's AgentLoopOutput: prompt_ids + response_ids = the last turn's context (prompt and
    response texts known); response_text cut from the context's text is the full decode, or that is used."""
    tok = tokenizers_under_test[kind]
    ids = tok.encode(" ".join(words)).ids
    if len(ids) < 3:
        return
    turn, start = (max(1, min(len(ids) - 1, int(c * len(ids)))) for c in cuts)
    context = KnownPrefix(turn, tok.decode(ids[:turn], skip_special_tokens=False), len(ids) - turn,
                          tok.decode(ids[turn:], skip_special_tokens=False))
    span = {"span_id": "s", "inputs": {}, "output": {"prompt_ids": ids[:start], "response_ids": ids[start:]}}
    outcomes: dict[str, int] = {}
    decoded = decode_spans([span], tok, {}, known={("s", "output.response_ids"): KnownSuffix(context, start)}, outcomes=outcomes)
    assert span["output"]["prompt_text"] == tok.decode(ids[:start], skip_special_tokens=False)
    assert span["output"]["response_text"] == tok.decode(ids[start:], skip_special_tokens=False)
    assert sum(outcomes.values()) == 1
    if outcomes.get("reused"):
        assert decoded <= start + 8 * 8  # the prompt and the windows at the two cuts (4 × 8 + 2 × 16), not the response


def test_a_character_split_at_the_join_falls_back_to_the_full_decode(tokenizers_under_test):
    tok = tokenizers_under_test["byte_level_bpe"]
    ids = tok.encode("answer 🙂🙂🙂 数字数字").ids
    splits = [i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd")]
    assert splits, "the emoji spans several byte-level tokens"
    cut = splits[0]
    span = {"span_id": "s", "inputs": {"prompt_ids": ids}, "output": {}}
    outcomes: dict[str, int] = {}
    decode_spans([span], tok, {}, known={"s": KnownPrefix(cut, tok.decode(ids[:cut]))}, outcomes=outcomes)
    assert outcomes == {"reused": 0, "full": 1}
    assert span["output"]["prompt_text"] == "answer 🙂🙂🙂 数字数字"


# ---- real client → real collector ----------------------------------------------------------------


class GrowingAgent:
    """VERL's multi-turn shape: generate(request_id, prompt_ids) with prompt_ids grown in place."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    @rollout_trace_op
    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0.03)  # a turn takes a while: turns land in different batches
        return {"token_ids": self.tok.encode(f" reply {len(prompt_ids)} 数字🙂 " + "answer " * 20).ids}

    @rollout_trace_op
    async def run(self, request_id: str, turns: int) -> dict[str, Any]:
        prompt_ids = self.tok.encode("<|im_start|>user question: " + "why step reward? " * 20).ids
        first = len(prompt_ids)
        for turn in range(turns):
            out = await self.generate(request_id, prompt_ids, {"temperature": 1.0})
            prompt_ids += out["token_ids"]
            prompt_ids += self.tok.encode(f" tool said {turn} é naïve ").ids
        return {"prompt_ids": prompt_ids[:first], "response_ids": prompt_ids[first:]}


def _run_trajectories(agent: GrowingAgent, n: int, turns: int) -> list[str]:
    async def one(i: int) -> str:
        with rollout_trace_attr(step=1, sample_index=i, name="agent_loop") as traj:
            await agent.run(f"req-{i}", turns)
        return traj.span_id

    async def main() -> list[str]:
        return list(await asyncio.gather(*(one(i) for i in range(n))))

    return asyncio.run(main())


def _generates(url: str, trace_id: str) -> list[dict[str, Any]]:
    tree = httpx.get(f"{url}/v1/trajectories/{trace_id}").json()
    [run] = tree["root"]["children"]
    return sorted((c for c in run["children"] if c["name"].endswith("generate")), key=lambda c: c["start_time"])


def _expected_prompts(tok: Tokenizer, turns: int, final: bool = False) -> list[list[int]]:
    prompt = tok.encode("<|im_start|>user question: " + "why step reward? " * 20).ids
    out = []
    for turn in range(turns):
        out.append(list(prompt))
        prompt += tok.encode(f" reply {len(prompt)} 数字🙂 " + "answer " * 20).ids
        prompt += tok.encode(f" tool said {turn} é naïve ").ids
    return out + [prompt] if final else out


def test_growing_prompts_are_sent_once_and_stored_whole(start_collector, tracer_to, kit, deepseek_tokenizer_path):
    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    col = start_collector(token2text=True, tokenizer=deepseek_tokenizer_path)
    tracer = tracer_to(col.url)
    traces = _run_trajectories(GrowingAgent(tok), n=4, turns=6)
    assert tracer.flush(20)
    stats = tracer.stats()
    assert stats["dropped_total"] == 0 and stats["sent"] == 4 * (1 + 1 + 6)
    refs = stats["prompt_refs"]
    # the first batch goes out whole (the collector has not yet said it reads v2); later turns by reference
    assert refs["sent"] >= 4 * 4 and refs["resent_full"] == 0, refs
    *expected, context = _expected_prompts(tok, 6, final=True)
    first = len(expected[0])
    for trace_id in traces:
        gens = _generates(col.url, trace_id)
        assert [g["inputs"]["prompt_ids"] for g in gens] == expected
        for g in gens:
            assert g["output"]["prompt_text"] == tok.decode(g["inputs"]["prompt_ids"], skip_special_tokens=False)
            assert g["output"]["response_text"] == tok.decode(g["output"]["token_ids"], skip_special_tokens=False)
        # the agent loop's output repeats the context (sent as slices of it): stored whole, decoded whole
        [run] = httpx.get(f"{col.url}/v1/trajectories/{trace_id}").json()["root"]["children"]
        assert run["output"]["prompt_ids"] == context[:first] and run["output"]["response_ids"] == context[first:]
        assert run["output"]["response_text"] == tok.decode(context[first:], skip_special_tokens=False)
    assert kit.metrics(col.url, "tracecar_prompt_refs_total", outcome="resolved") == refs["sent"]
    assert kit.metrics(col.url, "tracecar_prompt_refs_total", outcome="unresolved") == 0
    joins = {o: kit.metrics(col.url, "tracecar_prompt_text_joins_total", outcome=o) for o in ("reused", "full")}
    assert joins["reused"] >= 4 * 3, joins
    # every trajectory ended: its contexts are released with the batch that carried its root, to the byte
    assert kit.metrics(col.url, "tracecar_prompt_refs_bytes") == 0


def test_unresolvable_references_are_resent_in_full(start_collector, tracer_to, kit, deepseek_tokenizer_path):
    """A collector that keeps no contexts (as after a restart, or evicted): every reference is refused by
    name, the client resends those spans whole, and every prompt is stored whole."""
    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    col = start_collector(token2text=True, tokenizer=deepseek_tokenizer_path, prompt_refs_max_bytes=0)
    tracer = tracer_to(col.url)
    traces = _run_trajectories(GrowingAgent(tok), n=3, turns=4)
    assert tracer.flush(20)
    stats = tracer.stats()
    refs = stats["prompt_refs"]
    assert refs["sent"] > 0 and refs["resent_full"] == refs["sent"], refs
    assert stats["dropped_total"] == 0 and stats["rejected_by_collector"] == 0
    assert stats["sent"] == 3 * (1 + 1 + 4)
    expected = _expected_prompts(tok, 4)
    for trace_id in traces:
        gens = _generates(col.url, trace_id)
        assert [g["inputs"]["prompt_ids"] for g in gens] == expected
        assert all(g["output"]["prompt_text"] == tok.decode(g["inputs"]["prompt_ids"], skip_special_tokens=False) for g in gens)
    assert kit.metrics(col.url, "tracecar_prompt_refs_total", outcome="unresolved") == refs["sent"]


def _stored(col: Any, trace_id: str, whole: bool = True) -> dict[str, Any]:
    """The trajectory's stored spans by id, as every reader gets them (references rebuilt), or as stored."""
    spool = col.collector.pipeline.spool
    rows = spool.query("SELECT span_id, payload FROM spans WHERE trace_id = ?", [trace_id])
    payloads = [r["payload"] for r in rows]
    if whole:
        payloads = full_payloads(payloads, spool_loader(spool.query))
    return {r["span_id"]: orjson.loads(p) for r, p in zip(rows, payloads)}


def _span(kit: Any, trace: str, prompt: Any, output: Any = None, name: str = "generate") -> dict[str, Any]:
    return {"span_id": kit.new_id(), "trace_id": trace, "parent_id": trace, "name": name, "kind": "op",
            "start_time": 1.0, "end_time": 2.0, "attributes": {"step": 1}, "inputs": {"request_id": "r", "prompt_ids": prompt},
            "output": output, "exception": None}


def test_the_wire_format_over_http_refs_in_batch_across_batches_and_refused(start_collector, kit):
    col = start_collector()
    root = kit.new_id()
    first = _span(kit, root, list(range(100)), {"token_ids": [7] * 10})
    second = _span(kit, root, {"$ref": first["span_id"], "n": 110, "add": [1, 2, 3]})  # same batch
    unknown = _span(kit, root, {"$ref": "feedfacefeedface0000000000000001", "n": 5, "add": [9]})
    malformed = _span(kit, root, {"$ref": first["span_id"], "n": -1, "add": []})
    answer = kit.post(col.url, [first, second, unknown, malformed], v=2).json()
    assert answer["accepted"] == 2 and answer["wire_versions"] == [1, 2, 3]
    by_id = {r["span_id"]: r for r in answer["rejected"]}
    assert by_id[unknown["span_id"]]["field"] == "spans[2].inputs.prompt_ids"
    assert by_id[unknown["span_id"]]["reason"].startswith("unresolved prompt ref: span 'feedface")
    assert by_id[malformed["span_id"]]["reason"] == "malformed prompt reference: n must be a non-negative integer"
    third = _span(kit, root, {"$ref": second["span_id"], "n": 50, "add": [4]})  # a later batch, part of the context
    over = _span(kit, root, {"$ref": second["span_id"], "n": 114, "add": []})
    sliced = _span(kit, root, [1] * 40, {"prompt_ids": {"$ref": second["span_id"], "n": 100, "add": []},
                                         "response_ids": {"$ref": second["span_id"], "from": 100, "n": 113, "add": [8]}}, name="run")
    backwards = _span(kit, root, [1], {"response_ids": {"$ref": second["span_id"], "from": 9, "n": 3, "add": []}}, name="run")
    answer = kit.post(col.url, [third, over, sliced, backwards], v=2).json()
    assert answer["accepted"] == 2, answer
    reasons = {r["span_id"]: (r["field"], r["reason"]) for r in answer["rejected"]}
    assert reasons[over["span_id"]][1].startswith("unresolved prompt ref: n=114 exceeds the 113 ids")
    assert reasons[backwards["span_id"]] == ("spans[3].output.response_ids", "malformed prompt reference: from must be an integer from 0 to n")

    payloads = _stored(col, root)
    assert set(payloads) == {first["span_id"], second["span_id"], third["span_id"], sliced["span_id"]}
    raw = _stored(col, root, whole=False)  # the store keeps the references (spool.full_payloads rebuilds them)
    assert raw[sliced["span_id"]]["$refs"] == [["output", "prompt_ids"], ["output", "response_ids"]]
    assert raw[second["span_id"]]["inputs"]["prompt_ids"] == {"$ref": first["span_id"], "from": 0, "n": 110, "add": [1, 2, 3]}
    assert payloads[sliced["span_id"]]["output"] == {"prompt_ids": list(range(100)), "response_ids": [7] * 10 + [1, 2, 3, 8]}
    assert payloads[second["span_id"]]["inputs"]["prompt_ids"] == list(range(100)) + [7] * 10 + [1, 2, 3]
    assert payloads[third["span_id"]]["inputs"]["prompt_ids"] == list(range(50)) + [4]


def test_a_resend_with_other_ids_changes_no_later_rebuild(start_collector, kit):
    """A span resent with other ids is dropped as a duplicate; a later reference to it rebuilds
    from what the store holds (its context is not replaced), or is refused when it is gone."""
    col = start_collector()
    root = kit.new_id()
    base = _span(kit, root, [1, 2, 3])
    assert kit.post(col.url, [base], v=2).json()["accepted"] == 1
    same_batch = _span(kit, root, {"$ref": base["span_id"], "n": 3, "add": [9]})
    answer = kit.post(col.url, [dict(base, inputs={"request_id": "r", "prompt_ids": [7, 7, 7]}), same_batch], v=2).json()
    assert (answer["accepted"], answer["duplicates"]) == (1, 1), answer
    later = _span(kit, root, {"$ref": base["span_id"], "n": 3, "add": [8]})
    assert kit.post(col.url, [later], v=2).json()["accepted"] == 1
    stored = {sid: span["inputs"]["prompt_ids"] for sid, span in _stored(col, root).items()}
    assert stored == {base["span_id"]: [1, 2, 3], same_batch["span_id"]: [1, 2, 3, 9], later["span_id"]: [1, 2, 3, 8]}


def test_references_cannot_inflate_a_small_body_without_bound(start_collector, kit):
    """References rebuild at most TRACECAR_MAX_DECOMPRESSED_BYTES / 16 ids per batch; the rest is
    refused as unresolved (the client resends them whole, where the body bounds apply)."""
    col = start_collector(max_decompressed_bytes=512 * 1024)  # 32,768 ids per batch
    root = kit.new_id()
    base = _span(kit, root, list(range(10_000)))
    assert kit.post(col.url, [base], v=2).json()["accepted"] == 1
    many = [_span(kit, root, {"$ref": base["span_id"], "n": 10_000, "add": [i]}) for i in range(5)]
    answer = kit.post(col.url, many, v=2).json()
    assert answer["accepted"] == 3
    assert [r["span_id"] for r in answer["rejected"]] == [s["span_id"] for s in many[3:]]
    assert all(r["reason"].startswith("unresolved prompt ref: the references of this batch rebuild more than 32768 ids")
               for r in answer["rejected"])


def test_old_format_batches_are_stored_as_sent(start_collector, kit):
    """Version 1 (every existing client): lists are stored as they are, and a "$ref" is no reference."""
    col = start_collector()
    root = kit.new_id()
    full = _span(kit, root, list(range(300)))
    lookalike = _span(kit, root, {"$ref": full["span_id"], "n": 3, "add": []})
    answer = kit.post(col.url, [full, lookalike]).json()
    assert answer["accepted"] == 2 and answer["rejected"] == []
    payloads = _stored(col, root)
    assert payloads[full["span_id"]]["inputs"]["prompt_ids"] == list(range(300))
    assert payloads[lookalike["span_id"]]["inputs"]["prompt_ids"] == {"$ref": full["span_id"], "n": 3, "add": []}


def test_a_collector_without_v2_gets_full_lists(start_collector, tracer_to, monkeypatch, deepseek_tokenizer_path):
    """An older collector's answers list no wire_versions: the client never sends a reference to it."""
    from tracecar.collector.receivers import pipeline

    monkeypatch.setattr(pipeline, "WIRE_VERSIONS", (1,))
    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    col = start_collector()
    tracer = tracer_to(col.url)
    traces = _run_trajectories(GrowingAgent(tok), n=2, turns=4)
    assert tracer.flush(20)
    stats = tracer.stats()
    assert stats["prompt_refs"]["sent"] == 0 and stats["dropped_total"] == 0
    assert tracer.sender.deltas.remembered_ids == 0
    for trace_id in traces:
        assert [g["inputs"]["prompt_ids"] for g in _generates(col.url, trace_id)] == _expected_prompts(tok, 4)


def test_a_prompt_list_changed_in_place_after_its_span_is_never_referenced_past_what_was_sent():
    """The remembered context is the sent span's ids, not the caller's list: an agent loop that
    grows or refills its prompt list in place must not get a reference to ids the earlier span never
    carried (before the fix: ``{"$ref": "A", "n": 150}`` against A's 100 ids, or a reference that
    rebuilt the old prompt for a refilled list)."""
    deltas = PromptDeltas(max_requests=10, max_ids=10_000)
    deltas.set_enabled(True)

    def wire(sid: str, prompt: list[int]) -> dict[str, Any]:
        return {"span_id": sid, "trace_id": "t", "parent_id": "t", "name": "generate", "kind": "op",
                "inputs": {"prompt_ids": prompt}, "output": {"text": "no ids in the output"}}

    prompt = list(range(100))
    deltas.apply(wire("A", prompt))
    prompt.extend(range(1000, 1050))  # grown in place (list +=), then the next turn's call
    grown = wire("B", prompt)
    assert deltas.apply(grown)
    assert grown["inputs"]["prompt_ids"] == {"$ref": "A", "n": 100, "add": list(range(1000, 1050))}
    prompt[:] = list(range(500, 650))  # the same list refilled with another prompt of that length
    refilled = wire("C", prompt)
    assert deltas.apply(refilled) is False and refilled["inputs"]["prompt_ids"] == list(range(500, 650))


def test_client_memory_is_bounded_and_evictions_counted():
    deltas = PromptDeltas(max_requests=3, max_ids=1000)
    deltas.set_enabled(True)

    def wire(trace: str, request: str, prompt: list[int], sid: str) -> dict[str, Any]:
        return {"span_id": sid, "trace_id": trace, "parent_id": trace, "name": "generate", "kind": "op",
                "inputs": {"request_id": request, "prompt_ids": prompt}, "output": {"token_ids": [1] * 10}}

    for r in range(5):
        deltas.apply(wire("t", f"r{r}", list(range(100)), f"s{r}"))
    assert deltas.counts["evicted"] == 2 and deltas.remembered_ids == 3 * 110
    again = wire("t", "r4", list(range(100)) + [1] * 10 + [5, 6], "s5")
    assert deltas.apply(again)
    assert again["inputs"]["prompt_ids"] == {"$ref": "s4", "n": 110, "add": [5, 6]}
    evicted_before = deltas.counts["evicted"]
    deltas.apply(wire("t", "r9", list(range(995)), "s9"))  # 1,005 ids alone exceed max_ids: not kept at all
    assert deltas.remembered_ids <= 1000 and deltas.counts["evicted"] >= evicted_before
    root = {"span_id": "t", "trace_id": "t", "parent_id": None, "kind": "trajectory", "name": "agent_loop", "inputs": {}}
    deltas.apply(root)  # the trajectory is over: its memory goes
    assert deltas.remembered_ids == 0
    # a remembered request whose context then outgrows max_ids is forgotten whole: its root still goes out
    deltas.apply(wire("u", "big", list(range(100)), "u1"))
    deltas.apply(wire("u", "big", list(range(100)) + [1] * 10 + list(range(1200)), "u2"))
    u_root = {**root, "span_id": "u", "trace_id": "u"}
    assert deltas.apply(u_root) is False and deltas.remembered_ids == 0


def test_weave_receives_the_full_lists(start_collector, tracer_to, deepseek_tokenizer_path):
    """What Weave gets is what VERL would send: full prompt_ids per generate call, full agent loop output."""
    from tests.support.weave_stub import WeaveStub

    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    with WeaveStub() as stub:
        col = start_collector(backend="weave", wandb_api_key="k" * 40, wandb_entity="team", wandb_project="rl",
                              weave_server_url=stub.url, token2text=True, tokenizer=deepseek_tokenizer_path)
        tracer = tracer_to(col.url)
        traces = _run_trajectories(GrowingAgent(tok), n=2, turns=4)
        assert tracer.flush(20) and tracer.stats()["prompt_refs"]["sent"] >= 2 * 3
        for _ in range(300):  # at most 30 s
            if len(stub.completed_calls()) >= 2 * (1 + 4):
                break
            time.sleep(0.1)
        calls = stub.completed_calls()
    *expected, context = _expected_prompts(tok, 4, final=True)
    for trace_id in traces:
        family = [c for c in calls if c["attributes"]["tracecar"]["trace_id"] == trace_id]
        gens = sorted((c for c in family if "GrowingAgent.generate" in c["op_name"]), key=lambda c: c["started_at"])
        assert [g["inputs"]["prompt_ids"] for g in gens] == expected
        assert all(g["output"]["prompt_text"] == tok.decode(g["inputs"]["prompt_ids"], skip_special_tokens=False) for g in gens)
        [run] = [c for c in family if "GrowingAgent.run" in c["op_name"]]
        assert run["output"]["prompt_ids"] + run["output"]["response_ids"] == context
        assert run["output"]["response_text"] == tok.decode(run["output"]["response_ids"], skip_special_tokens=False)


def test_a_collector_restart_between_turns_loses_nothing(start_collector, tracer_to, deepseek_tokenizer_path, tmp_path):
    """The collector restarts mid-trajectory (same port, same spool): later turns refer to spans the
    new process never saw; they are refused by name, resent whole, and every turn is stored whole."""
    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    settings = {"token2text": True, "tokenizer": deepseek_tokenizer_path, "data_dir": tmp_path / "spool"}
    first = start_collector(**settings)
    tracer = tracer_to(first.url)
    port = int(first.url.rsplit(":", 1)[1])
    restarted: list[Any] = []

    def restart() -> None:
        assert tracer.flush(20)
        first.stop()
        restarted.append(start_collector(port=port, **settings))

    class RestartingAgent(GrowingAgent):
        @rollout_trace_op
        async def run(self, request_id: str, turns: int) -> dict[str, Any]:
            prompt_ids = self.tok.encode("<|im_start|>user question: " + "why step reward? " * 20).ids
            for turn in range(turns):
                if turn == 2 and request_id == "req-0":
                    await asyncio.to_thread(restart)
                elif turn == 2:
                    while not restarted:
                        await asyncio.sleep(0.01)
                out = await self.generate(request_id, prompt_ids, {"temperature": 1.0})
                prompt_ids += out["token_ids"]
                prompt_ids += self.tok.encode(f" tool said {turn} é naïve ").ids
            return {"num_turns": turns}

    traces = _run_trajectories(RestartingAgent(tok), n=2, turns=4)
    assert tracer.flush(20)
    stats = tracer.stats()
    assert stats["dropped_total"] == 0 and stats["sent"] == 2 * (1 + 1 + 4), stats
    assert stats["prompt_refs"]["resent_full"] >= 2, stats["prompt_refs"]  # turn 3 of each: its turn 2 went to the old process
    expected = _expected_prompts(tok, 4)
    [second] = restarted
    for trace_id in traces:
        gens = _generates(second.url, trace_id)
        assert [g["inputs"]["prompt_ids"] for g in gens] == expected
        assert all(g["output"]["prompt_text"] == tok.decode(g["inputs"]["prompt_ids"], skip_special_tokens=False) for g in gens)


@pytest.mark.parametrize("token, workers", [(None, 1), ("s3cret-" + "t0ken" * 4, 1), (None, 2)],
                         ids=["no-token", "token", "workers-2"])
def test_a_resend_with_other_ids_changes_no_later_prompt_text(collector_process, kit, deepseek_tokenizer_path, token, workers):
    """Issue 28, item 2: a resent span with other prompt_ids (a duplicate) is decoded but its texts
    are not kept for later references: the stored span decides what a later reference rebuilds,
    its ids and its text. Before, the resend's forged text became the start of Y's prompt_text."""
    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    col = collector_process(token2text=True, tokenizer=deepseek_tokenizer_path, workers=workers, token=token,
                            log_level="warning").start()
    if workers > 1:  # batches go in-process until the pool is warm
        kit.wait_for(lambda: kit.metrics(col.url, "tracecar_workers") >= workers, 90)
    auth = {"token": token} if token else {}
    real, forged, added = (tok.encode(text).ids for text in (
        "The real prompt the worker sent first,", "FORGED words of another prompt entirely!", " and the next turn."))
    root = kit.new_id()
    x = _span(kit, root, real, {"response_ids": []})
    assert kit.post(col.url, [x], v=2, **auth).json()["accepted"] == 1
    # the forged list ends as the real one does, so its text passes the join check that reuses it
    resend = dict(x, inputs={"request_id": "r", "prompt_ids": forged + real})
    answer = kit.post(col.url, [resend], v=2, **auth).json()
    assert (answer["accepted"], answer["duplicates"]) == (0, 1), answer
    y = _span(kit, root, {"$ref": x["span_id"], "n": len(real), "add": added}, {"response_ids": []})
    assert kit.post(col.url, [y], v=2, **auth).json()["accepted"] == 1
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    tree = httpx.get(f"{col.url}/v1/trajectories/{root}", headers=headers, timeout=30).json()
    spans = {s["span_id"]: s for s in _walk(tree)}
    stored_y = spans[y["span_id"]]
    print(f"\nY prompt_text ({token is not None=}, {workers=}): {stored_y['output'].get('prompt_text')!r}")
    assert stored_y["inputs"]["prompt_ids"] == real + added
    assert stored_y["output"]["prompt_text"] == tok.decode(real + added, skip_special_tokens=False)
    assert spans[x["span_id"]]["inputs"]["prompt_ids"] == real


def _walk(node: Any) -> list[dict[str, Any]]:
    """Every span of a served trajectory tree, however it nests them."""
    out: list[dict[str, Any]] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "span_id" in item and "inputs" in item:
                out.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return out


def test_a_reference_resolves_only_within_its_worker_and_its_trajectory(start_collector, kit):
    """Issue 28, item 10: a worker name is no credential (any token holder may send any), so a
    reference's scope is a guard, not a secret: it rebuilds only from the sender's own worker and
    its own trajectory; naming another's span is refused by name and rebuilds nothing."""
    col = start_collector()
    mine, other = kit.new_id(), kit.new_id()
    base = _span(kit, mine, list(range(100, 200)))
    assert kit.post(col.url, [base], v=2, worker="w-a").json()["accepted"] == 1
    ref = {"$ref": base["span_id"], "n": 100, "add": [7]}
    cross_trajectory = _span(kit, other, dict(ref))
    cross_worker = _span(kit, mine, dict(ref))
    same = _span(kit, mine, dict(ref))
    a = kit.post(col.url, [cross_trajectory], v=2, worker="w-a").json()
    b = kit.post(col.url, [cross_worker], v=2, worker="w-b").json()
    c = kit.post(col.url, [same], v=2, worker="w-a").json()
    assert a["accepted"] == 0 and a["rejected"][0]["field"] == "spans[0].inputs.prompt_ids"
    assert "belongs to another trajectory" in a["rejected"][0]["reason"], a
    assert b["accepted"] == 0 and "not known to this collector" in b["rejected"][0]["reason"], b
    assert c["accepted"] == 1 and not c["rejected"], c
    stored = _stored(col, same["trace_id"])[same["span_id"]]
    assert stored["inputs"]["prompt_ids"] == list(range(100, 200)) + [7]
