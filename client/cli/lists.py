"""``tracecar trajectories``: the stored trajectories, filtered, as a table (also the quickstart's last word)."""

from __future__ import annotations

import argparse
from typing import Any

from .common import get_json, show

# GET /v1/trajectories' sorts (the collector's viewer index, collector/viewer/index.py SORTS; a test keeps them equal)
LIST_SORTS = ("start", "reward", "turns", "duration", "step", "sample_index", "rollout_n", "tools", "tokens", "spans",
              "advantage")


def cmd_trajectories(args: argparse.Namespace) -> None:
    from .truth import list_params

    params = {k: v for k, v in {
        "experiment": args.experiment, "step": args.step, "step_min": args.step_min, "step_max": args.step_max,
        "sample_index": args.sample_index, "rollout_n": args.rollout_n, "validate": args.validate,
        "kept_because": args.kept_because, "worker": args.worker, "node": args.node, "has_error": args.has_error,
        "reward_min": args.reward_min, "reward_max": args.reward_max, "sort": args.sort, "order": args.order,
        "limit": args.limit, "offset": args.offset, "trained": args.trained, "filtered_by": args.filtered_by,
        "q": args.search, "attr": args.attr, **list_params(args),
    }.items() if v is not None}
    show(args, get_json(args, "/v1/trajectories", params), print_trajectories)


def print_trajectories(page: dict[str, Any]) -> None:
    from .truth import truth_words

    print(f"{page['total']} trajectories (showing {len(page['trajectories'])} from offset {page['offset']})")
    print(f"{'trace_id':34} {'experiment':20} {'step':>4} {'idx':>4} {'n':>3} {'spans':>5} {'reward':>7} {'err':>3}  trainer")
    for t in page["trajectories"]:
        reward = "" if t["reward"] is None else f"{t['reward']:.3f}"
        print(f"{t['trace_id']:34} {str(t['experiment'])[:20]:20} {t['step'] if t['step'] is not None else '':>4} "
              f"{t['sample_index'] if t['sample_index'] is not None else '':>4} {t['rollout_n'] if t['rollout_n'] is not None else '':>3} "
              f"{t['span_count']:>5} {reward:>7} {'yes' if t['has_error'] else '':>3}  {trainer_status(t)}{truth_words(t)}")
        for role in ("prompt", "response"):  # a search's answer carries the texts it matched
            text = t.get(f"{role}_preview")
            if text:
                print(f"    {role:8} {one_line(text, 100)}")


def one_line(text: str, chars: int) -> str:
    """A preview on one line: its beginning (the last user message), or its end when it is already an end ("…")."""
    line = " ".join(text.split())
    if len(line) <= chars:
        return line
    return "…" + line[-(chars - 1):] if line.startswith("…") else line[:chars - 1] + "…"


def trainer_status(t: dict[str, Any]) -> str:
    """What the trainer did with it (client.annotate), in a few words; empty when not told."""
    if t.get("trained") is None and t.get("filtered_by") is None:
        return ""
    words = ["trained" if t.get("trained") else f"dropped ({t.get('filtered_by') or 'by the trainer'})"]
    if t.get("advantage") is not None:
        words.append(f"adv {t['advantage']:+.3f}")
    if t.get("policy_version") is not None and t.get("trained_on_version") is not None:
        words.append(f"staleness {t['trained_on_version'] - t['policy_version']}")
    return ", ".join(words)
