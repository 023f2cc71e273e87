"""A trajectory's span timeline (issue 31, item 11): where the time went, generation vs tools vs the
rest, one bar per span on the trajectory's clock. The split is recomputed here from the stored spans
and compared with what the page (Debian's Chromium) shows; screenshot in artifacts/viewer/."""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_viewer import Page, _browser, demo_collector, expect, get

pytestmark = pytest.mark.timeout(240)


def union(intervals: list[tuple[float, float]]) -> float:
    total, start, end = 0.0, None, float("-inf")
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if start is None or s > end:
            if start is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + (end - start if start is not None else 0.0)


def walk(span: dict[str, Any]) -> Any:
    yield span
    for child in span["children"]:
        yield from walk(child)


def test_timeline_splits_generation_tools_and_the_rest(start_collector, tracer_to, deepseek_tokenizer_path, tmp_path) -> None:
    col = demo_collector(start_collector, tracer_to, deepseek_tokenizer_path)
    worst = get(col, "/ui/api/trajectories", has_error="true", sort="reward", order="asc", limit=1)["trajectories"][0]
    view = get(col, f"/ui/api/trajectories/{worst['trace_id']}")
    spans = list(walk(view["tree"]))
    times = {s["span_id"]: (s["start_time"], s["end_time"]) for s in spans}
    turns = [t["span_id"] for t in view["turns"]]
    tools = [e["span_id"] for t in view["turns"] for e in t["after"] if e["type"] == "tool"]
    assert turns and tools
    total = max(e for _, e in times.values()) - min(s for s, _ in times.values())
    expected = {"generation": union([times[i] for i in turns]), "tools": union([times[i] for i in tools]),
                "rest": total - union([times[i] for i in turns + tools])}
    assert expected["rest"] > 0

    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        page = b.page
        try:
            page.goto(col.url + f"/ui/#/t/{worst['trace_id']}")
            expect(page.locator("[data-testid=timeline-row]")).to_have_count(len(spans))
            for key, testid in (("generation", "timeline-generation"), ("tools", "timeline-tools"), ("rest", "timeline-rest")):
                shown = float(page.locator(f"[data-testid={testid}]").get_attribute("data-seconds") or "nan")
                assert shown == pytest.approx(expected[key], abs=2e-6), key
            kinds = {r.get_attribute("data-span-id"): r.get_attribute("data-kind") for r in page.locator("[data-testid=timeline-row]").all()}
            assert {i for i, k in kinds.items() if k == "generation"} == set(turns)
            assert {i for i, k in kinds.items() if k == "tool"} == set(tools)
            # bars sit on one clock: the root's spans the track, a tool call's starts after the first turn's
            track = page.locator("[data-testid=timeline-row]").first.locator(".tl-track").bounding_box()
            root_bar = page.locator("[data-testid=timeline-bar]").first.bounding_box()
            assert track and root_bar and root_bar["width"] >= track["width"] * 0.95
            first_tool = page.locator(f"[data-testid=timeline-row][data-span-id='{tools[0]}'] [data-testid=timeline-bar]").bounding_box()
            first_turn = page.locator(f"[data-testid=timeline-row][data-span-id='{turns[0]}'] [data-testid=timeline-bar]").bounding_box()
            assert first_tool and first_turn and first_tool["x"] >= first_turn["x"]
            page.locator("[data-testid=timeline]").scroll_into_view_if_needed()
            b.shot("38-trajectory-timeline")
            b.check_clean()
        finally:
            b.close()
