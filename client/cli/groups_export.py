"""``tracecar groups`` and ``tracecar export``: the GRPO group view and dataset export from the CLI.

Both talk to a running collector over HTTP (``/v1/groups``, ``/v1/export``), so they work from
the thin client's install; the export streams the response to disk and never holds it whole.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

import httpx

from .truth import add_list_arguments, list_params


def _cli() -> Any:
    from . import common

    return common


def _fmt(value: Any, width: int, digits: int = 3) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, float):
        return f"{value:>{width}.{digits}f}"
    return f"{str(value):>{width}}"


def describe_diff(rollout: dict[str, Any]) -> str:
    """One phrase: how this rollout departs from its group's best."""
    if rollout.get("is_best"):
        return "best"
    diff = rollout.get("diff")
    if diff is None:
        return ""
    if diff["identical"]:
        return "same as best"
    first = diff["first_differing_turn"]
    turn = next(t for t in diff["turns"] if t["turn"] == first)
    if turn["status"] in ("missing", "extra"):
        what = f"turn {first} {'only in best' if turn['status'] == 'missing' else 'not in best'}"
    else:
        parts = [name.replace("_", " ") for name in ("response", "tool_calls", "tool_results") if turn.get(name) == "different"]
        what = f"turn {first} differs: {', '.join(parts)}"
        if "common_prefix_chars" in turn and turn.get("response") == "different":
            what += f" (response departs at char {turn['common_prefix_chars']})"
    extra = sum(1 for t in diff["turns"] if t["status"] == "extra")
    missing = sum(1 for t in diff["turns"] if t["status"] == "missing")
    if extra and turn["status"] != "extra":
        what += f"; {extra} more turn{'s' if extra > 1 else ''}"
    if missing and turn["status"] != "missing":
        what += f"; {missing} fewer turn{'s' if missing > 1 else ''}"
    return what


def partial_note(partial: int) -> str:
    if not partial:
        return ""
    return (f"; {partial} partial (rollouts sampled out: neither flagged nor scored as whole; "
            "TRACECAR_KEEP_GROUPS_WHOLE keeps groups whole)")


def print_groups(page: dict[str, Any]) -> None:
    split = "validation" if page["validate"] else "train"
    print(f"step {page['step']} of experiment {page['experiment']!r} ({split}): {page['total_groups']} groups, "
          f"{page['trajectories']} trajectories; {page['all_equal_groups']} with zero spread (GRPO learns nothing from them)"
          f"{partial_note(page.get('partial_groups', 0))}{'; TRUNCATED' if page.get('truncated') else ''}")
    shown = len(page["groups"])
    if shown < page["total_groups"]:
        print(f"showing {shown} groups from offset {page['offset']} (sort {page['sort']}; --limit/--offset for more)")
    print("adv: the trainer's advantage when annotated, else ~ (reward - mean) / (std + 1e-6) as GRPO computes it")
    for group in page["groups"]:
        flag = "  ZERO SPREAD" if group["all_equal"] else ""
        if group.get("partial"):
            flag = (f"  PARTIAL: {group['n']} of {group['total']} kept ({group['sampled_out']} sampled out): "
                    "not scored as a whole group")
        print(f"\nsample {group['sample_index']}: n {group['n']} (scored {group['scored']})  mean {_fmt(group['mean'], 0)}  "
              f"std {_fmt(group['std'], 0)}  min {_fmt(group['min'], 0)}  max {_fmt(group['max'], 0)}  "
              f"spread {_fmt(group['spread'], 0)}{flag}")
        if group.get("prompt_preview"):
            print(f"  prompt: {group['prompt_preview'][:100]!r}")
        print(f"  {'rank':>4} {'rollout':>7} {'reward':>8} {'adv':>7} {'turns':>5} {'tools':>5} {'err':>3}  {'trace_id':32}  vs best")
        for r in group["rollouts"]:
            if r["advantage"] is not None:
                advantage = _fmt(r["advantage"], 7, 2)
            elif r.get("group_advantage") is not None:  # not annotated: as GRPO computes it from these rewards
                advantage = f"~{r['group_advantage']:.2f}".rjust(7)
            else:
                advantage = _fmt(None, 7)
            print(f"  {r['rank']:>4} {_fmt(r['rollout_n'], 7)} {_fmt(r['reward'], 8)} {advantage} "
                  f"{_fmt(r['turns'], 5)} {_fmt(r['tool_calls'], 5)} {'yes' if r['has_error'] else '':>3}  "
                  f"{r['trace_id']:32}  {describe_diff(r)}")


def cmd_groups(args: argparse.Namespace) -> None:
    cli = _cli()
    params = {k: v for k, v in {
        "step": args.step, "experiment": args.experiment, "validate": args.validate, "sort": args.sort,
        "sample_index": args.sample_index, "limit": args.limit, "offset": args.offset, **list_params(args),
    }.items() if v is not None}
    cli.show(args, cli.get_json(args, "/v1/groups", params), print_groups)


def _format_of(args: argparse.Namespace) -> str:
    if args.format:
        return args.format
    return "parquet" if args.output.endswith((".parquet", ".pq")) else "jsonl"


def cmd_export(args: argparse.Namespace) -> None:
    cli = _cli()
    fmt = _format_of(args)
    params = {k: v for k, v in {
        "format": fmt, "experiment": args.experiment, "step": args.step, "step_min": args.step_min,
        "step_max": args.step_max, "sample_index": args.sample_index, "validate": args.validate,
        "kept_because": args.kept_because, "reward_min": args.reward_min, "reward_max": args.reward_max,
        "has_error": args.has_error, "rollout_n": args.rollout_n, "worker": args.worker, "node": args.node, "trained": args.trained,
        "filtered_by": args.filtered_by, "q": args.search, "limit": args.limit, "token_ids": "true" if args.token_ids else None,
        **list_params(args),
    }.items() if v is not None}
    partial = args.output + ".partial"
    written = 0
    try:
        with httpx.stream("GET", cli.collector_url(args) + "/v1/export", params=params, headers=cli.auth_headers(),
                          timeout=httpx.Timeout(30, read=args.timeout)) as response:
            if response.status_code >= 400:
                response.read()
                sys.exit(f"tracecar: export failed: {response.status_code} {response.text}")
            with open(partial, "wb") as out:
                for chunk in response.iter_bytes():
                    out.write(chunk)
                    written += len(chunk)
    except httpx.HTTPError as exc:  # the stream broke off: a partial file would look like a whole dataset
        with contextlib.suppress(OSError):
            os.unlink(partial)
        sys.exit(f"tracecar: export from {cli.collector_url(args)} failed: {exc or type(exc).__name__}; nothing written to {args.output}")
    os.replace(partial, args.output)
    rows = _count_rows(args.output, fmt)
    print(f"wrote {'' if rows is None else f'{rows} trajectories, '}{written} bytes of {fmt} to {args.output}")


def _count_rows(path: str, fmt: str) -> int | None:
    if fmt == "jsonl":
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    try:
        import pyarrow.parquet as pq
    except ImportError:
        return None
    return pq.ParquetFile(path).metadata.num_rows


def add_parsers(sub: Any) -> None:
    """Registers ``groups`` and ``export`` on the main parser's subcommands."""
    p = sub.add_parser("groups", help="GRPO group view of one step: rollouts per sample ranked by reward, group stats, "
                                      "zero-spread groups flagged, each rollout diffed against the group's best")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--experiment", help="default: the latest experiment")
    p.add_argument("--validate", choices=["true", "false"], help="validation groups (true) instead of training (default)")
    p.add_argument("--sort", choices=["sample_index", "spread", "zero_spread", "mean"],
                   help="spread: widest first; zero_spread: all-equal groups first")
    p.add_argument("--sample-index", help="only this group (int or string)")
    p.add_argument("--limit", type=int, default=50, help="groups per page")
    p.add_argument("--offset", type=int, default=0)
    add_list_arguments(p)  # only groups with a rollout that matches, shown whole
    p.add_argument("--url")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_groups)

    p = sub.add_parser("export", help="write selected trajectories as a dataset (JSONL or Parquet) for datasets.load_dataset",
                       epilog="example: tracecar export -o step5.parquet --experiment demo --step-min 5 --reward-min 0.5")
    p.add_argument("-o", "--output", required=True, help="file to write (.parquet/.pq: Parquet, else JSONL)")
    p.add_argument("--format", choices=["jsonl", "parquet"], help="default: from the file's suffix")
    p.add_argument("--experiment")
    p.add_argument("--step", type=int)
    p.add_argument("--step-min", type=int)
    p.add_argument("--step-max", type=int)
    p.add_argument("--sample-index", help="one group (int or string)")
    p.add_argument("--validate", choices=["true", "false"])
    p.add_argument("--kept-because", help="only trajectories kept by this sampling rule")
    p.add_argument("--reward-min", type=float)
    p.add_argument("--reward-max", type=float)
    p.add_argument("--has-error", choices=["true", "false"])
    p.add_argument("--rollout-n", type=int)
    p.add_argument("--worker")
    p.add_argument("--node", help="on a gateway: only trajectories this node collector forwarded")
    p.add_argument("--trained", choices=["true", "false"], help="what the trainer did (annotate(trained=...)): false = dropped")
    p.add_argument("--filtered-by", help="only trajectories this trainer filter dropped (annotate(filtered_by=...))")
    p.add_argument("--search", metavar="WORDS", help="only trajectories whose first prompt or last response has all these words")
    p.add_argument("--limit", type=int, help="at most this many trajectories")
    add_list_arguments(p)
    p.add_argument("--token-ids", action="store_true", help="include prompt/response token ids and the response mask")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the next bytes of the stream")
    p.add_argument("--url")
    p.set_defaults(func=cmd_export)
