"""POST /v1/spans takes JSON or msgpack, identity/gzip/deflate/zstd; bounds answer 413 by name."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import textwrap
import zlib
from array import array

import httpx
import msgpack
import orjson
import pytest
import zstandard

pytestmark = pytest.mark.timeout(120)


def span(sid: str, **extra: object) -> dict[str, object]:
    return {"span_id": sid, "trace_id": sid, "parent_id": None, "name": "agent_loop", "kind": "trajectory",
            "start_time": 1.0, "end_time": 2.0, "attributes": {"step": 1, "sample_index": 0}, **extra}


@pytest.mark.parametrize("content_type, encode", [
    ("application/json", orjson.dumps),
    ("application/msgpack", lambda v: msgpack.packb(v, use_bin_type=True)),
])
@pytest.mark.parametrize("encoding, compress", [
    (None, lambda b: b), ("gzip", gzip.compress), ("deflate", zlib.compress),
    ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
])
def test_formats_and_encodings_round_trip(start_collector, content_type, encode, encoding, compress):
    col = start_collector()
    sid = f"s{abs(hash((content_type, encoding))) % 10**9}"
    body = compress(encode({"v": 1, "worker": "w1", "spans": [span(sid, output={"response_ids": list(range(50))})]}))
    headers = {"Content-Type": content_type, **({"Content-Encoding": encoding} if encoding else {})}
    r = httpx.post(col.url + "/v1/spans", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["accepted"] == 1
    tree = httpx.get(f"{col.url}/v1/trajectories/{sid}").json()
    assert tree["root"]["output"]["response_ids"] == list(range(50))
    assert tree["root"]["worker"] == "w1"


def test_msgpack_packed_int32_ids_are_unpacked(start_collector):
    col = start_collector()
    ids = array("i", [5, 100_000, 7, 129_000])
    packed = msgpack.ExtType(1, ids.tobytes())
    body = msgpack.packb({"worker": "w", "spans": [span("p1", output={"prompt_ids": packed})]}, use_bin_type=True)
    r = httpx.post(col.url + "/v1/spans", content=body, headers={"Content-Type": "application/msgpack"})
    assert r.status_code == 200 and r.json()["accepted"] == 1
    assert httpx.get(col.url + "/v1/trajectories/p1").json()["root"]["output"]["prompt_ids"] == [5, 100_000, 7, 129_000]


def test_bounds_answer_413_naming_the_setting(start_collector):
    col = start_collector(max_body_bytes=4096, max_decompressed_bytes=8192, max_batch_spans=3)
    big = orjson.dumps({"worker": "w", "spans": [span("a", inputs={"x": "y" * 5000})]})
    r = httpx.post(col.url + "/v1/spans", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "TRACECAR_MAX_BODY_BYTES=4096" in r.json()["error"]["reason"]
    bomb = gzip.compress(b'{"worker": "w", "spans": [], "pad": "' + b"0" * 100_000 + b'"}')
    assert len(bomb) < 4096
    r = httpx.post(col.url + "/v1/spans", content=bomb, headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 413 and "TRACECAR_MAX_DECOMPRESSED_BYTES=8192" in r.json()["error"]["reason"]
    many = orjson.dumps({"worker": "w", "spans": [span(f"m{i}") for i in range(4)]})
    r = httpx.post(col.url + "/v1/spans", content=many, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["field"] == "spans" and "TRACECAR_MAX_BATCH_SPANS=3" in r.json()["error"]["reason"]
    r = httpx.post(col.url + "/v1/spans", content=b"x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["field"] == "Content-Type"
    r = httpx.post(col.url + "/v1/spans", content=b"x", headers={"Content-Type": "application/json", "Content-Encoding": "br"})
    assert r.status_code == 415 and r.json()["error"]["field"] == "Content-Encoding"
    r = httpx.post(col.url + "/v1/spans", content=b"", headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["accepted"] == 0
    assert httpx.get(col.url + "/v1/trajectories").json()["total"] == 0  # nothing of the refused bodies stored


def test_a_body_is_read_whole_with_or_without_a_content_length(start_collector):
    """With a Content-Length or chunked, the body is read whole: the same spans either way, and
    the size bound holds for both."""
    col = start_collector(max_body_bytes=256 * 1024)
    ids = list(range(20_000))  # ~110 KiB of JSON: many socket reads
    body = orjson.dumps({"v": 1, "worker": "w", "spans": [span("len1", output={"response_ids": ids})]})
    r = httpx.post(col.url + "/v1/spans", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["accepted"] == 1, r.text
    chunked = orjson.dumps({"v": 1, "worker": "w", "spans": [span("chunk1", output={"response_ids": ids})]})
    pieces = (chunked[i:i + 7_001] for i in range(0, len(chunked), 7_001))  # no Content-Length: chunked
    r = httpx.post(col.url + "/v1/spans", content=pieces, headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["accepted"] == 1, r.text
    for sid in ("len1", "chunk1"):
        assert httpx.get(f"{col.url}/v1/trajectories/{sid}").json()["root"]["output"]["response_ids"] == ids
    big = orjson.dumps({"v": 1, "worker": "w", "spans": [span("big1", output={"response_ids": list(range(60_000))})]})
    r = httpx.post(col.url + "/v1/spans", content=(big[i:i + 50_000] for i in range(0, len(big), 50_000)),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "TRACECAR_MAX_BODY_BYTES" in r.json()["error"]["reason"]


def test_mixed_batch_keeps_the_good_spans(start_collector):
    col = start_collector()
    spans = [span("good1"), span("bad1", attributes={"step": "one"}), {"span_id": "bad2"}, span("good2")]
    r = httpx.post(col.url + "/v1/spans", json={"worker": "w", "spans": spans})
    assert r.status_code == 200
    body = r.json()
    assert body["accepted"] == 2 and body["rejected_count"] == 2
    fields = {rej["span_id"]: rej for rej in body["rejected"]}
    assert fields["bad1"]["field"] == "spans[1].attributes.step" and "integer" in fields["bad1"]["reason"]
    assert fields["bad2"]["field"].startswith("spans[2].") and fields["bad2"]["index"] == 2
    assert {t["trace_id"] for t in httpx.get(col.url + "/v1/trajectories").json()["trajectories"]} == {"good1", "good2"}
    r = httpx.post(col.url + "/v1/spans", json={"worker": "w", "spans": [span("bad3", start_time="x")]})
    assert r.status_code == 422 and r.json()["rejected"][0]["field"] == "spans[0].start_time"
    r = httpx.post(col.url + "/v1/spans", json={"spans": []})
    assert r.status_code == 400 and r.json()["error"]["field"] == "worker"


def test_client_is_fork_safe(start_collector, tmp_path):
    """A forked child (Ray worker, dataloader) gets its own queue, thread, ids and connection."""
    col = start_collector()
    script = textwrap.dedent(f"""
        import os, sys
        from tracecar.client import rollout_trace_attr, rollout_trace_op, tracer
        tracer.configure(url={col.url!r}, flush_interval_s=0.02)

        @rollout_trace_op
        def work(x):
            return x + 1

        with rollout_trace_attr(sample_index=0, step=1, rollout_n=0):
            work(1)
        assert tracer.flush(10)
        pid = os.fork()
        with rollout_trace_attr(sample_index=1 if pid == 0 else 2, step=1, rollout_n=0):
            work(2)
        ok = tracer.flush(10) and tracer.get_tracer().stats()["dropped_total"] == 0
        if pid == 0:
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        sys.exit(0 if ok and os.waitstatus_to_exitcode(status) == 0 else 4)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TRACECAR_URL": ""})
    assert out.returncode == 0, out.stderr
    listing = httpx.get(col.url + "/v1/trajectories").json()["trajectories"]
    assert sorted(t["sample_index"] for t in listing) == [0, 1, 2]
    assert len({t["trace_id"] for t in listing}) == 3  # ids re-drawn after fork: no collisions
    assert len({t["worker"] for t in listing}) == 2  # the child reports as its own worker (host:pid)


@pytest.mark.parametrize("ids", [50, 300_000])  # ~0.2 KiB, and ~2.3 MiB: read into one buffer of its size, or grown
@pytest.mark.parametrize("chunked", [False, True])
def test_bodies_with_and_without_a_content_length_are_read_whole(start_collector, ids, chunked):
    """The body reader: a Content-Length up to 2 MiB is read into a buffer of that size, a larger
    one or a chunked body grows as it arrives; every byte arrives either way (the ids come back)."""
    col = start_collector()
    sid = f"b{ids}{int(chunked)}"
    body = orjson.dumps({"v": 1, "worker": "w1", "spans": [span(sid, output={"response_ids": list(range(ids))})]})

    def pieces():  # no Content-Length: httpx sends it chunked
        for at in range(0, len(body), 65536):
            yield body[at:at + 65536]
    r = httpx.post(col.url + "/v1/spans", content=pieces() if chunked else body,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200 and r.json()["accepted"] == 1, r.text
    stored = httpx.get(col.url + f"/v1/trajectories/{sid}", timeout=60).json()
    assert stored["root"]["output"]["response_ids"] == list(range(ids))
