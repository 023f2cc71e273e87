"""A gateway's forwarded batches (receivers/forwarded.py) get the body bounds /v1/spans has."""

from __future__ import annotations

import pytest

from tracecar.client.redact import RedactKeys
from tracecar.collector.receivers import receive
from tracecar.collector.receivers.forwarded import ForwardedRequest


def test_a_forwarded_body_of_tiny_containers_is_refused_before_it_is_parsed() -> None:
    """``{}`` is 2 bytes of JSON and 64 parsed: without the bound a 1 MiB body parses to ~32 MiB."""
    limit = 64 << 10
    request = ForwardedRequest("node-a", limit, 1000, RedactKeys([]))
    body = b'{"worker":"n","v":1,"spans":[],"pad":[' + b",".join([b"{}"] * (limit // 3)) + b"]}"
    with pytest.raises(receive.BodyError) as refused:
        request(body, "application/json", None)
    assert refused.value.status == 413 and "objects and arrays" in refused.value.reason
