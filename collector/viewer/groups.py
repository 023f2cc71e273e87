"""GRPO group view: one step's rollouts per sample index, ranked, with group statistics and diffs.

GRPO normalises each rollout's reward by its group's (the ``rollout_n`` rollouts of one prompt)
mean and std, so a group whose rewards are all equal has zero advantage everywhere and teaches
nothing. An engineer asks per group: which rollout won, by how much, is the group informative
at all, and where did the losers depart from the winner. This module answers that from the
viewer's trajectory index (one row per trajectory: reward, turns, tools) and, for the groups
of one page only, from the stored trajectories (turn texts and tool calls for the diffs).

``sample_index`` is an opaque key (int or string): groups are matched and sorted by it
without arithmetic.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from ..chat_preview import last_user_message
from ..shape import RESPONSE_ID_KEYS, int_list, numeric, shape
from .truth import separation

GROUP_SORTS = ("sample_index", "spread", "zero_spread", "mean")
PREVIEW_CHARS = 4000  # of the group's prompt, as decoded (what the rollouts are compared against)
QUESTION_CHARS = 2000  # of its last user message (chat_preview), what the rollouts answer
EQUAL_TOLERANCE = 1e-9  # rewards closer than this count as equal (float noise from reward functions)


def key_order(value: Any) -> tuple[int, Any]:
    """A total order over opaque sample indices: ints numerically, then strings, then None."""
    if value is None:
        return (2, "")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, value)
    return (1, str(value))


def same_key(value: Any, wanted: str) -> bool:
    """``sample_index`` from a query string (always text) against a stored int or string."""
    return value is not None and str(value) == wanted


_FLOAT_SAFE = 1e150  # rewards below this in size: their squares and sums stay finite


@dataclass
class GroupStats:
    n: int
    scored: int
    mean: float | None
    std: float | None
    min: float | None
    max: float | None
    spread: float | None
    all_equal: bool
    sampled_out: int = 0  # rollouts of this group a budget dropped (the step's decision records)
    total: int = 0  # rollouts the group had: n kept + sampled_out
    partial: bool = False  # some rollouts sampled out: not flagged all-equal, no std (nor advantage)

    @classmethod
    def of(cls, n: int, rewards: list[float], sampled_out: int = 0) -> GroupStats:
        """``std`` is the sample std (Bessel-corrected, as GRPO's ``torch.std``); None below 2 rewards.

        A partial group (``sampled_out`` > 0) keeps its mean, min and max of what was kept, but is
        never flagged all-equal nor given a std: GRPO scored it on rollouts that are not here.
        """
        whole = cls._of(n, rewards)
        if sampled_out <= 0:
            whole.total = n
            return whole
        whole.std, whole.all_equal = None, False
        whole.sampled_out, whole.total, whole.partial = sampled_out, n + sampled_out, True
        return whole

    @classmethod
    def _of(cls, n: int, rewards: list[float]) -> GroupStats:
        if not rewards:
            return cls(n, 0, None, None, None, None, None, False)
        if max(map(abs, rewards)) < _FLOAT_SAFE:
            mean = sum(rewards) / len(rewards)
            std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) if len(rewards) > 1 else None
        else:  # any finite reward is accepted; squares past ~1e154 overflow: exact arithmetic
            mean = statistics.mean(rewards)
            try:
                std = statistics.stdev(rewards) if len(rewards) > 1 else None
            except OverflowError:  # the std itself is past a double
                std = math.inf
        low, high = min(rewards), max(rewards)
        return cls(n, len(rewards), mean, std, low, high, high - low, high - low <= EQUAL_TOLERANCE)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def group_rows(rows: Iterable[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    """Trajectory summaries of one step by sample index (the opaque key as stored)."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row.get("sample_index"), []).append(row)
    return groups


def order_groups(groups: dict[Any, GroupStats], sort: str) -> list[Any]:
    """Group keys in the asked order; groups without any reward always last."""
    keys = list(groups)
    if sort == "spread":  # widest first: the groups GRPO learns most from
        keys.sort(key=lambda k: (groups[k].spread is None, -(groups[k].spread or 0.0), key_order(k)))
    elif sort == "zero_spread":  # all-equal groups first (they carry no signal), then the narrowest
        keys.sort(key=lambda k: (groups[k].spread is None, not groups[k].all_equal, groups[k].spread or 0.0, key_order(k)))
    elif sort == "mean":  # best prompts first
        keys.sort(key=lambda k: (groups[k].mean is None, -(groups[k].mean or 0.0), key_order(k)))
    else:
        keys.sort(key=key_order)
    return keys


def rank(rollouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Best first: reward, then advantage, then rollout number; unscored last."""
    def sort_key(r: dict[str, Any]) -> tuple[Any, ...]:
        reward, advantage = r.get("reward"), r.get("advantage")
        return (reward is None, -(reward or 0.0), advantage is None, -(advantage or 0.0), key_order(r.get("rollout_n")))
    ordered = sorted(rollouts, key=sort_key)
    for number, rollout in enumerate(ordered, 1):
        rollout["rank"] = number
    return ordered


# ---- turns and their diff ----------------------------------------------------------------------
def _spans_by_id(span: dict[str, Any], into: dict[Any, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    stack = [span]
    while stack:
        current = stack.pop()
        into[current.get("span_id")] = current
        stack.extend(current.get("children") or ())
    return into


def advantage_of(tree: dict[str, Any]) -> float | None:
    """The trainer's advantage if a span carries it: the latest annotation's, else the root's."""
    found = None
    for note in tree.get("annotations") or ():  # stored oldest first: the latest value wins
        value = numeric((note.get("attributes") or {}).get("advantage"))
        if value is not None:
            found = value
    if found is None:
        found = numeric((tree["root"].get("attributes") or {}).get("advantage"))
    return found


def turn_facts(tree: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per turn what a diff compares (response text or ids, tool calls made after it); the shaped view."""
    view = shape(tree)
    spans = _spans_by_id(tree["root"], {})
    facts = []
    for turn in view["turns"]:
        output = (spans.get(turn["span_id"]) or {}).get("output") or {}
        ids = next((int_list(output.get(k)) for k in RESPONSE_ID_KEYS if int_list(output.get(k)) is not None), None)
        calls = [(e["name"], _canonical(e.get("arguments"))) for e in turn["after"] if e["type"] == "tool"]
        results = [(_canonical(e.get("result")), e.get("error")) for e in turn["after"] if e["type"] == "tool"]
        facts.append({"text": turn.get("response_text"), "ids": ids, "calls": calls, "results": results})
    return facts, view


def _canonical(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return repr(value)


def _common_prefix(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    i = 0
    while i < limit and a[i] == b[i]:
        i += 1
    return i


def diff_turns(rollout: list[dict[str, Any]], best: list[dict[str, Any]]) -> dict[str, Any]:
    """Turn-by-turn summary of one rollout against its group's best (aligned by turn number).

    Per turn: ``response`` is same/different (text when decoded, else token ids; ``unknown``
    when neither side has either), ``tool_calls`` same/different (names and arguments),
    ``tool_results`` same/different; ``common_prefix_chars`` says where the response text
    departs; a turn only one side has is ``missing`` (best has it) or ``extra``.
    """
    turns = []
    first = None
    for i in range(max(len(rollout), len(best))):
        number = i + 1
        if i >= len(rollout) or i >= len(best):
            turns.append({"turn": number, "status": "missing" if i >= len(rollout) else "extra"})
            first = number if first is None else first
            continue
        mine, theirs = rollout[i], best[i]
        entry: dict[str, Any] = {"turn": number}
        if mine["text"] is not None and theirs["text"] is not None:
            entry["response"] = "same" if mine["text"] == theirs["text"] else "different"
            entry["common_prefix_chars"] = _common_prefix(mine["text"], theirs["text"])
        elif mine["ids"] is not None and theirs["ids"] is not None:
            entry["response"] = "same" if mine["ids"] == theirs["ids"] else "different"
        else:
            entry["response"] = "unknown"
        entry["tool_calls"] = "same" if mine["calls"] == theirs["calls"] else "different"
        entry["tool_results"] = "same" if mine["results"] == theirs["results"] else "different"
        differs = entry["response"] == "different" or entry["tool_calls"] == "different" or entry["tool_results"] == "different"
        entry["status"] = "different" if differs else "same"
        if differs and first is None:
            first = number
        turns.append(entry)
    return {"identical": first is None, "first_differing_turn": first, "turns": turns}


def build_groups(rows: list[dict[str, Any]], load: Callable[[str], dict[str, Any] | None], *, sort: str = "sample_index",
                 sample_index: str | None = None, limit: int = 50, offset: int = 0, diff: bool = True,
                 sampled_out: dict[str, int] | None = None) -> dict[str, Any]:
    """Groups of one step from its trajectory summaries; ``load`` reads one stored trajectory.

    Statistics and order come from the summaries (every group of the step); trajectories are
    loaded only for the groups of the page asked for, so a page costs its groups, not the step.
    ``sampled_out``: rollouts a budget dropped, by sample index as text (those groups are partial).
    """
    grouped = group_rows(rows)
    if sample_index is not None:
        grouped = {k: v for k, v in grouped.items() if same_key(k, sample_index)}
    dropped = sampled_out or {}
    stats = {k: GroupStats.of(len(v), [r["reward"] for r in v if r.get("reward") is not None],
                              dropped.get(str(k), 0) if k is not None else 0) for k, v in grouped.items()}
    keys = order_groups(stats, sort)
    page = []
    for key in keys[offset:offset + limit]:
        page.append(_group(key, grouped[key], stats[key], load, diff))
    return {
        "sort": sort, "total_groups": len(keys), "limit": limit, "offset": offset,
        "all_equal_groups": sum(1 for s in stats.values() if s.all_equal),
        "unscored_groups": sum(1 for s in stats.values() if s.scored == 0),
        "partial_groups": sum(1 for s in stats.values() if s.partial),
        "trajectories": sum(s.n for s in stats.values()),
        "groups": page,
    }


def _group(key: Any, rows: list[dict[str, Any]], stats: GroupStats, load: Callable[[str], dict[str, Any] | None],
           diff: bool) -> dict[str, Any]:
    rollouts, facts, prompt, question = [], {}, None, None
    for row in rows:
        tree = load(row["trace_id"])
        advantage = advantage_of(tree) if tree is not None else None
        if tree is not None and diff:
            facts[row["trace_id"]], view = turn_facts(tree)
            if prompt is None and view["turns"] and view["turns"][0].get("prompt_text"):
                full = view["turns"][0]["prompt_text"]
                prompt, question = full[:PREVIEW_CHARS], last_user_message(full)
        rollouts.append({
            "trace_id": row["trace_id"], "rollout_n": row.get("rollout_n"), "reward": row.get("reward"),
            "advantage": advantage, "turns": row.get("turns"), "tool_calls": row.get("tool_calls"),
            "tool_errors": row.get("tool_errors"), "has_error": row.get("has_error"),
            "kept_because": row.get("kept_because"), "duration": row.get("duration"),
            "response_tokens": row.get("response_tokens"),
            "reward_components": row.get("reward_components") or {}, "drift_turns": row.get("drift_turns"),
            **{k: row.get(k) for k in ("fate", "fate_reason", "refill_of", "min_global_steps", "max_global_steps", "staleness",
                                  "tt_mismatch", "lp_max")},
        })
    ordered = rank(rollouts)
    best = ordered[0] if ordered and ordered[0]["reward"] is not None else None
    mean, std = stats.mean, stats.std
    for rollout in ordered:
        rollout["is_best"] = best is not None and rollout is best
        # what GRPO would compute from these rewards (VERL: (r - mean) / (std + 1e-6)); None when unknown
        rollout["group_advantage"] = (None if rollout["reward"] is None or mean is None or std is None
                                      else (rollout["reward"] - mean) / (std + 1e-6))
        if diff and best is not None and rollout["trace_id"] in facts and best["trace_id"] in facts:
            rollout["diff"] = None if rollout["is_best"] else diff_turns(facts[rollout["trace_id"]], facts[best["trace_id"]])
    return {"sample_index": key, **stats.as_dict(), "best": best["trace_id"] if best else None,
            "prompt_preview": prompt, "prompt_question": None if question is None else question[:QUESTION_CHARS],
            "rollouts": ordered, "separation": separation(ordered)}
