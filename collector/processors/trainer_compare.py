"""What the trainer trained on, against what the rollout generated (issue 29 item 2).

The trainer hook (tracecar.client.integrations.verl_tokens) sends, for each trajectory the trainer kept, its
row of VERL's batch: ``prompt_ids`` / ``response_ids`` (the trained sequence), ``mask``
(``response_mask``: the tokens the loss covers), ``old_log_probs`` (and ``ref_log_prob``,
``entropy`` when present), as little-endian base64 arrays in an annotation's
``attributes.trainer_tokens``. Three questions, answered from the rollout's own turns (each
LLM call's prompt ids, generated ids and the engine's log-probabilities):

* **ids equal**: is the trained sequence the rollout's final context (last prompt + last
  response)? Else where the first id differs and how many differ (processors/drift.py).
* **mask covers exactly the generated tokens**: the generated tokens of turn k sit, in the trained
  sequence, right after turn k's prompt when that prompt + response is a prefix of it. ``extra``
  counts trained tokens the policy did not generate there (tool output, a mask off by one, a
  re-rendered turn), ``missing`` generated tokens the loss does not cover, ``absent`` generated
  tokens not in the trained sequence at all (a turn re-rendered away).
* **|Δ logprob|**: per generated token the trainer trained on, the engine's log-probability vs
  the trainer's ``old_log_probs``: mean, p99, max, and a fixed log-spaced histogram so a step's
  p99 merges from its trajectories' without reading their tokens.
"""

from __future__ import annotations

import binascii
import math
import sys
from array import array
from dataclasses import dataclass, field
from typing import Any

from .drift import compare

TYPES = {"prompt_ids": "i", "response_ids": "i", "mask": "B", "old_log_probs": "f", "ref_log_prob": "f", "entropy": "f",
         "rollout_log_probs": "f"}
REQUIRED = ("response_ids", "mask", "old_log_probs")
MAX_TOKENS = 1 << 20  # per array
# |Δ| histogram: bin 0 is exactly 0 (below 1e-7), then 40 log-spaced bins from 1e-7 to 10, then above 10
HIST_LOW, HIST_HIGH, HIST_BINS = 1e-7, 10.0, 40
_LOG_LOW, _LOG_SPAN = math.log10(HIST_LOW), math.log10(HIST_HIGH) - math.log10(HIST_LOW)


def _raw(key: str, value: Any) -> bytes:
    """One base64 array's bytes, checked (type, base64, whole values, bound)."""
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a base64 string of little-endian {TYPES[key]} values")
    try:
        raw = binascii.a2b_base64(value)  # C, no regex pass (a stray character shows as a length that does not add up)
    except (binascii.Error, ValueError):
        raise ValueError(f"{key} is not valid base64") from None
    size = array(TYPES[key]).itemsize
    if len(raw) % size:
        raise ValueError(f"{key}: {len(raw)} bytes is not a whole number of {size}-byte values")
    if len(raw) // size > MAX_TOKENS:
        raise ValueError(f"{key} holds {len(raw) // size} values, more than {MAX_TOKENS}")
    return raw


def decode_array(key: str, value: Any) -> list[Any]:
    """One base64 array of ``trainer_tokens`` as a list; ValueError says what is wrong."""
    values = array(TYPES[key])
    values.frombytes(_raw(key, value))
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def check(value: Any) -> None:
    """Validates ``trainer_tokens`` at ingest without unpacking it (base64 and lengths only: ~10 µs a
    thousand tokens); ValueError names the key at fault. The index unpacks it (:meth:`TrainerTokens.of`)."""
    if not isinstance(value, dict):
        raise ValueError("must be an object of base64 arrays")
    missing = [k for k in REQUIRED if k not in value]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    counts = {k: len(_raw(k, value[k])) // array(TYPES[k]).itemsize for k in TYPES if value.get(k) is not None}
    n = counts["response_ids"]
    for key in ("mask", "old_log_probs", "ref_log_prob", "entropy", "rollout_log_probs"):
        if key in counts and counts[key] != n:
            raise ValueError(f"{key} has {counts[key]} values for {n} response_ids")


@dataclass
class TrainerTokens:
    prompt_ids: list[int] | None
    response_ids: list[int]
    mask: list[int]
    old_log_probs: list[float]
    ref_log_prob: list[float] | None = None
    entropy: list[float] | None = None

    @classmethod
    def of(cls, value: Any) -> TrainerTokens:
        """From ``attributes.trainer_tokens``; ValueError names the key at fault."""
        if not isinstance(value, dict):
            raise ValueError("must be an object of base64 arrays")
        missing = [k for k in REQUIRED if k not in value]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        arrays = {k: decode_array(k, value[k]) for k in TYPES if value.get(k) is not None}
        n = len(arrays["response_ids"])
        for key in ("mask", "old_log_probs", "ref_log_prob", "entropy"):
            if key in arrays and len(arrays[key]) != n:
                raise ValueError(f"{key} has {len(arrays[key])} values for {n} response_ids")
        return cls(arrays.get("prompt_ids"), arrays["response_ids"], arrays["mask"], arrays["old_log_probs"],
                   arrays.get("ref_log_prob"), arrays.get("entropy"))


@dataclass
class Turn:
    prompt: list[int]
    response: list[int]
    logprobs: list[float] | None


@dataclass
class Comparison:
    ids_equal: bool
    first_diff: int | None = None
    ids_differing: int = 0
    mask_extra: int = 0
    mask_missing: int = 0
    absent: int = 0
    lp_compared: int = 0
    lp_mean: float | None = None
    lp_p99: float | None = None
    lp_max: float | None = None
    hist: list[int] = field(default_factory=list)
    trainer_lp: list[float] = field(default_factory=list)  # per generated token (turn order); NaN where not trained on
    was: list[int] | None = None  # the rollout's ids from the first difference
    now: list[int] | None = None  # the trainer's

    @property
    def mismatch(self) -> bool:
        return not self.ids_equal or self.mask_extra > 0 or self.mask_missing > 0 or self.absent > 0


def histogram(deltas: list[float]) -> list[int]:
    hist = [0] * (HIST_BINS + 2)
    for d in deltas:
        if d < HIST_LOW:
            hist[0] += 1
        elif d >= HIST_HIGH:
            hist[-1] += 1
        else:
            hist[1 + min(HIST_BINS - 1, int((math.log10(d) - _LOG_LOW) / _LOG_SPAN * HIST_BINS))] += 1
    return hist


def bin_upper(i: int) -> float:
    """The upper edge of histogram bin ``i`` (a quantile read from it is at most this)."""
    if i == 0:
        return HIST_LOW
    if i > HIST_BINS:
        return math.inf
    return float(10 ** (_LOG_LOW + _LOG_SPAN * i / HIST_BINS))


def hist_quantile(hist: list[int], q: float) -> float | None:
    total = sum(hist)
    if not total:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(hist):
        seen += n
        if seen >= rank:
            return bin_upper(i)
    return bin_upper(len(hist) - 1)


def compare_trainer(turns: list[Turn], trainer: TrainerTokens) -> Comparison:
    """The trained row against the rollout's turns (in start order)."""
    last = turns[-1]
    rollout_seq = last.prompt + last.response
    prompt = trainer.prompt_ids if trainer.prompt_ids is not None else turns[0].prompt
    trained_seq = prompt + trainer.response_ids
    out = Comparison(ids_equal=trained_seq == rollout_seq)
    if not out.ids_equal:
        ids = compare(rollout_seq, trained_seq)
        if ids.extends:  # the trained sequence goes on past the rollout's end
            out.first_diff, out.ids_differing = len(rollout_seq), len(trained_seq) - len(rollout_seq)
            out.was, out.now = [], trained_seq[len(rollout_seq):len(rollout_seq) + 16]
        else:
            out.first_diff, out.ids_differing = ids.at, max(ids.differing, ids.inserted)
            out.was, out.now = ids.was, ids.now
    # where each turn's generated tokens sit in the trained response (when the turn's context is a prefix of it)
    base = len(prompt)
    expected: dict[int, tuple[int, float | None]] = {}  # response position -> (generated index, engine logprob)
    generated = 0
    for turn in turns:
        start = len(turn.prompt)
        end = start + len(turn.response)
        placed = end <= len(trained_seq) and trained_seq[start:end] == turn.response and trained_seq[:start] == turn.prompt
        for j in range(len(turn.response)):
            if placed and start + j >= base:
                lp = turn.logprobs[j] if turn.logprobs is not None and j < len(turn.logprobs) else None
                expected[start + j - base] = (generated + j, lp)
            else:
                out.absent += 1
        generated += len(turn.response)
    masked = {j for j, m in enumerate(trainer.mask) if m}
    out.mask_extra = len(masked - expected.keys())
    out.mask_missing = len(expected.keys() - masked)
    out.trainer_lp = [math.nan] * generated
    deltas = []
    for j in sorted(masked & expected.keys()):
        index, lp = expected[j]
        mine = trainer.old_log_probs[j]
        out.trainer_lp[index] = mine
        if lp is not None and math.isfinite(lp) and math.isfinite(mine):
            deltas.append(abs(mine - lp))
    if deltas:
        ordered = sorted(deltas)
        out.lp_compared, out.lp_mean, out.lp_max = len(ordered), sum(ordered) / len(ordered), ordered[-1]
        out.lp_p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
        out.hist = histogram(ordered)
    return out
