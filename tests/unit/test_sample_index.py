"""client/tracing.py: a sample index the collector can budget by, whatever numeric type a dataset gave it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tracecar.client.tracing import _index


@pytest.mark.parametrize(("given", "sent"), [
    (12.0, 12), (12.5, "12.5"), (float("nan"), "nan"), (float("inf"), "inf"),
    (np.float64(4.0), 4), (np.int64(3), 3), (np.int32(-7), -7),
    (2.0**70, str(2.0**70)), (2**70, str(2**70)), (2**63 - 1, 2**63 - 1),  # past 64 bits: its text, never refused
    (7, 7), ("a-12", "a-12"), (None, None),
])
def test_a_sample_index_is_sent_as_an_int_within_64_bits_or_as_text(given: Any, sent: Any) -> None:
    got = _index(given)
    assert got == sent and type(got) is type(sent)
