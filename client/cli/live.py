"""``tracecar live`` and ``tracecar health``: what is running now, and the numbers traces are trusted by.

``live`` lists the trajectories whose root has not arrived yet (``GET /v1/live``), the longest
idle first, so a stuck tool call is found while the step still runs; ``--watch N`` redraws
every N seconds (bounded by ``--count``). ``health`` prints ``GET /v1/health``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def _cli() -> Any:
    from . import common

    return common


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def print_live(page: dict[str, Any]) -> None:
    shown = len(page["trajectories"])
    more = f" (showing {shown})" if page["truncated"] else ""
    capped = "; scan capped at TRACECAR_LIVE_MAX_SCAN_SPANS, older spans not looked at" if page["scan_capped"] else ""
    print(f"{page['total']} running trajector{'y' if page['total'] == 1 else 'ies'}{more}, "
          f"spans of the last {_age(page['window_s'])}{capped}")
    for progress in page.get("steps") or []:
        print(f"step {progress['step']} of {progress['experiment']!r}: {progress['done']} of {progress['total']} "
              f"trajectories done, {progress['running']} running")
    if not shown:
        return
    print(f"{'trace_id':34} {'step':>5} {'idx':>5} {'n':>3} {'spans':>5} {'age':>6} {'idle':>6}  waiting on / last span")
    for t in page["trajectories"]:
        stuck, last = t["stuck_call"], t["last_span"]
        if stuck is not None:
            what = f"{stuck['name']} (running {_age(stuck['running_s'])})"
        elif last is not None:
            what = f"after {last['name']}" + (" (error)" if last["has_error"] else "")
        else:
            what = "-"
        print(f"{t['trace_id']:34} {'' if t['step'] is None else t['step']:>5} "
              f"{'' if t['sample_index'] is None else str(t['sample_index'])[:5]:>5} "
              f"{'' if t['rollout_n'] is None else t['rollout_n']:>3} {t['spans']:>5} {_age(t['age_s']):>6} "
              f"{_age(t['idle_s']):>6}  {what}")


def cmd_live(args: argparse.Namespace) -> None:
    cli = _cli()
    params = {k: v for k, v in {"experiment": args.experiment, "step": args.step, "validate": args.validate,
                                "worker": args.worker, "limit": args.limit}.items() if v is not None}
    rounds = 1 if args.watch is None else max(1, args.count)
    for i in range(rounds):
        if i:
            time.sleep(args.watch)
            print()
        cli.show(args, cli.get_json(args, "/v1/live", params), print_live)


def print_health(answer: dict[str, Any]) -> None:
    for key in ("client_dropped", "sampled_out", "trajectories_dropped", "rejected", "batches_rejected",
                "decode_failures", "forward_failures"):
        detail = ", ".join(f"{k or '-'}={v}" for k, v in sorted(answer[key].items()))
        print(f"{key:22} {answer[key + '_total']:>10}" + (f"  ({detail})" if detail else ""))
    for key in ("spans_received", "spans_accepted", "spans_forwarded", "spans_dead_lettered", "spool_depth",
                "held_spans", "backend_unreachable"):
        print(f"{key:22} {answer[key]:>10}")
    if answer.get("step"):
        print_step_health(answer["step"])


def _counts(by: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(by.items())) or "-"


def print_step_health(s: dict[str, Any]) -> None:
    """The per-step part of ``/v1/health?step=N``."""
    from .truth import step_rows as truth_step_rows

    split = {None: "", False: " (training)", True: " (validation)"}[s["validate"]]
    print(f"\nstep {s['step']} of {s['experiment'] if s['experiment'] is not None else '(no experiment)'}{split}")
    trainer = s["trainer"]
    sampling = s["sampling"]
    rows = [
        ("trajectories stored", f"{s['trajectories']} ({s['spans']} spans; {s['scored']} scored, {s['with_error']} with an error)"),
        ("running now", f"{s['running']}" + (" (scan capped: more may run)" if s["running_scan_capped"] else "")),
        ("held for a decision", f"{s['held_spans']} spans"),
        ("sampling", f"mode {sampling['mode']}: kept {sampling['kept']} ({_counts(sampling['kept_by_rule'] or {})}), "
                     f"dropped {sampling['dropped']} ({_counts(sampling['dropped_by_reason'] or {})})"),
        ("kept by rule (stored)", _counts(s["kept_by_rule"])),
        ("trainer", f"trained {trainer['trained']}, dropped {trainer['dropped']} ({_counts(trainer['filtered_by'])})"),
        *truth_step_rows(s),
    ]
    for label, text in rows:
        print(f"  {label:22} {text}")


def cmd_health(args: argparse.Namespace) -> None:
    cli = _cli()
    params = {k: v for k, v in {"step": args.step, "experiment": args.experiment, "validate": args.validate}.items()
              if v is not None}
    cli.show(args, cli.get_json(args, "/v1/health", params), print_health)


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("live", help="list trajectories still running (root not arrived), the longest idle first")
    p.add_argument("--url")
    p.add_argument("--experiment", help="experiment name ('' for trajectories sent without one)")
    p.add_argument("--step", type=int)
    p.add_argument("--validate", choices=["true", "false"])
    p.add_argument("--worker")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--watch", type=float, metavar="SECONDS", help="redraw every SECONDS")
    p.add_argument("--count", type=int, default=720, help="with --watch: how many times (default 720)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_live)

    p = sub.add_parser("health", help="tracing health totals: client drops, sampled out, rejected, decode failures, spool depth")
    p.add_argument("--url")
    p.add_argument("--step", type=int, help="also this step's numbers: stored, running, held, sampling, trainer")
    p.add_argument("--experiment", help="with --step: the experiment (default: the latest; '' for none)")
    p.add_argument("--validate", choices=["true", "false"], help="with --step: validation or training only (default: both)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_health)
