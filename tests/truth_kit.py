"""Agent loops that plant the failures issue 29 asks tracecar to find (shared by tests/test_truth*.py).

Each loop is traced like VERL's ToolAgentLoop (``rollout_trace_attr`` around the trajectory,
``generate`` as a ``rollout_trace_op`` with ``prompt_ids`` in and ``token_ids`` out), with a real
byte-level BPE tokenizer, but builds each turn's prompt differently:

* ``token_in_token_out``: VERL's way: the next prompt is the previous prompt + the generated ids +
  the tool response's ids. Never drifts.
* ``rerender_template``: renders the whole conversation with a chat template each turn; the
  template (as Qwen3's does) drops an earlier assistant turn's ``<think>`` block, so turn 2's
  prompt does not contain what turn 1 generated.
* ``letters``: token in, token out, but the sampler spelled a word letter by letter (valid ids
  that a tokenizer round trip merges: what a trainer re-tokenizing the text would not reproduce).
* ``retokenize``: decodes the conversation to text and encodes it again each turn; the model
  generated a non-canonical split of a word (``"forty"`` as single letters), which the round
  trip merges, so the ids change though the text does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jinja2

from tracecar.client import rollout_trace_attr, rollout_trace_op

# Qwen3's chat template keeps an earlier assistant turn's answer but not its reasoning
TEMPLATE = jinja2.Template(
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")

THINK = "<think>The user wants a sum; I will call the calculator.</think>"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "19+23"}}</tool_call>'
ANSWER = "The answer is forty-two."


@dataclass
class TokenOutput:
    token_ids: list[int]
    log_probs: list[float] | None = None
    stop_reason: str = "stop"


@dataclass
class Loop:
    """One agent loop over a real tokenizer (``tokenizers.Tokenizer``)."""

    tokenizer: Any
    mode: str = "token_in_token_out"
    prompts: list[list[int]] = field(default_factory=list)
    responses: list[list[int]] = field(default_factory=list)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def letters(self, text: str) -> list[int]:
        """A non-canonical tokenisation: one token per character (what a sampler may well produce)."""
        return [i for ch in text for i in self.encode(ch)]

    @rollout_trace_op
    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
        ids = list(sampling_params["_ids"])
        self.prompts.append(list(prompt_ids))
        self.responses.append(ids)
        return TokenOutput(ids, [-0.05 - 0.01 * (i % 7) for i in range(len(ids))])

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return {"result": 42}

    async def run(self, request_id: str) -> None:
        """Two turns: (a thought and) a tool call, the tool's answer, then the final answer."""
        messages = [{"role": "user", "content": "What is 19 + 23?"}]
        prompt = self.encode(TEMPLATE.render(messages=messages))
        first = THINK + CALL if self.mode == "rerender_template" else CALL
        if self.mode in ("retokenize", "letters"):  # the sampler spelled "calculator" letter by letter: valid ids, not the canonical ones
            head, tail = first.split("calculator", 1)
            ids = self.encode(head) + self.letters("calculator") + self.encode(tail + "<|im_end|>")
        else:
            ids = self.encode(first + "<|im_end|>")
        out = await self.generate(request_id, prompt, {"_ids": ids})
        await self.execute(request_id, {"expression": "19+23"})
        messages += [{"role": "assistant", "content": first}, {"role": "tool", "content": "<tool_response>42</tool_response>"}]
        tool = "\n<|im_start|>tool\n<tool_response>42</tool_response><|im_end|>\n<|im_start|>assistant\n"
        if self.mode == "rerender_template":
            prompt = self.encode(TEMPLATE.render(messages=messages))
        elif self.mode == "retokenize":
            prompt = self.encode(self.decode(prompt + out.token_ids) + tool)
        else:
            prompt = prompt + out.token_ids + self.encode(tool)
        await self.generate(request_id, prompt, {"_ids": self.encode(ANSWER + "<|im_end|>")})


async def trajectory(loop: Loop, step: int, sample_index: int, rollout_n: int, experiment: str | None = None) -> str:
    """One traced trajectory; returns its trace id."""
    attrs: dict[str, Any] = {"step": step, "sample_index": sample_index, "rollout_n": rollout_n, "name": "agent_loop"}
    if experiment is not None:
        attrs["experiment_name"] = experiment
    with rollout_trace_attr(**attrs) as record:
        await loop.run(f"s{step}-i{sample_index}-n{rollout_n}")
    assert record is not None
    return str(record.span_id)


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


def generated_positions(loop: Loop) -> list[tuple[int, float]]:
    """(response position, engine logprob) of each generated token in agent_output's layout (TITO loops)."""
    first, last = loop.prompts[0], loop.prompts[-1]
    lps = [[-0.05 - 0.01 * (i % 7) for i in range(len(r))] for r in loop.responses]  # truth_kit's engine logprobs
    out = [(j, lps[0][j]) for j in range(len(loop.responses[0]))]
    base = len(last) - len(first)
    out += [(base + j, lps[-1][j]) for j in range(len(loop.responses[-1]))]
    return out
