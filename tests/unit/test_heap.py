"""collector/heap.py: a usual body's parse buffer is reused warm, a large one is not kept."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import json, resource, sys
    import orjson
    from tracecar.collector.heap import HEAP, WARM_BODY_MAX
    configured = HEAP.configure()
    small = orjson.dumps({"spans": [{"ids": list(range(i, i + 2000))} for i in range(80)]})  # ~0.8 MiB
    large = orjson.dumps({"spans": [{"ids": list(range(i, i + 2000))} for i in range(300)]})  # ~3 MiB
    assert len(small) <= WARM_BODY_MAX < len(large), (len(small), len(large))

    def faults(body, parse=lambda b: HEAP.parse(orjson.loads, b)):
        assert parse(body) == orjson.loads(body)  # same result either way
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            parse(body)
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5

    plain = faults(small, orjson.loads)  # first: before any warm parse left its buffer in the heap
    print(json.dumps({"configured": configured, "small_plain": plain, "small": faults(small),
                      "large": faults(large), "trim": HEAP.release_retained()}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_a_usual_body_is_parsed_without_faulting_in_a_fresh_buffer_and_a_large_one_is_returned() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    if not got["configured"]:
        pytest.skip("not glibc")
    # a fresh mmap of the ~10 MB parse buffer faults in ~700 pages per parse (small_plain: orjson.loads outside the
    # warm window); reused warm, none of those. The parsed objects' own faults come on top of both (Python 3.11's
    # object arenas stay: ~0; 3.10 returns its 256 KiB arenas: ~245 a parse), so the test compares the two.
    assert got["small"] + 400 < got["small_plain"], got
    # a body over WARM_BODY_MAX: its ~36 MB buffer is its own mmap, returned (faulted in again) each time
    assert got["large"] > 500, got
    assert got["trim"] is False  # the first request sets the floor; nothing is trimmed


def test_the_clients_default_body_fits_the_warm_parse_window() -> None:
    """A body closes with at most one span past TRACECAR_BATCH_MAX_BYTES: the default leaves room for a
    256 KiB span (~40,000 ids) so that a default-size body is parsed warm, not in fresh mmapped memory."""
    from tracecar.client.config import ClientConfig
    from tracecar.collector.heap import WARM_BODY_MAX

    assert ClientConfig().batch_max_bytes + 256 * 2**10 <= WARM_BODY_MAX
