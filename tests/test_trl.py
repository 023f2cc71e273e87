"""TRL: the real ``GRPOTrainer`` runs two steps on CPU with a tiny randomly initialised Llama (built
from a config: nothing downloaded), a tokenizer trained here, an in-memory dataset and two reward
functions; tracecar's callback sends each scored completion to a real collector, read back through
the viewer API (/v1/trajectories, /v1/groups, the tree and token view) and the JSONL export.

Needs ``trl`` (and torch): ``TRACECAR_TEST_VERL=1 bash tests/run.sh`` runs it in ./.venv-verl; in the
main venv it skips with one line.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

trl = pytest.importorskip("trl", reason="trl is not installed here: TRACECAR_TEST_VERL=1 bash tests/run.sh runs the TRL test "
                                         "in ./.venv-verl")

pytestmark = pytest.mark.timeout(600)

WORDS = ["two", "plus", "four", "equals", "reward", "answer", "step", "rollout", "tool", "sum", "ok", "no"]
PROMPTS = ["two plus two equals", "the answer is", "step by step the sum", "rollout reward of four"]
EXPERIMENT = "trl-grpo-test"


def tiny_tokenizer(directory: Path) -> Any:
    """A byte-level BPE trained on generated text, wrapped for transformers; its tokenizer.json is
    what the collector decodes with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(3)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(500)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(directory / "tokenizer.json"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_model(tokenizer: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return AutoModelForCausalLM.from_config(config)


def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [min(len(c), 40) / 40 for c in completions]


def says_four(completions: list[str], **kwargs: Any) -> list[float | None]:
    return [None if i % 4 == 3 else (1.0 if "four" in c else 0.0) for i, c in enumerate(completions)]  # None: not scored


def wait_for(what: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s")
        time.sleep(0.1)


def test_grpo_trainer_completions_are_trajectories_with_rewards_advantages_and_groups(start_collector, tracer_to, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tracecar.client.integrations.trl import TracecarCallback

    tokenizer = tiny_tokenizer(tmp_path)
    collector = start_collector(tokenizer=str(tmp_path / "tokenizer.json"), token2text=True)
    tracer_to(collector.url, experiment=EXPERIMENT)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                      max_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                      bf16=False, seed=0, reward_weights=[1.0, 2.0], dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=tiny_model(tokenizer), reward_funcs=[length_reward, says_four], args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), processing_class=tokenizer)
    callback = TracecarCallback(trainer)
    trainer.add_callback(callback)
    completions: list[dict[str, Any]] = []
    score = trainer._generate_and_score_completions  # what TRL itself computed, to compare with what arrives

    def keep(inputs: Any) -> Any:
        output = score(inputs)
        n = len(inputs)
        completions.extend({"prompt": p, "completion": c, "length": rl, "four": sf, "advantage": a} for p, c, rl, sf, a in zip(
            list(trainer._logs["prompt"])[-n:], list(trainer._logs["completion"])[-n:],
            list(trainer._logs["rewards"]["length_reward"])[-n:], list(trainer._logs["rewards"]["says_four"])[-n:],
            list(trainer._logs["advantages"])[-n:]))
        return output

    trainer._generate_and_score_completions = keep
    trainer.train()
    assert trainer.state.global_step == 2 and callback.sent == 16 and callback.failures == 0 and callback.groups_seen == 4

    rows = wait_for(lambda: (r := httpx.get(collector.url + "/v1/trajectories", params={"experiment": EXPERIMENT, "limit": 100},
                                            timeout=10).json()["trajectories"]) and len(r) == 16 and r)
    assert sorted({(r["step"], r["sample_index"]) for r in rows}) == [(0, 0), (0, 1), (1, 2), (1, 3)]  # 2 groups a step
    assert sorted(r["rollout_n"] for r in rows) == sorted([0, 1, 2, 3] * 4) and {r["name"] for r in rows} == {"grpo_rollout"}
    assert all(r["policy_version"] == r["step"] and r["turns"] == 1 and r["validate"] is False for r in rows)

    by_place = {(r["sample_index"], r["rollout_n"]): r for r in rows}
    for i, expected in enumerate(completions):  # TRL's own numbers, completion by completion
        row = by_place[(i // 4, i % 4)]
        four = None if math.isnan(expected["four"]) else expected["four"]
        assert row["reward"] == pytest.approx(expected["length"] + 2.0 * (four or 0.0))
        assert row["advantage"] == pytest.approx(expected["advantage"], abs=1e-6)
        tree = httpx.get(f"{collector.url}/v1/trajectories/{row['trace_id']}", timeout=10).json()
        [call] = tree["root"]["children"]
        assert call["name"] == "generate" and call["inputs"]["prompt"] == expected["prompt"]
        assert call["output"]["completion"] == expected["completion"]
        ids = call["output"]["response_ids"]
        assert call["output"]["response_text"] == tokenizer.decode(ids, skip_special_tokens=False)  # decoded by the collector
        assert call["output"]["prompt_text"] == tokenizer.decode(call["inputs"]["prompt_ids"], skip_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=True) == expected["completion"]
        [note] = tree["annotations"]
        assert note["attributes"]["rewards/length_reward"] == pytest.approx(expected["length"])
        assert note["attributes"].get("rewards/says_four") == four  # an unscored completion: no value, not NaN

    groups = httpx.get(collector.url + "/v1/groups", params={"step": 1, "experiment": EXPERIMENT}, timeout=10).json()
    assert [g["sample_index"] for g in groups["groups"]] == [2, 3] and all(g["n"] == 4 for g in groups["groups"])
    for group in groups["groups"]:
        members = [c for i, c in enumerate(completions) if i // 4 == group["sample_index"]]
        assert group["mean"] == pytest.approx(sum(by_place[(group["sample_index"], n)]["reward"] for n in range(4)) / 4)
        assert {r["rollout_n"] for r in group["rollouts"]} == {0, 1, 2, 3} and len(members) == 4

    export = httpx.get(collector.url + "/v1/export", params={"format": "jsonl", "experiment": EXPERIMENT, "token_ids": "true"},
                       timeout=30)
    exported = [json.loads(line) for line in export.text.splitlines()]
    assert len(exported) == 16 and all(e["response_ids"] and e["prompt_ids"] for e in exported)
    assert {e["advantage"] is not None for e in exported} == {True}


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def test_conversational_prompts_arrive_as_messages(start_collector, tracer_to, tmp_path):
    """A conversational dataset (prompts as chat messages, the tokenizer's chat template): the prompt
    is the span's ``messages`` (what the export's ``messages`` start with), the completion a message."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tracecar.client.integrations.trl import TracecarCallback

    tokenizer = tiny_tokenizer(tmp_path)
    tokenizer.chat_template = CHAT_TEMPLATE
    collector = start_collector()
    tracer_to(collector.url, experiment="trl-chat")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
                      max_steps=1, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=1,
                      dataloader_num_workers=0, disable_tqdm=True)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    trainer = GRPOTrainer(model=tiny_model(tokenizer), reward_funcs=[length_reward], args=args,
                          train_dataset=Dataset.from_dict({"prompt": chats}), processing_class=tokenizer)
    callback = TracecarCallback(trainer)
    trainer.add_callback(callback)
    trainer.train()
    assert callback.sent == 4 and callback.failures == 0
    rows = wait_for(lambda: (r := httpx.get(collector.url + "/v1/trajectories", params={"experiment": "trl-chat"},
                                            timeout=10).json()["trajectories"]) and len(r) == 4 and r)
    for row in rows:
        tree = httpx.get(f"{collector.url}/v1/trajectories/{row['trace_id']}", timeout=10).json()
        [call] = tree["root"]["children"]
        assert call["inputs"]["messages"] in chats
        [message] = call["output"]["completion"]
        assert message["role"] == "assistant" and call["output"]["response_text"] == message["content"]
        assert tokenizer.decode(call["output"]["response_ids"], skip_special_tokens=True) == message["content"]
        assert row["reward"] == pytest.approx(length_reward([call["output"]["completion"]])[0])  # TRL passes the messages
    export = httpx.get(collector.url + "/v1/export", params={"format": "jsonl", "experiment": "trl-chat"}, timeout=30)
    assert all(json.loads(line)["messages"][0]["role"] == "user" for line in export.text.splitlines())


def test_a_trainer_that_is_not_trls_grpo_trainer_is_refused_in_one_line():
    from tracecar.client.integrations.trl import TracecarCallback

    with pytest.raises(TypeError, match="needs TRL's GRPOTrainer .* has no _generate, _generate_and_score_completions, _logs"):
        TracecarCallback(object())
