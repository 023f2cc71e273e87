"""Compare and groups as a GRPO engineer reads them (issue 31, item 10): compare shows every turn in the
page (no inner scroll) and an advantage row; the groups page shows the question the rollouts answer,
the whole prompt one click away; "sampled out" is not shown as a failure. Debian's Chromium,
screenshots in artifacts/viewer/."""

from __future__ import annotations

import pytest

from tests.test_viewer import Page, _browser, demo_collector, expect, get
from tracecar.client.cli.quickstart import wait_for_decisions

pytestmark = pytest.mark.timeout(240)


def test_compare_without_inner_scroll_with_advantage_groups_question_and_sampled_out_not_red(
        start_collector, tracer_to, deepseek_tokenizer_path, tmp_path) -> None:
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path, max_trajectories_per_step=16, step_idle_s=1)
    assert wait_for_decisions(col.url, "demo", 3).get("decisions")
    groups = get(col, "/v1/groups", experiment="demo", step=2, sort="spread")["groups"]
    group = groups[0]
    assert group["prompt_question"] and "<|" not in group["prompt_question"]
    assert group["prompt_preview"] == f"<|user|>{group['prompt_question']}<|assistant|>"
    ids = [r["trace_id"] for r in group["rollouts"]]
    expected = [f"{r['group_advantage']:.3f}" for r in group["rollouts"]]
    health = get(col, "/v1/health")
    assert health["sampled_out_total"] > 0

    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            page.goto(col.url + "/ui/#/compare?ids=" + ",".join(ids))
            expect(page.locator("[data-testid=compare-advantage]")).to_have_count(len(ids))
            expect(page.locator("[data-testid=compare-advantage]").first).not_to_have_text("")
            assert page.locator("[data-testid=compare-advantage]").all_inner_texts() == expected
            frame = page.locator("[data-testid=compare-scroll]")
            assert frame.evaluate("el => el.scrollHeight <= el.clientHeight + 1")  # nothing hidden below an inner scroll
            clipped = page.locator("[data-testid=compare-grid] pre.text").evaluate_all(
                "els => els.filter(e => e.scrollHeight > e.clientHeight + 1).length")
            assert clipped == 0  # no cell scrolls either: every turn is read with the page's scroll
            last = page.locator("[data-testid=compare-cell]").last
            last.scroll_into_view_if_needed()
            expect(last).to_be_in_viewport()
            b.shot("35-compare-advantage-no-inner-scroll")

            page.goto(col.url + f"/ui/#/groups?experiment=demo&step=2&sort=spread&sample_index={group['sample_index']}")
            card = page.locator(f"[data-testid=group][data-sample-index='{group['sample_index']}']")
            expect(card.locator("[data-testid=group-question]")).to_have_text("asked: " + group["prompt_question"])
            expect(card.locator("[data-testid=group-question]")).to_be_visible()
            assert card.locator("[data-testid=group-prompt]").get_attribute("open") is None  # the whole prompt one click away
            b.shot("36-groups-question-visible")

            page.goto(col.url + "/ui/#/?experiment=demo")
            sampled = page.locator("[data-testid=health-sampled_out]")
            expect(sampled).to_have_text(f"{health['sampled_out_total']} sampled out")
            assert "bad" not in (sampled.get_attribute("class") or "").split()  # red is for failures
            assert "as configured" in (sampled.get_attribute("title") or "")
            assert "bad" in (page.locator("[data-testid=health-client_dropped]").get_attribute("class") or "").split() \
                or health["client_dropped_total"] == 0
            b.shot("37-health-sampled-out-not-red")
            b.check_clean()
        finally:
            b.close()
