"""Id lists kept as received (collector/receivers/raw_ids.py), through the real collector: what is
stored, and what every reader gets back, is byte for byte what the collector stores when it
parses every id into an int.

The same bodies go to three collectors (uvicorn on 127.0.0.1): token2text on, each batch saying
``"token2text": false`` (ids parsed into lists: the reference); token2text off, in one process
(ids kept as bytes); and token2text off with two worker processes, their pool started by one batch
that decodes (token2text off starts none), so each body is parsed and serialised in a worker. Bodies: v1 and v2 batches
with prompt references to the same and earlier batches (contexts kept as bytes, sliced by the
next turn), outputs sliced from a context, per-token arrays (packed from ids kept as bytes), ids
that are not plain ints, an empty list, and ids in places the collector does not keep as bytes.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tokenizers import Tokenizer

from tests.support.collector import scrape_metric
from tests.test_workers import TEXTS, _bodies, _rows, _span, _wait_metric
from tracecar.collector.spool.full_payloads import full_spans

pytestmark = pytest.mark.timeout(240)
WIDE_STANDIN, WIDE = 4242424242, b"12345678901234567890123"  # an id past 64 bits, which orjson cannot write


@pytest.fixture(scope="module")
def tok(deepseek_tokenizer_path: str) -> Tokenizer:
    return Tokenizer.from_file(deepseek_tokenizer_path)


def _more(kit: Any, tok: Tokenizer) -> list[tuple[list[dict[str, Any]], int]]:
    """Ids the collector leaves as lists (nested, in attributes, signed, spaced) beside ones it keeps."""
    ids = tok.encode(TEXTS[2]).ids
    root = kit.new_id()
    return [([
        _span(kit, root, ids, {"token_ids": [0, *ids], "extra": {"response_ids": ids}, "logprobs_ids": [-1, 2]},
              attrs={"step": 2, "engine_ids": ids}),
        _span(kit, root, ids, [{"token_ids": ids}]),
        _span(kit, root, [1, 2, 3], {"token_ids": [WIDE_STANDIN], "response_ids": [7, 8]}),  # made wide when posted
    ], 2)]


def test_ids_kept_as_bytes_store_and_read_back_exactly_as_parsed_ids(collector_process, kit, tok, deepseek_tokenizer_path):
    bodies = _bodies(kit, tok) + _more(kit, tok)
    stored: dict[str, dict[str, tuple[Any, ...]]] = {}
    read: dict[str, list[Any]] = {}
    for name, settings, envelope in (("parsed", {"token2text": True, "tokenizer": deepseek_tokenizer_path}, {"token2text": False}),
                                     ("bytes", {"token2text": False}, {}),
                                     ("bytes, 2 workers", {"token2text": False, "workers": 2, "tokenizer": deepseek_tokenizer_path},
                                      {})):
        col = collector_process(port=kit.free_port(), log_level="warning", **settings).start()
        if settings.get("workers"):  # token2text off starts no pool: one batch that decodes does (then every body goes there)
            warm = _span(kit, kit.new_id(), [1, 2], {"token_ids": [3]})
            assert kit.post(col.url, [warm], token2text=True).json()["accepted"] == 1
            _wait_metric(col.url, "tracecar_workers", 2, timeout=90)
        for spans, v in bodies:
            body, headers = kit.encode(spans, v=v, **envelope)
            body = body.replace(b"[%d]" % WIDE_STANDIN, b"[" + WIDE + b"]")
            answer = httpx.post(col.url + "/v1/spans", content=body, headers=headers, timeout=10).json()
            assert answer["accepted"] == len(spans) and answer["rejected"] == [], (name, answer)
        assert scrape_metric(col.url, "tracecar_prompt_refs_total", outcome="resolved") >= 3
        if settings.get("workers"):  # parsed, and serialised, by the workers (prepare, and work for phase two)
            assert scrape_metric(col.url, "tracecar_batches_parsed_total", where="worker") == len(bodies)
            assert scrape_metric(col.url, "tracecar_worker_batches_total", path="worker") == len(bodies)
        trace = bodies[0][0][0]["trace_id"]
        read[name] = httpx.get(f"{col.url}/v1/trajectories/{trace}", timeout=10).json()  # the tree every reader serves
        assert col.terminate() in (0, -signal.SIGTERM)
        stored[name] = {sid: row for sid, row in _rows(Path(col.env["TRACECAR_DATA_DIR"])).items()
                        if not settings.get("workers") or sid != warm["span_id"]}
        os.rename(col.env["TRACECAR_DATA_DIR"], col.env["TRACECAR_DATA_DIR"] + f"-{len(stored)}")
    assert stored["parsed"] and stored["bytes"] == stored["parsed"]  # payloads, token arrays, warnings, counts, offsets
    assert stored["bytes, 2 workers"] == stored["parsed"]
    assert read["parsed"]["root"] and read["bytes"] == read["parsed"] and read["bytes, 2 workers"] == read["parsed"]
    spans = {sid: orjson.loads(row[0]) for sid, row in stored["bytes"].items()}
    assert any("$refs" in span for span in spans.values())  # growing prompts stored as references
    full_spans(spans.values(), None)  # the references rebuilt, in place, as every reader does
    whole = spans
    third = whole[bodies[2][0][0]["span_id"]]
    assert third["inputs"]["prompt_ids"][:len(tok.encode(TEXTS[0]).ids)] == tok.encode(TEXTS[0]).ids
    arrays = stored["bytes"][bodies[0][0][2]["span_id"]][1]
    assert arrays is not None  # per-token arrays packed, their ids from bytes
    odd = whole[bodies[-1][0][2]["span_id"]]
    assert odd["output"]["token_ids"] == [1.2345678901234568e22]  # past 64 bits: what orjson makes of it, as before
