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
    from . import common

    return common


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
    summary = answer.get("summary") or {}
    print(f"  fate: {fate_words(summary)}")
    trainer = answer.get("trainer")
    if trainer:
        print("  trainer vs rollout: " + trainer_words(trainer))


FATE_LABELS = {"trained": "trained", "filtered": "filtered by the trainer", "evicted": "evicted from the replay buffer",
               "not_reached": "never reached the trainer"}


def fate_words(t: dict[str, Any]) -> str:
    """What became of it: fate (why), policy versions, staleness, refill."""
    fate = t.get("fate")
    words = [FATE_LABELS.get(str(fate), str(fate)) + (f" ({t['fate_reason']})" if t.get("fate_reason") else "")]
    if t.get("evicted_at_step") is not None:
        words.append(f"at step {t['evicted_at_step']}")
    low, high = t.get("min_global_steps"), t.get("max_global_steps")
    if low is not None:
        words.append(f"policy v{low}" + (f"–v{high}" if high is not None and high != low else ""))
    if t.get("staleness") is not None:
        words.append(f"staleness {t['staleness']}")
    if t.get("refill_of"):
        words.append(f"refill of evicted group {t['refill_of']}")
    return ", ".join(words)


def trainer_words(t: dict[str, Any]) -> str:
    """What the trainer trained on against what the rollout generated, in a line."""
    words = []
    if t.get("tt_ids_equal") is False:
        words.append(f"ids differ from token {t['tt_first_diff']} ({t['tt_ids_differing']} ids)")
    for key, label in (("tt_mask_extra", "trained tokens not generated"), ("tt_mask_missing", "generated tokens not trained"),
                       ("tt_absent", "generated tokens absent from the trained sequence")):
        if t.get(key):
            words.append(f"{t[key]} {label}")
    if not words and t.get("tt_mismatch") is False:
        words.append("trained on exactly the generated tokens")
    if t.get("lp_compared"):
        words.append(f"|Δ logprob| mean {t['lp_mean']:.4g}, p99 {t['lp_p99']:.4g}, max {t['lp_max']:.4g} over {t['lp_compared']} tokens")
    return "; ".join(words)


def truth_words(t: dict[str, Any]) -> str:
    """A list row's truth in a few words (``tracecar trajectories``)."""
    words = []
    if t.get("drift_turns"):
        words.append(f"drift {t['drift_turns']}/{t['drift_checked']}")
    parts = t.get("reward_components") or {}
    if parts:
        words.append(" ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(parts.items())[:4]))
    if t.get("tt_mismatch"):
        words.append("trained on other tokens")
    if t.get("lp_max") is not None and t["lp_max"] >= 0.1:
        words.append(f"max |Δ logprob| {t['lp_max']:.3g}")
    if t.get("fate") in ("evicted",) or t.get("refill_of"):
        words.append(fate_words(t))
    return ("  " + "; ".join(words)) if words else ""


def step_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """Lines of ``tracecar health --step N`` for the step's truth."""
    d = s.get("drift")
    if not d:
        return []
    share = "" if d.get("share") is None else f" ({100 * d['share']:.1f}%)"
    rows = [("turn drift", f"{d['with_drift']} of {d['multi_turn']} multi-turn trajectories{share}; "
                           f"{d['turns_drifted']} of {d['turns_compared']} turns")]
    f = s.get("fates")
    if f:
        evicted = ", ".join(f"{k}={v}" for k, v in sorted((f.get("evicted_by") or {}).items()))
        rows.append(("fate", f"trained {f['trained']}, filtered {f['filtered']}, evicted {f['evicted']}"
                             + (f" ({evicted})" if evicted else "") + f", never reached the trainer {f['not_reached']};"
                             f" refills {f['refills']}"))
        tv = s.get("trainer_vs_rollout") or {}
        if tv.get("compared"):
            share = "" if tv.get("mismatch_share") is None else f" ({100 * tv['mismatch_share']:.1f}%)"
            lp = "" if tv.get("logprob_diff_max") is None else (
                f"; |Δ logprob| mean {tv['logprob_diff_mean']:.4g}, p99 ≤ {tv['logprob_diff_p99']:.3g}, max {tv['logprob_diff_max']:.4g}")
            rows.append(("trainer vs rollout", f"{tv['with_token_mismatch']} of {tv['compared']} trained on other tokens{share}{lp}"))
        if f.get("staleness_max") is not None:
            rows.append(("staleness", f"mean {f['staleness_mean']:.2f}, max {f['staleness_max']};"
                                      f" {f['multi_version']} generated by more than one policy version"))
    return rows


def cmd_truth(args: argparse.Namespace) -> None:
    cli = _cli()
    cli.show(args, cli.get_json(args, f"/v1/trajectories/{args.trace_id}/truth"), print_truth)


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("truth", help="a trajectory's training truth: drift between turns, the reward's components, ground truth")
    p.add_argument("trace_id")
    p.add_argument("--url")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_truth)


def add_list_arguments(p: argparse.ArgumentParser) -> None:
    """The attribute and truth filters of ``tracecar trajectories``, ``groups`` and ``export``."""
    p.add_argument("--attr", action="append", metavar="KEY=VALUE",
                   help="only trajectories whose root attribute KEY equals VALUE (repeatable; attributes.KEY works too)")
    p.add_argument("--drift", choices=["true", "false"], help="a turn whose prompt does not extend the previous turn (true), "
                                                            "or multi-turn without (false)")
    p.add_argument("--where", metavar="CONDITIONS", help="reward components, e.g. 'acc=0,format<1'")
    p.add_argument("--fate", choices=["trained", "filtered", "evicted", "not_reached"], help="what became of it")
    p.add_argument("--refill", choices=["true", "false"], help="a group that replaces an evicted one")
    p.add_argument("--trained-other", choices=["true", "false"], help="the trainer trained on other tokens than generated")
    p.add_argument("--lp-delta-min", type=float, metavar="X", help="|Δ logprob| rollout vs trainer reaches X on a token")


def list_params(args: argparse.Namespace) -> dict[str, Any]:
    """The truth filters as query parameters: one mapping for ``trajectories``, ``groups`` and ``export``,
    so the three commands filter alike (what the API's truth_filters() reads)."""
    return {"attr": args.attr, "drift": args.drift, "where": args.where, "fate": args.fate, "refill": args.refill,
            "trained_other": args.trained_other, "lp_delta_min": args.lp_delta_min}
