"""Training truth (issue 29): drift between turns and why this reward, where a user looks.

Agent loops over a real byte-level BPE tokenizer plant the failures (tests/truth_kit.py): a chat
template that re-renders an earlier turn differently, a tokenizer round trip that changes ids.
A real collector (uvicorn on 127.0.0.1) must report each in the API, the CLI, per-step health
and the trainer's W&B run (offline), and nothing on a clean run. The browser side is in
tests/test_viewer_truth.py; VERL's own trainer functions in tests/test_truth_verl.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import orjson
import pytest
from tokenizers import Tokenizer

from tests.test_health import _wandb_history, offline_wandb  # noqa: F401 - the fixture
from tests.test_viewer import get
from tests.truth_kit import THINK, Loop, trajectory
from tracecar.client import annotate, log_health
from tracecar.client.cli import main as cli_main
from tracecar.collector.processors.drift import compare, first_difference

pytestmark = pytest.mark.timeout(240)

EXPERIMENT = "truth"
# sample 0's four rollouts: (loop, acc, format); reward = acc + 0.1 * format
SAMPLE0 = [("token_in_token_out", 1, 1.0), ("token_in_token_out", 1, 0.5), ("rerender_template", 0, 1.0), ("retokenize", 0, 0.5)]


def naive_first_difference(a: list[int], b: list[int]) -> int:
    i = 0
    while i < len(a) and i < len(b) and a[i] == b[i]:
        i += 1
    return i


def truth_run(start_collector: Any, tracer_to: Any, tokenizer_path: str, plant: bool = True,
              prompt_delta: bool = True) -> tuple[Any, dict[str, Any]]:
    """Step 1: sample 0 (4 rollouts; with ``plant`` two of them drift) scored through VERL's
    reward_extra_info shape, sample 1 (4 clean rollouts) scored by a worker's annotate(acc=, format=)."""
    col = start_collector(token2text=True, tokenizer=tokenizer_path)
    tracer = tracer_to(col.url, experiment=EXPERIMENT, prompt_delta=prompt_delta)
    tok = Tokenizer.from_file(tokenizer_path)
    made: dict[str, Any] = {"loops": {}, "ids": {}, "tracer": tracer}

    async def run() -> None:
        for n, (mode, acc, fmt) in enumerate(SAMPLE0):
            loop = Loop(tok, mode if plant else "token_in_token_out")
            trace_id = await trajectory(loop, 1, 0, n, EXPERIMENT)
            made["loops"][trace_id], made["ids"][(0, n)] = loop, trace_id
            assert tracer.flush(30)  # answered: the sender now knows the collector reads prompt deltas
            annotate(trace_id, reward=acc + 0.1 * fmt, ground_truth="42",
                     reward_extra_info={"acc": acc, "format": fmt, "pred": "42" if acc else "41"})
        for n in range(4):
            loop = Loop(tok)
            trace_id = await trajectory(loop, 1, 1, n, EXPERIMENT)
            made["loops"][trace_id], made["ids"][(1, n)] = loop, trace_id
            annotate(trace_id, reward=float(n % 2), acc=n % 2, format=1.0)

    asyncio.run(run())
    assert tracer.flush(30)
    return col, made


def test_compare_locates_the_cut_and_counts_what_differs():
    context = list(range(100))
    assert compare(context, context + [7, 8]).extends
    dropped = context[:40] + context[50:] + [7, 8]  # 10 ids of the context left out (a template dropped a block)
    d = compare(context, dropped)
    assert not d.extends and d.at == 40 and d.differing == 10 and d.inserted == 0
    assert d.before == context[32:40] and d.was == context[40:56] and d.now == dropped[40:56]
    merged = context[:60] + [999] + context[62:]  # two ids re-split as one (a round trip through text)
    d = compare(context, merged)
    assert (d.at, d.differing, d.inserted) == (60, 2, 1)
    for a, b in ((context, dropped), (context, merged), ([1, 2], [1, 2, 3]), ([], [5]), (context, context[:10])):
        assert first_difference(a, b) == naive_first_difference(a, b)


def test_drift_and_reward_parts_reach_the_api_cli_health_groups_and_export(start_collector, tracer_to, deepseek_tokenizer_path,
                                                                         capsys, offline_wandb):  # noqa: F811
    col, made = truth_run(start_collector, tracer_to, deepseek_tokenizer_path)
    assert made["tracer"].stats()["prompt_refs"]["sent"] >= 5  # clean turns 2 went out as prompt deltas (wire v2)
    rerender, retoken = made["ids"][(0, 2)], made["ids"][(0, 3)]
    clean = {t for t in made["loops"] if t not in (rerender, retoken)}

    # the list: drift filter and counts per row
    drifted = get(col, "/v1/trajectories", drift="true", limit=100)["trajectories"]
    assert {t["trace_id"] for t in drifted} == {rerender, retoken}
    assert all(t["drift_turns"] == 1 and t["drift_checked"] == 1 for t in drifted)
    assert {t["trace_id"] for t in get(col, "/v1/trajectories", drift="false", limit=100)["trajectories"]} == clean
    assert get(col, "/ui/api/trajectories", drift="true")["total"] == 2  # the viewer's list takes the same filter

    # one trajectory: where turn 2's prompt parts from turn 1's prompt + response, and the text on both sides
    for trace_id in (rerender, retoken):
        loop = made["loops"][trace_id]
        context, prompt = loop.prompts[0] + loop.responses[0], loop.prompts[1]
        answer = get(col, f"/v1/trajectories/{trace_id}/truth")
        [turn] = answer["turns"]
        assert turn["turn"] == 2 and turn["extends"] is False
        assert turn["at"] == naive_first_difference(context, prompt) < len(context)
        assert turn["was"] == context[turn["at"]:turn["at"] + 16] and turn["now"] == prompt[turn["at"]:turn["at"] + 16]
        assert turn["before_text"] == loop.decode(context[max(0, turn["at"] - 8):turn["at"]])
        assert turn["was_text"] == loop.decode(turn["was"]) and turn["now_text"] == loop.decode(turn["now"])
    think = get(col, f"/v1/trajectories/{rerender}/truth")["turns"][0]
    assert think["was_text"].startswith("<think>") and "<think>" not in think["now_text"]  # the template dropped it
    assert think["differing"] >= len(Loop(Tokenizer.from_file(deepseek_tokenizer_path)).encode(THINK)) - 2
    round_trip = get(col, f"/v1/trajectories/{retoken}/truth")["turns"][0]
    assert round_trip["was"] != round_trip["now"]
    assert round_trip["was_text"].startswith("calculator") and round_trip["now_text"].startswith("calculator")  # same text
    for trace_id in clean:
        answer = get(col, f"/v1/trajectories/{trace_id}/truth")
        assert answer["drift_turns"] == 0 and [t["extends"] for t in answer["turns"]] == [True]

    # why this reward: components (trainer's reward_extra_info, and a worker's annotate) and the ground truth
    sample0 = get(col, f"/v1/trajectories/{rerender}/truth")
    assert sample0["reward_components"] == {"acc": 0.0, "format": 1.0, "pred": "41"} and sample0["ground_truth"] == "42"
    assert get(col, f"/v1/trajectories/{made['ids'][(1, 1)]}/truth")["reward_components"] == {"acc": 1.0, "format": 1.0}
    acc0 = {t["trace_id"] for t in get(col, "/v1/trajectories", where="acc=0", limit=100)["trajectories"]}
    assert acc0 == {made["ids"][k] for k in ((0, 2), (0, 3), (1, 0), (1, 2))}
    assert {t["trace_id"] for t in get(col, "/v1/trajectories", where="acc=0, format<1", limit=100)["trajectories"]} == {retoken}
    bad = httpx.get(col.url + "/v1/trajectories", params={"where": "acc=zero"}, timeout=10)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "where" and "'zero'" in bad.json()["error"]["reason"]

    # groups: which component separates a group's best from its worst
    groups = {g["sample_index"]: g for g in get(col, "/v1/groups", step=1, experiment=EXPERIMENT)["groups"]}
    top = groups[0]["separation"]["components"][0]
    assert (top["key"], top["best"], top["worst"]) == ("acc", 1.0, 0.0)
    assert groups[1]["separation"]["components"][0]["key"] == "acc" and all(
        c["key"] != "format" for c in groups[1]["separation"]["components"])  # format is 1 everywhere: separates nothing

    # groups filtered by a rollout's truth, kept whole
    drifting = get(col, "/v1/groups", step=1, experiment=EXPERIMENT, drift="true")["groups"]
    assert [g["sample_index"] for g in drifting] == [0] and len(drifting[0]["rollouts"]) == 4
    assert [g["sample_index"] for g in get(col, "/v1/groups", step=1, experiment=EXPERIMENT, where="acc=0")["groups"]] == [0, 1]

    # per-step health (API and CLI), and the export
    step = get(col, "/v1/health", step=1)["step"]
    assert step["drift"] == {"multi_turn": 8, "with_drift": 2, "share": 0.25, "turns_compared": 8, "turns_drifted": 2}
    rows = [orjson.loads(line) for line in httpx.get(col.url + "/v1/export", params={"experiment": EXPERIMENT, "drift": "true"},
                                                       timeout=30).content.splitlines()]
    assert {r["trace_id"] for r in rows} == {rerender, retoken}
    by_id = {r["trace_id"]: r for r in rows}
    assert json.loads(by_id[rerender]["reward_components"]) == {"acc": 0.0, "format": 1.0, "pred": "41"}
    assert by_id[rerender]["ground_truth"] == "42" and by_id[rerender]["drift_turns"] == 1

    capsys.readouterr()
    cli_main(["truth", rerender, "--url", col.url])
    out = capsys.readouterr().out
    assert "drift: 1 of 1 turns do not extend the turn before" in out and f"DRIFT at token {think['at']}" in out
    assert '"<think>' in out and "acc=0.0" in out and "ground truth: 42" in out
    cli_main(["trajectories", "--url", col.url, "--drift", "true"])
    out = capsys.readouterr().out
    assert out.startswith("2 trajectories") and out.count("drift 1/1") == 2
    cli_main(["health", "--url", col.url, "--step", "1"])
    assert "turn drift             2 of 8 multi-turn trajectories (25.0%)" in capsys.readouterr().out

    # the trainer's W&B run (offline): tracecar/step/* at the step
    run_dir = _log_and_read(offline_wandb, 1)
    assert run_dir[1]["tracecar/step/drift_trajectories"] == 2 and run_dir[1]["tracecar/step/drift_share"] == 0.25


def _log_and_read(run: Any, step: int) -> dict[int, dict[str, Any]]:
    from pathlib import Path

    import wandb

    logged = log_health(step)
    assert logged is not None
    run_dir = Path(run.dir).parent
    wandb.finish()
    return _wandb_history(run_dir)


def test_full_list_clients_and_prompt_delta_clients_report_the_same_drift(start_collector, tracer_to, deepseek_tokenizer_path):
    """An old client (every prompt_ids in full) and a wire-v2 one (a prompt that extends the previous
    turn goes out as a reference, a drifting one in full): the same turns drift, at the same token."""
    col, made = truth_run(start_collector, tracer_to, deepseek_tokenizer_path, prompt_delta=False)
    assert made["tracer"].stats().get("prompt_refs", {}).get("sent", 0) == 0  # nothing sent as a reference
    full = {(t["sample_index"], t["rollout_n"]): t["drift_turns"] for t in get(col, "/v1/trajectories", limit=100)["trajectories"]}
    assert full == {(0, 0): 0, (0, 1): 0, (0, 2): 1, (0, 3): 1, **{(1, n): 0 for n in range(4)}}
    cut = get(col, f"/v1/trajectories/{made['ids'][(0, 2)]}/truth")["turns"][0]
    loop = made["loops"][made["ids"][(0, 2)]]
    assert cut["at"] == naive_first_difference(loop.prompts[0] + loop.responses[0], loop.prompts[1])


def test_a_clean_run_reports_no_drift_anywhere(start_collector, tracer_to, deepseek_tokenizer_path, offline_wandb):  # noqa: F811
    col, made = truth_run(start_collector, tracer_to, deepseek_tokenizer_path, plant=False)
    assert get(col, "/v1/trajectories", drift="true")["total"] == 0
    assert get(col, "/v1/trajectories", drift="false")["total"] == 8
    assert get(col, "/v1/health", step=1)["step"]["drift"]["with_drift"] == 0
    assert all(t["extends"] for trace_id in made["loops"] for t in get(col, f"/v1/trajectories/{trace_id}/truth")["turns"])
    rows = _log_and_read(offline_wandb, 1)
    assert rows[1]["tracecar/step/drift_trajectories"] == 0 and rows[1]["tracecar/step/multi_turn"] == 8


def test_truth_meets_at_the_gateway_when_rollouts_and_the_trainer_use_different_nodes(tracer_to, deepseek_tokenizer_path,
                                                                                    tmp_path):
    """Multi-node: the rollouts go to node 0, the trainer's annotations and batch rows to node 1; the
    gateway, where both meet, reports the drift, the reward's parts and the trainer comparison."""
    from tests.support.cluster import start_cluster, wait_until
    from tests.test_viewer_truth import trainer_row
    from tests.truth_kit import agent_output, generated_positions
    from tracecar.client.integrations import verl_tokens

    decode = {"token2text": True, "tokenizer": deepseek_tokenizer_path}
    # the gateway never decodes spans again; its tokenizer only decodes the ids on both sides of a drift's cut on read
    cluster = start_cluster(tmp_path, 2, node=decode, gateway={"tokenizer": deepseek_tokenizer_path})
    try:
        tok = Tokenizer.from_file(deepseek_tokenizer_path)
        tracer = tracer_to(cluster.nodes[0].url, experiment=EXPERIMENT)
        loops: dict[str, Loop] = {}

        async def rollouts() -> None:
            for n, mode in enumerate(("token_in_token_out", "rerender_template")):
                loop = Loop(tok, mode)
                loops[await trajectory(loop, 1, 0, n, EXPERIMENT)] = loop

        asyncio.run(rollouts())
        assert tracer.flush(30)
        tracer = tracer_to(cluster.nodes[1].url, experiment=EXPERIMENT)  # the trainer process, on another node
        for trace_id, loop in loops.items():
            prompt, response, mask = agent_output(loop)
            old = [0.0] * len(response)
            for j, lp in generated_positions(loop):
                old[j] = lp + 0.3
            annotate(trace_id, reward=1.0, trained=True, fate="trained", reward_extra_info={"acc": 1, "format": 0.5})
            verl_tokens.send(trace_id, trainer_row(prompt, response, mask, old))
        assert tracer.flush(30)
        cluster.wait_drained()
        gw = cluster.gateway.url
        wait_until(lambda: httpx.get(gw + "/v1/trajectories", params={"drift": "true"}).json()["total"] == 1, 60,
                   "the drifting trajectory at the gateway")
        clean, drifted = list(loops)
        truth = httpx.get(f"{gw}/v1/trajectories/{drifted}/truth", timeout=30).json()
        assert truth["turns"][0]["extends"] is False and truth["turns"][0]["was_text"].startswith("<think>")
        assert truth["reward_components"] == {"acc": 1.0, "format": 0.5} and truth["summary"]["fate"] == "trained"
        assert truth["trainer"]["tt_absent"] > 0 and truth["trainer"]["tt_mismatch"] is True
        other = httpx.get(f"{gw}/v1/trajectories/{clean}/truth", timeout=30).json()["trainer"]
        assert other["tt_mismatch"] is False and abs(other["lp_max"] - 0.3) < 1e-5  # the engine's logprobs came along
    finally:
        cluster.stop()


def test_each_fate_filter_lists_exactly_the_rows_showing_that_fate(start_collector, tracer_to, deepseek_tokenizer_path):
    col, made = truth_run(start_collector, tracer_to, deepseek_tokenizer_path)
    notes = [{"trained": True}, {"trained": False, "filtered_by": "overlong"}, {"fate": "filtered", "fate_reason": "dapo"},
             {"fate": "evicted", "fate_reason": "stale"}, {"trained": True, "fate": "evicted", "fate_reason": "failure"},
             {"fate": "trained"}, {}, {"refill_of": "g0"}]
    for trace_id, note in zip(made["ids"].values(), notes):
        if note:
            annotate(trace_id, **note)
    assert made["tracer"].flush(30)
    rows = get(col, "/v1/trajectories", limit=100)["trajectories"]
    shown = {t["trace_id"]: t["fate"] for t in rows}
    assert sorted(shown.values()) == sorted(["trained", "filtered", "filtered", "evicted", "evicted", "trained",
                                             "not_reached", "not_reached"])
    for fate in ("trained", "filtered", "evicted", "not_reached"):
        listed = {t["trace_id"] for t in get(col, "/v1/trajectories", fate=fate, limit=100)["trajectories"]}
        assert listed == {t for t, f in shown.items() if f == fate}, fate
    assert get(col, "/v1/health", step=1)["step"]["fates"]["not_reached"] == 2
