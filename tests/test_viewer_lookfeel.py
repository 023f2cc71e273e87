"""The viewer as a new user meets it (issue 15 §7): previews and text search in the list, the
compare page, keyboard navigation, themes. HTTP checks, then the page in Debian's Chromium
(helpers from test_viewer); screenshots land in ``artifacts/viewer/``.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from typing import Any

import httpx
import pytest

from tests.test_viewer import ARTIFACTS, Page, _browser, _write, demo_collector, expect, get
from tracecar.collector.spool.store import Spool
from tracecar.collector.viewer.index import ListFilter, TrajectoryIndex
from tracecar.collector.viewer.search import fts_query

pytestmark = pytest.mark.timeout(240)


def doc_shot(page: Any, name: str) -> None:
    """What the window shows (not the whole page), as docs/<name>.png is made from: artifacts/viewer/docs-<name>.png."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"docs-{name}.png"))


# ---- previews and search -------------------------------------------------------------------------
def test_search_finds_prompts_and_responses_in_the_list_and_the_api(start_collector, tracer_to, deepseek_tokenizer_path):
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path)
    every = get(col, "/ui/api/trajectories", limit=500)["trajectories"]
    assert len(every) == 96 and all(t["prompt_preview"] and t["response_preview"] for t in every)
    sample = every[0]
    view = get(col, f"/ui/api/trajectories/{sample['trace_id']}")
    # the first prompt's last user message, template tokens left out (issue 31, item 3)
    assert view["turns"][0]["prompt_text"] == f"<|user|>{sample['prompt_preview']}<|assistant|>"
    assert sample["response_preview"] == view["turns"][-1]["response_text"]

    # "What is 7 cubed?" is sample index 6 of 8: 4 rollouts x 3 steps
    cubed = get(col, "/ui/api/trajectories", q="cubed", limit=500)
    assert cubed["total"] == 12 and {t["sample_index"] for t in cubed["trajectories"]} == {6}
    assert all("cubed" in t["prompt_preview"] for t in cubed["trajectories"])
    assert get(col, "/ui/api/trajectories", q="CUB", limit=500)["total"] == 12  # case-insensitive; the last word a prefix
    assert get(col, "/ui/api/trajectories", q="cubed", step=2)["total"] == 4
    both = get(col, "/ui/api/trajectories", q="7 cubed answer 343", limit=500)["trajectories"]  # words in prompt and response
    assert both and all("343" in t["response_preview"] for t in both)
    assert len(both) == sum("343" in t["response_preview"] for t in cubed["trajectories"])
    failed = get(col, "/ui/api/trajectories", q="could not compute", limit=500)["trajectories"]
    expected = {t["trace_id"] for t in every if t["response_preview"] == "I could not compute it."}
    assert {t["trace_id"] for t in failed} == expected

    api = get(col, "/v1/trajectories", q="cubed", limit=500)  # the API answers the same search
    assert api["q"] == "cubed" and api["total"] == 12
    assert {t["trace_id"] for t in api["trajectories"]} == {t["trace_id"] for t in cubed["trajectories"]}
    assert all(t["reward"] is not None and t["span_count"] > 0 for t in api["trajectories"])
    rewards = [t["reward"] for t in get(col, "/v1/trajectories", q="cubed", sort="reward", order="asc", limit=500)["trajectories"]]
    assert rewards == sorted(rewards)
    for text in ('NOT "x', "prompt:", "*", "(", "'; DROP TABLE x"):  # FTS5 syntax in user input is plain text
        assert httpx.get(col.url + "/v1/trajectories", params={"q": text}, timeout=10).status_code == 200, text
        assert httpx.get(col.url + "/ui/api/trajectories", params={"q": text}, timeout=10).status_code == 200, text
    too_long = httpx.get(col.url + "/v1/trajectories", params={"q": "x" * 300}, timeout=10)
    assert too_long.status_code == 422 and "q" in too_long.text

    cli = subprocess.run([sys.executable, "-m", "tracecar.client.cli", "trajectories", "--url", col.url, "--search", "cubed",
                          "--limit", "3"], capture_output=True, text=True, timeout=60, check=True)
    assert cli.stdout.startswith("12 trajectories (showing 3") and cli.stdout.count("What is 7 cubed?") == 3


def _call(trace: str, i: int, start: float, prompt: str, response: str) -> dict[str, Any]:
    attrs = {"step": 1, "sample_index": 0, "rollout_n": 0, "validate": False, "experiment_name": "s"}
    return {"span_id": f"{trace}-g{i}", "trace_id": trace, "parent_id": trace, "name": "Loop.generate", "kind": "op",
            "worker": "w", "project": None, "entity": None, "exception": None, "start_time": start, "end_time": start + 0.5,
            "attributes": attrs, "inputs": {"prompt_ids": [1, 2]},
            "output": {"token_ids": [3], "prompt_text": prompt, "response_text": response}}


def test_previews_keep_the_first_prompt_and_last_response_whatever_the_arrival_order(tmp_path):
    path = tmp_path / "spool.sqlite3"
    spool = Spool(path, local_only=True)
    root = {**_call("t", 9, 9.0, "", ""), "span_id": "t", "parent_id": None, "name": "agent_loop", "kind": "trajectory", "output": None}
    _write(spool, [root, _call("t", 1, 11.0, "alpha later", "omega final")])  # the second turn first
    index = TrajectoryIndex(path)
    assert index.refresh()

    def hits(q: str) -> list[str]:
        return [t["trace_id"] for t in index.list(ListFilter(q=q))["trajectories"]]

    assert hits("later") == ["t"] and hits("omega") == ["t"]
    _write(spool, [_call("t", 0, 10.0, "alpha first " + "x" * 3000, "beta middle")])
    assert index.refresh()
    row = index.list(ListFilter())["trajectories"][0]
    assert row["response_preview"] == "omega final" and row["prompt_preview"].endswith("x" * 50) and len(row["prompt_preview"]) == 201
    assert hits("first") == ["t"] and hits("later") == [] and hits("beta") == [] and hits("omega final") == ["t"]
    assert hits("alpha omega") == ["t"] and hits("alpha zzz") == [] and hits("") == ["t"]
    assert fts_query('a "b" c*') == '"a" AND "b" AND "c"*' and fts_query("?!") is None
    index.close()
    reopened = TrajectoryIndex(path)  # persisted with the index
    assert [t["trace_id"] for t in reopened.list(ListFilter(q="first"))["trajectories"]] == ["t"]
    reopened.close()
    spool.close()


def test_page_search_box_and_previews(start_collector, tracer_to, deepseek_tokenizer_path, tmp_path):
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path)
    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            page.goto(col.url + "/ui/#/list")
            page.wait_for_selector("[data-testid=traj-row] [data-testid=prompt-preview]")
            first = page.locator("[data-testid=traj-row]").first
            shown = first.locator("[data-testid=prompt-preview]").inner_text()
            assert "<|user|>" not in shown and "<|assistant|>" not in shown and len(shown.split()) > 2  # the question alone
            assert first.locator("[data-testid=response-preview]").inner_text().strip()
            page.locator("[data-testid=search]").fill("cubed")
            page.locator("[data-testid=search]").press("Enter")
            expect(page.locator("[data-testid=page-info]")).to_have_text("1–12 of 12")
            assert page.locator("[data-testid=traj-row] mark.hit").count() == 12
            assert set(page.locator("[data-testid=traj-row] mark.hit").all_inner_texts()) == {"cubed"}
            assert "q=cubed" in page.url
            b.shot("10-list-search-previews")
            doc_shot(page, "search")
            b.check_clean()
        finally:
            b.close()


# ---- compare -------------------------------------------------------------------------------------
def _tool_text(call: dict[str, Any]) -> tuple[Any, ...]:
    return (call["name"], call["arguments"], call["error"], call["result"])


def test_page_compare_shows_prompts_and_only_real_differences(start_collector, tracer_to, deepseek_tokenizer_path, tmp_path):
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path)
    overview = get(col, "/ui/api/overview", experiment="demo")
    step2 = next(s for s in overview["steps"] if s["step"] == 2)
    listed = {t["trace_id"]: t for t in get(col, "/ui/api/trajectories", limit=500)["trajectories"]}
    group = get(col, "/ui/api/trajectories", step=2, sample_index=1, sort="rollout_n", order="asc", limit=10)["trajectories"]
    eight = [t["trace_id"] for t in get(col, "/ui/api/trajectories", has_error="true", limit=4)["trajectories"]]
    eight += [t["trace_id"] for t in get(col, "/ui/api/trajectories", step=2, has_error="false", limit=4)["trajectories"]]
    assert len(group) == 4 and len(eight) == 8
    views = {i: get(col, f"/ui/api/trajectories/{i}", tree="false") for i in [*eight, *(t["trace_id"] for t in group)]}
    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            # Compare best vs worst from the overview: two questions, both shown
            page.goto(col.url + "/ui/#/")
            page.locator("[data-testid=step-row][data-step='2'] [data-testid=compare-best-worst]").click()
            page.wait_for_selector("[data-testid=compare-prompt]")
            ids = [step2["best"]["trace_id"], step2["worst"]["trace_id"]]
            best_view, worst_view = (get(col, f"/ui/api/trajectories/{i}", tree="false") for i in ids)
            prompts = page.locator("[data-testid=compare-prompt]").all_inner_texts()
            same_prompt = best_view["turns"][0]["prompt_text"] == worst_view["turns"][0]["prompt_text"]
            assert prompts == [best_view["turns"][0]["prompt_text"], "same prompt as A" if same_prompt else worst_view["turns"][0]["prompt_text"]]
            assert ("different prompts" in page.locator("[data-testid=compare-summary]").inner_text()) == (not same_prompt)
            assert page.locator("[data-testid=compare-prompt].differs").count() == (0 if same_prompt else 2)
            b.shot("11-compare-best-vs-worst")

            # one group's 4 rollouts: a turn cell is highlighted exactly when its text or its tool calls differ
            page.goto(col.url + "/ui/#/compare?ids=" + ",".join(t["trace_id"] for t in group))
            expect(page.locator("[data-testid=compare-col]")).to_have_count(4)
            page.wait_for_selector("[data-testid=compare-cell]")
            assert "All 4 answer the same prompt." == page.locator("[data-testid=compare-summary]").inner_text()
            assert page.locator("[data-testid=compare-prompt].differs").count() == 0
            turns = [views[t["trace_id"]]["turns"] for t in group]
            expected = []
            for k in range(max(len(t) for t in turns)):
                for i, mine in enumerate(turns):
                    if k >= len(mine):
                        continue
                    ref = turns[1 if i == 0 else 0]
                    other = ref[k] if k < len(ref) else None
                    tools = [_tool_text(e) for e in mine[k]["after"] if e["type"] == "tool"]
                    ref_tools = [_tool_text(e) for e in other["after"] if e["type"] == "tool"] if other else None
                    expected.append(other is None or mine[k]["response_text"] != other["response_text"] or tools != ref_tools)
            shown = [c.get_attribute("data-differs") == "1" for c in page.locator("[data-testid=compare-cell]:not(.missing)").all()]
            assert shown == expected and not all(expected)  # identical turns stay plain
            assert page.locator(".compare-grid > div.differs").filter(has_text=re.compile(r"^\d+(\.\d+)? (ms|s)$")).count() == 0  # durations never
            b.shot("12-compare-one-group")

            # 8 rollouts: the error row agrees with the list; nothing clipped, the grid scrolls inside its frame
            page.goto(col.url + "/ui/#/compare?ids=" + ",".join(eight))
            expect(page.locator("[data-testid=compare-col]")).to_have_count(8)
            page.wait_for_selector("[data-testid=compare-tool]")
            errors = page.locator("[data-testid=compare-error]").all_inner_texts()
            assert [e != "—" for e in errors] == [listed[i]["has_error"] for i in eight] == [True] * 4 + [False] * 4
            assert all("failed tool call" in e or "Error" in e for e in errors[:4])
            assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")  # the page does not overflow
            frame = page.locator("[data-testid=compare-scroll]")
            assert frame.evaluate("el => el.scrollWidth > el.clientWidth")  # 8 columns scroll sideways in their frame
            clipped = page.locator("[data-testid=compare-tool] pre").evaluate_all(
                "els => els.filter(e => e.scrollWidth > e.clientWidth + 1).length")
            assert clipped == 0
            calls = [e for i in eight for t in views[i]["turns"] for e in t["after"] if e["type"] == "tool"]
            texts = page.locator("[data-testid=compare-tool]").all_inner_texts()
            assert len(texts) == len(calls)
            for call in calls:  # every tool result whole (the page shows them turn by turn, across the columns)
                whole = call["error"] if call["error"] else json.dumps(call["result"], separators=(",", ":"))
                texts.remove(next(t for t in texts if whole in t and call["name"] in t))
            assert texts == []
            b.shot("13-compare-eight-rollouts")
            doc_shot(page, "compare")

            # the trajectory page says the same error as the list
            bad = eight[0]
            page.goto(col.url + f"/ui/#/t/{bad}")
            page.wait_for_selector("[data-testid=traj-error]")
            assert page.locator("[data-testid=traj-error]").inner_text() == errors[0]
            b.check_clean()
        finally:
            b.close()


# ---- keyboard, themes, the worst of a step and why ------------------------------------------------
def test_page_keys_between_rollouts_themes_and_why_the_worst_failed(start_collector, tracer_to, deepseek_tokenizer_path, tmp_path):
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path)
    group = get(col, "/ui/api/trajectories", step=2, sample_index=1, sort="rollout_n", order="asc", limit=10)["trajectories"]
    step2 = get(col, "/ui/api/trajectories", step=2, sort="reward", order="asc", limit=100)["trajectories"]
    worst, best = step2[0], step2[-1]
    worst_view = get(col, f"/ui/api/trajectories/{worst['trace_id']}", tree="false")
    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            # the worst trajectory of step 2 and why: one click from the overview
            page.goto(col.url + "/ui/#/")
            page.locator("[data-testid=step-row][data-step='2'] [data-testid=worst-link]").click()
            why = page.locator("[data-testid=why]")
            expect(why).to_contain_text("the worst reward of step 2")
            assert ("Why it failed" in why.inner_text()) == worst["has_error"]
            for turn in worst_view["turns"]:
                for call in turn["after"]:
                    if call.get("error"):
                        assert call["error"] in why.inner_text()
            assert why.locator("[data-testid=why-last]").inner_text() == worst_view["turns"][-1]["response_text"][-240:]
            b.shot("14-worst-and-why")
            doc_shot(page, "why")

            # j / k walk the group's rollouts in order, g opens the group, w / b the step's worst / best
            ids = [t["trace_id"] for t in group]
            page.goto(col.url + f"/ui/#/t/{ids[0]}")
            page.wait_for_selector(f"[data-testid=trajectory][data-trace-id='{ids[0]}'] [data-testid=rollout-nav]")
            for expected in ids[1:]:
                page.keyboard.press("j")
                page.wait_for_selector(f"[data-testid=trajectory][data-trace-id='{expected}']")
            page.keyboard.press("j")  # the last rollout: nowhere further
            page.keyboard.press("k")
            page.wait_for_selector(f"[data-testid=trajectory][data-trace-id='{ids[-2]}']")
            assert page.locator("[data-testid=rollout-chip].here").inner_text() == str(group[-2]["rollout_n"])
            page.keyboard.press("w")
            page.wait_for_selector(f"[data-testid=trajectory][data-trace-id='{worst['trace_id']}']")
            page.keyboard.press("b")
            page.wait_for_selector(f"[data-testid=trajectory][data-trace-id='{best['trace_id']}']")
            page.goto(col.url + f"/ui/#/t/{ids[0]}")
            page.wait_for_selector(f"[data-testid=trajectory][data-trace-id='{ids[0]}'] [data-testid=rollout-nav]")
            page.keyboard.press("g")
            page.wait_for_selector("[data-testid=groups] [data-testid=group][data-sample-index='1']")
            assert page.locator("[data-testid=group]").count() == 1
            page.keyboard.press("?")
            expect(page.locator("[data-testid=key-help]")).to_contain_text("next rollout of this group")
            page.keyboard.press("Escape")
            expect(page.locator("[data-testid=key-help]")).to_have_count(0)
            page.goto(col.url + "/ui/#/list")
            page.locator("[data-testid=search]").press("j")  # typing in a field is typing, not navigating
            assert page.locator("[data-testid=search]").input_value() == "j" and "#/list" in page.url

            # light by default here; the toggle cycles auto -> dark -> light and is remembered
            html = page.locator("html")
            expect(html).to_have_attribute("data-theme", "light")
            page.locator("[data-testid=theme-toggle]").click()
            expect(html).to_have_attribute("data-theme", "dark")
            assert page.locator("body").evaluate("el => getComputedStyle(el).backgroundColor") == "rgb(13, 17, 23)"
            page.reload()
            expect(html).to_have_attribute("data-theme", "dark")
            page.locator("[data-testid=theme-toggle]").click()
            expect(html).to_have_attribute("data-theme", "light")
            assert page.locator("body").evaluate("el => getComputedStyle(el).backgroundColor") == "rgb(255, 255, 255)"
            page.locator("[data-testid=theme-toggle]").click()  # back to auto
            b.check_clean()

            # a system in dark mode gets the dark theme without touching anything
            dark = b.browser.new_page(viewport={"width": 1400, "height": 1000}, color_scheme="dark")
            dark.on("pageerror", lambda e: b.errors.append(f"page error: {e}"))
            dark.goto(col.url + "/ui/#/")
            dark.wait_for_selector("[data-testid=step-row]")
            expect(dark.locator("html")).to_have_attribute("data-theme", "dark")
            expect(dark.locator("html")).to_have_attribute("data-theme-choice", "auto")
            expect(dark.locator("canvas[data-testid=reward-chart]")).to_have_attribute("width", re.compile(r"^[1-9]"))
            b.page = dark
            b.shot("15-overview-dark")
            dark.goto(col.url + f"/ui/#/t/{worst['trace_id']}")
            dark.wait_for_selector("[data-testid=why]")
            b.shot("16-trajectory-dark")
            doc_shot(dark, "dark")
            assert b.errors == []
        finally:
            b.close()


def test_an_index_from_before_previews_is_rebuilt_with_them(tmp_path):
    """An index file of version 4 (no previews tables) is migrated: rebuilt once, searchable after."""
    path = tmp_path / "spool.sqlite3"
    spool = Spool(path, local_only=True)
    root = {**_call("old", 9, 9.0, "", ""), "span_id": "old", "parent_id": None, "name": "agent_loop", "kind": "trajectory", "output": None}
    _write(spool, [root, _call("old", 0, 10.0, "legacy question", "legacy answer")])
    index = TrajectoryIndex(path)
    assert index.refresh()
    index.close()
    db = sqlite3.connect(tmp_path / "viewer-index.sqlite3")  # as version 4 left it
    db.executescript("DROP TABLE previews_fts; DROP TABLE previews; UPDATE meta SET value = '4' WHERE key = 'version';")
    db.commit()
    db.close()
    reopened = TrajectoryIndex(path)
    assert reopened.status()["indexed_seq"] == 0  # starts over
    assert reopened.refresh()
    rows = reopened.list(ListFilter(q="legacy answer"))["trajectories"]
    assert [(t["trace_id"], t["prompt_preview"], t["response_preview"]) for t in rows] == [("old", "legacy question", "legacy answer")]
    reopened.close()
    spool.close()


# ---- long texts folded -----------------------------------------------------------------------------
def test_page_folds_long_texts_and_tool_results_behind_a_keyboard_button(start_collector, tmp_path):
    """A long response, a long tool result and a long error are folded to their first lines with a
    "Show all" button (a real <button>: Tab and Enter reach it); short texts are not; `e` shows or
    folds them all; the whole text is in the page either way; nothing is fetched from elsewhere."""
    from tests.test_groups_export import post, trajectory

    answer = "\n".join(f"line {i}: the policy reasons about step {i} of the proof." for i in range(80))
    listing = "\n".join(f"file_{i}.py  {i * 37} bytes" for i in range(60))
    spans = trajectory("fold-1", 1, 0, 0, [("call ls", {"path": "."}), (answer, None)], reward=1.0)
    for span in spans:
        if span["name"] == "CalculatorTool.execute":
            span["output"] = {"stdout": listing}
    spans += trajectory("fold-2", 1, 0, 1, [("call calc", {"expression": "bad"}), ("short.", None)], reward=0.0)
    for span in spans:
        if span["trace_id"] == "fold-2" and span.get("exception"):
            span["exception"] = "Traceback (most recent call last):\n" + "\n".join(f'  File "tool.py", line {i}, in f{i}' for i in range(40))
    col = start_collector()
    post(col.url, spans)
    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            page.goto(col.url + "/ui/#/t/fold-1")
            page.wait_for_selector("[data-testid=trajectory][data-trace-id='fold-1'] [data-testid=turn]")
            folds = page.locator("[data-testid=turn] [data-testid=fold]")
            expect(folds).to_have_count(2)  # the 60-line tool result and the 80-line response; not the short prompts
            result, response = folds.nth(0), folds.nth(1)  # turn 1's tool result (JSON), then turn 2's response
            toggle = response.locator("[data-testid=fold-toggle]")
            expect(toggle).to_have_attribute("aria-expanded", "false")
            expect(toggle).to_have_text("Show all (80 lines, " + f"{len(answer):,}" + " characters)")
            assert toggle.evaluate("el => el.tagName") == "BUTTON"
            text = response.locator("pre")
            assert text.get_attribute("id") == toggle.get_attribute("aria-controls")
            folded_height = text.bounding_box()["height"]
            assert folded_height < 220 and text.text_content() == answer  # clipped, the whole text still in the page
            expect(result.locator("[data-testid=fold-toggle]")).to_have_text("Show all (1,414 characters)")  # lines only when many
            response.scroll_into_view_if_needed()
            page.mouse.wheel(0, 300)
            b.shot("30-long-texts-folded")
            doc_shot(page, "fold")
            toggle.focus()  # keyboard: a focused button opens with Enter and closes with Space
            page.keyboard.press("Enter")
            expect(toggle).to_have_attribute("aria-expanded", "true")
            expect(toggle).to_have_text("Show less")
            assert text.bounding_box()["height"] > 4 * folded_height
            assert result.locator("[data-testid=fold-toggle]").get_attribute("aria-expanded") == "false"  # each its own
            page.keyboard.press("Space")
            expect(toggle).to_have_attribute("aria-expanded", "false")
            page.locator("body").click(position={"x": 5, "y": 5})  # focus off the button: e is a page key
            page.keyboard.press("e")
            expect(page.locator("[data-testid=fold-toggle][aria-expanded=false]")).to_have_count(0)
            expect(page.locator("[data-testid=fold-all]")).to_have_text("Fold long texts")
            b.shot("31-long-texts-shown")
            page.keyboard.press("e")
            expect(page.locator("[data-testid=fold-toggle][aria-expanded=true]")).to_have_count(0)
            # a long error is folded too; a page with nothing long has no fold
            page.goto(col.url + "/ui/#/t/fold-2")
            page.wait_for_selector("[data-testid=trajectory][data-trace-id='fold-2'] [data-testid=turn]")
            error = page.locator("[data-testid=tool-call] [data-testid=fold]")
            expect(error).to_have_count(1)
            assert "line 39, in f39" in error.locator(".err-text").text_content()
            expect(page.locator("[data-testid=turn] [data-testid=fold]")).to_have_count(1)
            page.keyboard.press("?")
            expect(page.locator("[data-testid=key-help]")).to_contain_text("show or fold every long text")
            page.keyboard.press("Escape")
            b.check_clean()
        finally:
            b.close()
