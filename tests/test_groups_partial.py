"""GRPO groups under a budget (issue 31, item 2): kept or dropped whole by default, and a group a
budget left partial is marked "k of n kept" in /v1/groups, the CLI and the viewer, never flagged
zero spread nor scored (std, advantage) as if whole.

The quickstart's demo (3 steps × 8 samples × 4 rollouts) under the quickstart's budget (16
trajectories per step), decided by a collector on 127.0.0.1; the page in Debian's Chromium.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from tests.test_viewer import Page, _browser, demo_collector, expect, get
from tracecar.client.cli.quickstart import wait_for_decisions

pytestmark = pytest.mark.timeout(240)
BUDGET = dict(max_trajectories_per_step=16, step_idle_s=1)


def decided_groups(col: Any) -> dict[int, dict[str, Any]]:
    assert wait_for_decisions(col.url, "demo", 3).get("decisions")  # the last step, closed by idleness
    return {step: get(col, "/v1/groups", experiment="demo", step=step, limit=100, diff="false") for step in (1, 2, 3)}


def test_groups_are_kept_whole_by_default(start_collector, tracer_to, deepseek_tokenizer_path) -> None:
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path, **BUDGET)
    for step, page in decided_groups(col).items():
        assert page["trajectories"] == 16 and page["partial_groups"] == 0, step
        assert [g["n"] for g in page["groups"]] == [4, 4, 4, 4] and not any(g["partial"] for g in page["groups"])
        decisions = get(col, "/v1/decisions", experiment="demo", step=step)["decisions"]
        by_sample: dict[Any, set[bool]] = {}
        for d in decisions:
            by_sample.setdefault(d["sample_index"], set()).add(d["keep"])
        assert all(len(verdicts) == 1 for verdicts in by_sample.values())  # no group split by the budget


def partial_collector(start_collector: Any, tracer_to: Any, tokenizer: str) -> tuple[Any, dict[str, Any]]:
    """Trajectory-by-trajectory decisions (keep_groups_whole=False): the rules keep single rollouts."""
    col = demo_collector(start_collector, tracer_to, tokenizer, keep_groups_whole=False, **BUDGET)
    pages = decided_groups(col)
    step, page = next((s, p) for s, p in pages.items() if any(g["partial"] and g["n"] < 4 for g in p["groups"]))
    return col, {"step": step, "page": page}


def test_a_partial_group_is_marked_and_not_flagged_in_the_api_and_the_cli(start_collector, tracer_to, deepseek_tokenizer_path) -> None:
    col, found = partial_collector(start_collector, tracer_to, deepseek_tokenizer_path)
    page, step = found["page"], found["step"]
    partial = [g for g in page["groups"] if g["partial"]]
    assert page["partial_groups"] == len(partial) > 0
    decisions = get(col, "/v1/decisions", experiment="demo", step=step)["decisions"]
    for g in partial:
        dropped = sum(1 for d in decisions if d["sample_index"] == g["sample_index"] and not d["keep"])
        assert g["sampled_out"] == dropped > 0 and g["total"] == 4 == g["n"] + dropped
        assert g["all_equal"] is False and g["std"] is None  # never flagged nor scored as if whole
        assert all(r["group_advantage"] is None for r in g["rollouts"])
    lone = next(g for g in partial if g["n"] == 1)  # one survivor: the case flagged "zero spread" before
    assert lone["min"] == lone["max"] and lone["spread"] == 0
    whole = [g for g in page["groups"] if not g["partial"]]
    assert all(g["total"] == g["n"] == 4 and g["std"] is not None for g in whole)

    cli = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "groups", "--url", col.url, "--experiment", "demo",
                          "--step", str(step), "--limit", "100"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    lines = cli.stdout.splitlines()
    assert f"; {len(partial)} partial (rollouts sampled out: neither flagged nor scored as whole" in lines[0]
    lone_line = next(line for line in lines if line.startswith(f"sample {lone['sample_index']}:"))
    assert lone_line.endswith("PARTIAL: 1 of 4 kept (3 sampled out): not scored as a whole group"), lone_line
    assert "ZERO SPREAD" not in lone_line and "std -" in lone_line


def test_page_marks_a_partial_group_and_does_not_flag_it(start_collector, tracer_to, deepseek_tokenizer_path, tmp_path) -> None:
    col, found = partial_collector(start_collector, tracer_to, deepseek_tokenizer_path)
    lone = next(g for g in found["page"]["groups"] if g["partial"] and g["n"] == 1)
    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            page.goto(col.url + f"/ui/#/groups?experiment=demo&step={found['step']}&sort=zero_spread")
            card = page.locator(f"[data-testid=group][data-sample-index='{lone['sample_index']}']")
            expect(card.locator("[data-testid=partial-group]")).to_have_text("1 of 4 kept")
            assert card.locator("[data-testid=zero-spread]").count() == 0
            assert "zero" not in (card.get_attribute("class") or "")
            assert "sampled out" in (card.locator("[data-testid=partial-group]").get_attribute("title") or "")
            assert "bad" not in (card.locator("[data-testid=partial-group]").get_attribute("class") or "").split()  # not a failure
            expect(page.locator("[data-testid=groups-summary]")).to_contain_text(f"{found['page']['partial_groups']} partial")
            card.scroll_into_view_if_needed()
            b.shot("31-partial-group-marked")
            b.check_clean()
        finally:
            b.close()
