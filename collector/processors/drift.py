"""Drift between turns: does turn k+1's prompt extend turn k's prompt + response exactly?

A multi-turn agent loop that re-renders the conversation each turn (a chat template that drops
an earlier turn's reasoning, a tokenizer round trip that re-splits the generated text) hands
the engine a prompt whose earlier part is not the ids generated before. The trainer then
masks and scores tokens the policy never produced (rLLM #352, Agent Lightning's
``trace_merge_mismatches``). This module compares two id lists and says where they part.

The comparison is one C-level list compare in the common case (the prompt does extend the
context: ``prompt[:n] == context``); only a drifting turn pays for locating the cut (a
bisection of slice compares) and counting the ids that differ (difflib over a bounded window).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

WINDOW_IDS = 16  # ids kept on each side of the cut (decoded on read for the viewer)
BEFORE_IDS = 8  # shared ids kept before the cut
COUNT_WINDOW = 4096  # ids after the cut compared to count how many differ (a bound on difflib's work)


@dataclass
class Drift:
    """How turn k+1's prompt relates to turn k's context (prompt + response)."""

    extends: bool
    at: int | None = None  # the first position where the prompt differs from the context (None: extends)
    differing: int = 0  # ids of the context not reproduced in the prompt (changed or dropped)
    inserted: int = 0  # ids the prompt has in their place (a replaced tail counts what follows it too)
    capped: bool = False  # the count stopped at COUNT_WINDOW ids past the cut
    context_len: int = 0
    prompt_len: int = 0
    before: list[int] | None = None  # the shared ids just before the cut
    was: list[int] | None = None  # the context's ids from the cut
    now: list[int] | None = None  # the prompt's ids from the cut

    def as_dict(self) -> dict[str, Any]:
        return {"extends": self.extends, "at": self.at, "differing": self.differing, "inserted": self.inserted,
                "capped": self.capped, "context_len": self.context_len, "prompt_len": self.prompt_len,
                "before": self.before, "was": self.was, "now": self.now}


def first_difference(a: list[Any], b: list[Any]) -> int:
    """The first index where ``a`` and ``b`` differ (``min(len)`` when one is a prefix of the other).

    Bisection over slice compares: O(n) C work with O(log n) Python steps, not a Python loop per id.
    """
    n = min(len(a), len(b))
    low, high = 0, n  # a[:low] == b[:low] holds; the difference is in [low, high]
    if a[:n] == b[:n]:
        return n
    while high - low > 32:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    while low < high and a[low] == b[low]:
        low += 1
    return low


def compare(context: list[Any], prompt: list[Any]) -> Drift:
    """Does ``prompt`` start with the whole ``context``? If not, where and by how much it differs."""
    n = len(context)
    if len(prompt) >= n and prompt[:n] == context:
        return Drift(True, context_len=n, prompt_len=len(prompt))
    at = first_difference(context, prompt)
    tail = context[at:at + COUNT_WINDOW]
    # the prompt's part in the context's place: as long as the rest of the context plus what the
    # turn appended, bounded; difflib finds which of the context's ids it reproduces
    there = prompt[at:at + len(tail) + WINDOW_IDS * 4]
    matcher = difflib.SequenceMatcher(None, tail, there, autojunk=False)
    kept = sum(block.size for block in matcher.get_matching_blocks())
    differing = len(tail) - kept
    # the prompt's ids put in place of the context's (not what it appends after the context's end)
    inserted = sum(j2 - j1 for tag, i1, _, j1, j2 in matcher.get_opcodes() if tag in ("replace", "insert") and i1 < len(tail))
    return Drift(False, at=at, differing=differing, inserted=inserted, capped=len(context) - at > COUNT_WINDOW,
                 context_len=n, prompt_len=len(prompt), before=list(context[max(0, at - BEFORE_IDS):at]),
                 was=list(context[at:at + WINDOW_IDS]), now=list(prompt[at:at + WINDOW_IDS]))
