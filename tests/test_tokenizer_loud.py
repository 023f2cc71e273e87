"""A tokenizer the collector cannot load (issue 12, item 7): the name is logged once with what was
tried, every span says why it has no text, the viewer says what failed (not "set what is set"),
and GET /v1/tokenizers/check answers `tracecar doctor`. The start-up check (exit 2) is in
tests/test_config_errors.py."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from tests.test_viewer import Page, _browser, expect, get
from tracecar.client.demo import run_demo

pytestmark = pytest.mark.timeout(240)


def test_unknown_tokenizer_is_logged_once_and_the_viewer_says_what_failed(
        start_collector, tracer_to, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tracecar.collector")
    missing = str(tmp_path / "models" / "qwen")  # the path VERL's tokenizer_path names, absent in the sidecar
    # the operator allows the models directory (TRACECAR_TOKENIZER_ROOT), but this model is not there
    col = start_collector(token2text=True, tokenizer_root=str(tmp_path / "models"))
    tracer = tracer_to(col.url, experiment="tok", tokenizer=missing, batch_max_spans=8)
    assert asyncio.run(run_demo(1, 4, 2)) == 8
    assert tracer.flush(30)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cannot decode token ids")]
    assert len(lines) == 1, lines  # several batches, one line for the name
    assert f"tokenizer {missing!r} not found" in lines[0] and f"tried: no file or directory {missing}" in lines[0]
    assert "the Hugging Face cache" in lines[0] and f"worker {tracer.sender.worker_id}" in lines[0]

    row = get(col, "/ui/api/trajectories", experiment="tok", limit=1)["trajectories"][0]
    view = get(col, f"/ui/api/trajectories/{row['trace_id']}")
    assert view["turns"] and all(t["prompt_text"] is None for t in view["turns"])
    assert all(f"tokenizer {missing!r} not found" in (t["decode_problem"] or "") for t in view["turns"])

    with _browser() as pw:
        b = Page(pw, tmp_path, col.url)
        try:
            b.page.goto(col.url + f"/ui/#/t/{row['trace_id']}")
            turn = b.page.locator("[data-testid=turn]").first
            expect(turn).to_contain_text(f"no decoded text: tokenizer: tokenizer '{missing}' not found")
            assert "start the collector with TRACECAR_TOKEN2TEXT=true" not in turn.inner_text()
            b.shot("tokenizer-missing")
            b.check_clean()
        finally:
            b.close()


def test_tokenizer_check_endpoint(start_collector, deepseek_tokenizer_path: str, tmp_path: Path) -> None:
    col = start_collector(token2text=True, tokenizer=deepseek_tokenizer_path, token="tk", tokenizer_root=str(tmp_path))
    auth = {"Authorization": "Bearer tk"}
    ok = httpx.get(col.url + "/v1/tokenizers/check", headers=auth).json()
    assert ok["ok"] is True and ok["name"] == deepseek_tokenizer_path and ok["vocab_size"] > 100_000
    bad = httpx.get(col.url + "/v1/tokenizers/check", params={"name": str(tmp_path / "nope")}, headers=auth).json()
    assert bad["ok"] is False and "not found" in bad["error"] and "tried: no file or directory" in bad["tried"]
    outside = httpx.get(col.url + "/v1/tokenizers/check", params={"name": "/etc/passwd"}, headers=auth).json()
    assert outside["ok"] is False and "refused" in outside["error"] and "TRACECAR_TOKENIZER_ROOT" in outside["error"]
    assert httpx.get(col.url + "/v1/tokenizers/check").status_code == 401
