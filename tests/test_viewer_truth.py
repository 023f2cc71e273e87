"""Training truth in the viewer (issue 29), in a real headless Chromium: drift at the turn, the
reward panel, the list's truth filters and columns, the health card, a group's separating
component; and a clean run that shows no drift. Screenshots: artifacts/viewer/ (docs/truth-*.png).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_truth import EXPERIMENT, truth_run
from tests.test_viewer import ARTIFACTS, Page, _browser, expect, get

pytestmark = pytest.mark.timeout(240)


def element_shot(page: Any, selector: str, name: str) -> None:
    """One element as docs/<name>.png is made from: artifacts/viewer/docs-<name>.png."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.locator(selector).first.screenshot(path=str(ARTIFACTS / f"docs-{name}.png"))


def test_page_shows_drift_at_the_turn_and_why_this_reward(start_collector, tracer_to, deepseek_tokenizer_path, tmp_path):
    col, made = truth_run(start_collector, tracer_to, deepseek_tokenizer_path)
    rerender, clean = made["ids"][(0, 2)], made["ids"][(0, 0)]
    cut = get(col, f"/v1/trajectories/{rerender}/truth")["turns"][0]
    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            page.goto(col.url + f"/ui/#/t/{rerender}")
            drift = page.locator("[data-testid=turn]").nth(1).locator("[data-testid=turn-drift]")
            expect(drift).to_contain_text(f"First difference at token {cut['at']} of {cut['context_len']}")
            expect(drift.locator("[data-testid=drift-was]")).to_have_text(cut["was_text"])
            expect(drift.locator("[data-testid=drift-now]")).to_have_text(cut["now_text"])
            assert page.locator("[data-testid=turn]").first.locator("[data-testid^=turn-drift]").count() == 0  # turn 1: nothing before it
            panel = page.locator("[data-testid=reward-panel]")
            expect(panel.locator("[data-testid=reward-component][data-key=acc] td").nth(1)).to_have_text("0")
            expect(panel.locator("[data-testid=reward-component][data-key=pred] td").nth(1)).to_have_text("41")
            expect(panel.locator("[data-testid=ground-truth]")).to_have_text("42")
            element_shot(page, "[data-testid=reward-panel]", "truth-reward")
            drift.scroll_into_view_if_needed()
            element_shot(page, "[data-testid=turn] >> nth=1", "truth-drift")
            b.shot("40-truth-drift-and-reward")

            page.goto(col.url + f"/ui/#/t/{clean}")
            expect(page.locator("[data-testid=turn-drift-ok]")).to_have_text("✓ extends turn 1 exactly")
            assert page.locator("[data-testid=turn-drift]").count() == 0

            page.goto(col.url + "/ui/#/list")
            page.wait_for_selector("[data-testid=traj-row]")
            page.locator("[data-testid=filter-drift]").select_option("true")
            page.locator("[data-testid=apply-filters]").click()
            expect(page.locator("[data-testid=page-info]")).to_have_text("1–2 of 2")
            assert page.locator("[data-testid=traj-row] [data-testid=drift-badge]").all_inner_texts() == ["drift 1/1", "drift 1/1"]
            page.goto(col.url + "/ui/#/list")
            page.wait_for_selector("[data-testid=traj-row]")
            page.locator("[data-testid=filter-where]").fill("acc=0")
            page.locator("[data-testid=filter-cols]").fill("acc,format")
            page.locator("[data-testid=apply-filters]").click()
            expect(page.locator("[data-testid=page-info]")).to_have_text("1–4 of 4")
            assert set(page.locator("[data-testid=component-cell][data-key=acc]").all_inner_texts()) == {"0"}
            assert sorted(page.locator("[data-testid=component-cell][data-key=format]").all_inner_texts()) == ["0.5000", "1", "1", "1"]
            b.shot("41-truth-list-filters")

            page.goto(col.url + f"/ui/#/groups?experiment={EXPERIMENT}&step=1")
            separation = page.locator("[data-testid=group][data-sample-index='0'] [data-testid=group-separation]")
            expect(separation).to_have_text("separates best from worst: acc (1 vs 0)")

            page.goto(col.url + "/ui/#/")
            expect(page.locator("[data-testid=health-step-drift]")).to_have_text("2 of 8 multi-turn drifted (25.0%)")
            b.shot("42-truth-health")
            b.check_clean()
        finally:
            b.close()


def test_page_shows_fate_policy_versions_and_refills(start_collector, tracer_to, deepseek_tokenizer_path, tmp_path):
    """What the v1 hooks send (tests/test_truth_verl.py drives them with VERL's own buffer), shown."""
    from tracecar.client import annotate

    col, made = truth_run(start_collector, tracer_to, deepseek_tokenizer_path)
    ids = made["ids"]
    for n in (0, 1):  # sample 0: two trained (generated across two policy versions), two evicted as stale
        annotate(ids[(0, n)], trained=True, advantage=0.5, fate="trained", trained_on_version=4, min_global_steps=2, max_global_steps=3)
    for n in (2, 3):
        annotate(ids[(0, n)], fate="evicted", fate_reason="stale", evicted_at_step=4, min_global_steps=1, max_global_steps=2)
    for n in range(4):  # sample 1: the refill of sample 0's evicted group... as the trainer hook marks it
        annotate(ids[(1, n)], trained=True, fate="trained", trained_on_version=4, min_global_steps=3, max_global_steps=3, refill_of="g0")
    from tracecar.client import flush

    assert flush(30)
    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            page.goto(col.url + f"/ui/#/t/{ids[(0, 2)]}")
            expect(page.locator("[data-testid=fate-line] [data-testid=fate]")).to_have_text("evicted from the replay buffer: stale")
            expect(page.locator("[data-testid=fate-versions]")).to_have_text(" policy v1–v2 (2 versions) · evicted at step 4")
            page.goto(col.url + f"/ui/#/t/{ids[(0, 0)]}")
            expect(page.locator("[data-testid=fate-versions]")).to_have_text(" policy v2–v3 (2 versions) · staleness 2 when trained")
            page.goto(col.url + f"/ui/#/t/{ids[(1, 0)]}")
            expect(page.locator("[data-testid=fate-line] [data-testid=refill]")).to_have_text("refill of evicted group g0")

            page.goto(col.url + "/ui/#/list")
            page.wait_for_selector("[data-testid=traj-row]")
            page.locator("[data-testid=filter-fate]").select_option("evicted")
            page.locator("[data-testid=apply-filters]").click()
            expect(page.locator("[data-testid=page-info]")).to_have_text("1–2 of 2")
            page.goto(col.url + "/ui/#/list?refill=true")
            expect(page.locator("[data-testid=page-info]")).to_have_text("1–4 of 4")

            page.goto(col.url + f"/ui/#/groups?experiment={EXPERIMENT}&step=1&sort=sample_index")
            fates = page.locator("[data-testid=group][data-sample-index='0'] [data-testid=group-fates]")
            expect(fates).to_have_text("fate: 2 trained, 2 evicted from the replay buffer (stale) · policy v1–v3")
            expect(page.locator("[data-testid=group][data-sample-index='1'] [data-testid=group-refill]")).to_have_text(" refill of evicted group g0")
            element_shot(page, "[data-testid=group][data-sample-index='0']", "truth-fate")
            page.goto(col.url + "/ui/#/")
            expect(page.locator("[data-testid=health-step-fates]")).to_contain_text("6 trained, 0 filtered, 2 evicted, 0 never reached the trainer, 4 refills")
            b.shot("43-truth-fate")
            b.check_clean()
        finally:
            b.close()
