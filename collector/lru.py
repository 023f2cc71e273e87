"""A bounded mapping for what a collector remembers about recent traces (verdicts, routes)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class Lru(OrderedDict):
    """A bounded mapping that forgets its least recently set entries."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.size:
            self.popitem(last=False)
