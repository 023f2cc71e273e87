"""``tracecar truth TRACE_ID``: a trajectory's training truth (issue 29), from ``/v1/trajectories/{id}/truth``.

Per turn whether its prompt extends the previous turn's prompt + response (and where it parts,
with the text on both sides of the cut), the reward's components and the ground truth.
``tracecar trajectories --drift true --where acc=0`` lists by the same facts. ``--json`` prints the API's answer.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _cli() -> Any:
    from . import cli  # shared URL/token/error helpers (imported late: cli imports us)

    return cli


def _text(value: Any, ids: Any) -> str:
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else f"ids {ids}"


def print_truth(answer: dict[str, Any]) -> None:
    print(f"trajectory {answer['trace_id']}")
    checked, drifted = answer.get("drift_checked"), answer.get("drift_turns")
    if not checked:
        print("  drift: single turn (nothing to compare)")
    else:
        print(f"  drift: {drifted} of {checked} turns do not extend the turn before" if drifted else
              f"  drift: none ({checked} turn(s) each extend the turn before exactly)")
    for turn in answer.get("turns", []):
        label = f"turn {turn['turn']}" if turn.get("turn") is not None else turn["span_id"]
        if turn.get("extends"):
            print(f"    {label}: extends the previous turn")
            continue
        print(f"    {label}: DRIFT at token {turn['at']} of {turn['context_len']}: {turn['differing']}"
              f"{'+' if turn.get('capped') else ''} ids not reproduced, {turn['inserted']} in their place")
        print(f"      before the cut: {_text(turn.get('before_text'), turn.get('before'))}")
        print(f"      previous turn : {_text(turn.get('was_text'), turn.get('was'))}")
        print(f"      this prompt   : {_text(turn.get('now_text'), turn.get('now'))}")
    parts = answer.get("reward_components") or {}
    reward = (answer.get("summary") or {}).get("reward")
    print(f"  reward: {'—' if reward is None else f'{reward:.4f}'}" + (
        "  (" + ", ".join(f"{k}={v}" for k, v in parts.items()) + ")" if parts else ""))
    if answer.get("ground_truth") is not None:
        print(f"  ground truth: {answer['ground_truth']}")


def truth_words(t: dict[str, Any]) -> str:
    """A list row's truth in a few words (``tracecar trajectories``)."""
    words = []
    if t.get("drift_turns"):
        words.append(f"drift {t['drift_turns']}/{t['drift_checked']}")
    parts = t.get("reward_components") or {}
    if parts:
        words.append(" ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(parts.items())[:4]))
    return ("  " + "; ".join(words)) if words else ""


def step_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """Lines of ``tracecar health --step N`` for the step's truth."""
    d = s.get("drift")
    if not d:
        return []
    share = "" if d.get("share") is None else f" ({100 * d['share']:.1f}%)"
    return [("turn drift", f"{d['with_drift']} of {d['multi_turn']} multi-turn trajectories{share}; "
                           f"{d['turns_drifted']} of {d['turns_compared']} turns")]


def cmd_truth(args: argparse.Namespace) -> None:
    cli = _cli()
    cli._show(args, cli._get(args, f"/v1/trajectories/{args.trace_id}/truth"), print_truth)


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("truth", help="a trajectory's training truth: drift between turns, the reward's components, ground truth")
    p.add_argument("trace_id")
    p.add_argument("--url")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_truth)


def add_list_arguments(p: argparse.ArgumentParser) -> None:
    """``tracecar trajectories``' truth filters."""
    p.add_argument("--drift", choices=["true", "false"], help="a turn whose prompt does not extend the previous turn (true), "
                                                            "or multi-turn without (false)")
    p.add_argument("--where", metavar="CONDITIONS", help="reward components, e.g. 'acc=0,format<1'")
