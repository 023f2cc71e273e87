"""`tracecar show` reads like a page, not a Python repr (issue 31, item 8): the root's attributes one per
line, RL keys first; texts cut at --max-chars (the cut said), or whole with --full, line breaks kept."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

from tracecar.client import annotate, rollout_trace_attr, rollout_trace_op

pytestmark = pytest.mark.timeout(120)

ANSWER = "Step 1: 7 * 7 = 49.\nStep 2: 49 * 7 = 343.\n" + "Checking the product once more, digit by digit. " * 8 + "\n#### 343"


def show(url: str, trace_id: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracecar.client.cli", "show", "--url", url, trace_id, *flags],
                          capture_output=True, text=True, timeout=60)


def test_show_prints_attributes_one_per_line_and_texts_cut_or_full(start_collector, tracer_to, deepseek_tokenizer_path) -> None:
    col = start_collector(token2text=True, tokenizer=deepseek_tokenizer_path)
    tracer = tracer_to(col.url, experiment="show-exp")
    codec = Tokenizer.from_file(deepseek_tokenizer_path)

    @rollout_trace_op
    async def generate(prompt_ids: list[int]) -> dict[str, object]:
        return {"response_ids": codec.encode(ANSWER).ids}

    async def run() -> str:
        with rollout_trace_attr(sample_index=3, step=1, rollout_n=2, name="agent_loop") as traj:
            await generate(codec.encode("What is 7 cubed?").ids)
        annotate(traj, reward=1.0)
        return traj.span_id

    trace_id = asyncio.run(run())
    assert tracer.flush(20)

    done = show(col.url, trace_id)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"trajectory {trace_id} (2 spans)"  # the root and generate; the reward is an annotation
    assert lines[1:6] == ["  experiment_name: show-exp", "  step: 1", "  sample_index: 3", "  rollout_n: 2", "  validate: false"]
    assert "{'" not in done.stdout and "': " not in done.stdout  # no Python dict repr anywhere
    response = next(line for line in lines if line.strip().startswith("response_text:"))
    left = len(ANSWER) - 200
    assert response.endswith(f"… ({left} more characters: --full, or --max-chars N)") and "⏎" in response, response
    assert "annotation: reward=1" in done.stdout

    full = show(col.url, trace_id, "--full")
    assert full.returncode == 0
    body = [line.split("│ ", 1)[1] for line in full.stdout.splitlines() if "│ " in line]
    assert "\n".join(body[-len(ANSWER.splitlines()):]) == ANSWER  # the response whole, its line breaks kept
    assert "more characters" not in full.stdout

    short = show(col.url, trace_id, "--max-chars", "20")
    cut = next(line for line in short.stdout.splitlines() if line.strip().startswith("response_text:"))
    assert cut.strip() == f"response_text: {ANSWER[:20].replace(chr(10), '⏎')}… ({len(ANSWER) - 20} more characters: --full, or --max-chars N)"
    bad = show(col.url, trace_id, "--max-chars", "-1")
    assert bad.returncode == 2 and bad.stderr.strip() == "tracecar: --max-chars must be 0 (no cut) or more"
