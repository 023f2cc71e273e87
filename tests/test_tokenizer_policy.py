"""The tokenizer a batch names is the operator's choice, not the client's (issue 11, item 11).

A batch may name TRACECAR_TOKENIZER, a name in TRACECAR_TOKENIZERS, a file under
TRACECAR_TOKENIZER_ROOT, or a model in the local Hugging Face cache; anything else is refused
unread, as is a file over TRACECAR_TOKENIZER_MAX_BYTES. Failures are retried after
TRACECAR_TOKENIZER_RETRY_S, counted, and logged at most once a second, naming the tokenizer.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import orjson
import pytest

pytestmark = pytest.mark.timeout(120)


def _outputs(col: Any, spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ids = [s["span_id"] for s in spans if s["kind"] == "op"]
    rows = col.collector.spool.query(f"SELECT payload FROM spans WHERE span_id IN ({','.join('?' * len(ids))})", ids)
    return [orjson.loads(r["payload"]) for r in rows]


def _decoded(col: Any, spans: list[dict[str, Any]]) -> bool:
    return all("response_text" in p["output"] for p in _outputs(col, spans))


def _warnings(col: Any, spans: list[dict[str, Any]]) -> list[str]:
    return [w for p in _outputs(col, spans) for w in p.get("warnings", [])]


def test_a_batch_cannot_make_the_collector_read_an_arbitrary_file(start_collector, small_bpe_path, kit, tmp_path, caplog):
    secret = tmp_path / "elsewhere" / "tokenizer.json"
    secret.parent.mkdir()
    shutil.copy(small_bpe_path, secret)  # a real tokenizer, but not one the operator allowed
    # the operator's tokenizer is allowed by list, not as the default: a refused name then falls back
    # to nothing, so "not decoded" proves the copy was never read (see the fallback test below)
    col = start_collector(token2text=True, tokenizers=[small_bpe_path], tokenizer_retry_s=60)
    with caplog.at_level(logging.WARNING, logger="tracecar.collector.pipeline"):
        for name in (str(secret), str(secret.parent), "/etc/passwd", "../../etc/passwd"):
            spans = kit.trajectory(children=1)
            r = kit.post(col.url, spans, tokenizer=name)
            assert r.status_code == 200 and r.json()["accepted"] == 2, r.text  # the spans are kept, undecoded
            assert not _decoded(col, spans)
            assert any("refused" in w or "not found" in w for w in _warnings(col, spans)), _warnings(col, spans)
        for _ in range(5):  # the same refused name again: counted once per retry window, not per batch
            assert kit.post(col.url, kit.trajectory(children=1), tokenizer=str(secret)).status_code == 200
    refused = kit.metrics(col.url, "tracecar_tokenizer_refused_total")
    assert kit.metrics(col.url, "tracecar_tokenizer_refused_total", reason="not_allowed") == refused == 4
    assert kit.metrics(col.url, "tracecar_decode_failures_total", reason="tokenizer_not_allowed") == 4 + 5
    logged = [r for r in caplog.records if getattr(r, "event", None) == "tokenizer_refused"]
    assert 1 <= len(logged) <= 2 and logged[0].tokenizer == str(secret)  # rate-limited, names what was tried
    # the operator's own tokenizer still decodes
    spans = kit.trajectory(children=1)
    assert kit.post(col.url, spans, tokenizer=small_bpe_path).status_code == 200 and _decoded(col, spans)


def test_root_list_size_bound_and_retry(start_collector, small_bpe_path, kit, tmp_path):
    root = tmp_path / "models"
    (root / "qwen").mkdir(parents=True)
    shutil.copy(small_bpe_path, root / "qwen" / "tokenizer.json")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(small_bpe_path, outside / "tokenizer.json")
    listed = tmp_path / "listed" / "tokenizer.json"
    listed.parent.mkdir()
    shutil.copy(small_bpe_path, listed)
    (root / "escape").symlink_to(outside)  # a link out of the root is outside it
    huge = root / "huge" / "tokenizer.json"
    huge.parent.mkdir()
    with huge.open("wb") as f:  # 512 MiB, sparse: refused by size, never read
        f.truncate(512 * 2**20)
    col = start_collector(token2text=True, tokenizer_root=str(root), tokenizers=[str(listed)],
                          tokenizer_max_bytes=4 * 2**20, tokenizer_retry_s=0.5)

    for name, decoded in (("qwen", True), (str(root / "qwen"), True), (str(listed), True), ("escape", False),
                          (str(root / "qwen" / ".." / ".." / "outside"), False), (str(outside), False)):
        spans = kit.trajectory(children=1)
        assert kit.post(col.url, spans, tokenizer=name).status_code == 200
        assert _decoded(col, spans) is decoded, (name, _warnings(col, spans))

    spans = kit.trajectory(children=1)
    started = time.monotonic()
    assert kit.post(col.url, spans, tokenizer="huge").status_code == 200
    assert time.monotonic() - started < 2.0
    assert any("TRACECAR_TOKENIZER_MAX_BYTES" in w for w in _warnings(col, spans))
    assert kit.metrics(col.url, "tracecar_tokenizer_refused_total", reason="too_large") == 1

    # a tokenizer that is missing now and installed later is picked up after the retry delay
    spans = kit.trajectory(children=1)
    assert kit.post(col.url, spans, tokenizer="later").status_code == 200 and not _decoded(col, spans)
    (root / "later").mkdir()
    shutil.copy(small_bpe_path, root / "later" / "tokenizer.json")
    spans = kit.trajectory(children=1)
    assert kit.post(col.url, spans, tokenizer="later").status_code == 200 and not _decoded(col, spans)  # still cached
    time.sleep(0.6)
    spans = kit.trajectory(children=1)
    assert kit.post(col.url, spans, tokenizer="later").status_code == 200 and _decoded(col, spans)
    assert os.path.getsize(huge) == 512 * 2**20


def test_a_refused_or_missing_worker_tokenizer_falls_back_to_the_operators_default(start_collector, small_bpe_path, kit):
    """VERL names the model's tokenizer_path, which the sidecar may not see: TRACECAR_TOKENIZER decodes, said per span."""
    col = start_collector(token2text=True, tokenizer=small_bpe_path)
    for name in ("/models/Qwen2.5-7B", "/etc/passwd"):
        spans = kit.trajectory(children=1)
        assert kit.post(col.url, spans, tokenizer=name).status_code == 200
        assert _decoded(col, spans)
        assert any(name in w and "decoded with TRACECAR_TOKENIZER" in w for w in _warnings(col, spans)), _warnings(col, spans)


def test_aliases_of_one_tokenizer_are_loaded_once_and_loaded_tokenizers_are_bounded(small_bpe_path, tmp_path):
    """A client naming the same file many ways ("./t.json", "././t.json") must not load it again each time."""
    import shutil

    from tracecar.collector.processors.decoding import TokenizerPolicy, TokenizerRegistry

    root = tmp_path / "models"
    for i in range(4):
        (root / f"m{i}").mkdir(parents=True)
        shutil.copy(small_bpe_path, root / f"m{i}" / "tokenizer.json")
    registry = TokenizerRegistry(TokenizerPolicy(root=root), max_loaded=2)
    first = registry.get(str(root / "m0" / "tokenizer.json"))
    for alias in ("m0", "m0/tokenizer.json", "./m0/tokenizer.json", "m0/../m0/tokenizer.json", str(root / "m0")):
        assert registry.get(alias) is first, alias
    assert len(registry._loaded) == 1
    for i in range(4):
        registry.get(f"m{i}")
    assert len(registry._loaded) == 2  # the least recently used are let go
