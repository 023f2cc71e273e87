"""The ``tracecar`` command: serve the collector, feed it a demo rollout, read what it stored.

Subcommands that need the collector's dependencies import them lazily, so the thin client's
install still gets a working ``tracecar demo`` and query commands.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .. import __version__
from .common import DEFAULT_URL, fail, get_json, need_collector, show
from .demo import cmd_demo
from .lists import LIST_SORTS, cmd_trajectories


def _checked_settings(config_file: str | None, **overrides: Any) -> Any:
    """Settings as serve runs them; a mistake is one line on stderr and exit code 2."""
    from tracecar.collector.service.config_check import ConfigError, load_checked_settings

    if config_file is not None and not config_file.strip():
        fail("--config was given an empty file name", 2)
    try:
        return load_checked_settings(config_file, **overrides)
    except ConfigError as exc:
        fail(str(exc), 2)


def cmd_serve(args: argparse.Namespace) -> None:
    need_collector()
    import logging

    from tracecar.collector.logs import setup_logging
    from tracecar.collector.service.server import serve

    settings, warnings = _checked_settings(
        args.config, host=args.host, port=args.port, data_dir=args.data_dir, backend=args.backend,
        tokenizer=args.tokenizer, token2text=args.token2text,
        max_samples_per_step_per_worker=args.max_samples_per_step_per_worker, role=args.role, gateway_url=args.gateway,
    )
    from tracecar.collector.data_dir_lock import DataDirError

    from .quickstart import data_dir_hint, port_in_use

    if settings.port and port_in_use(settings.port, settings.host):
        fail(f"port {settings.port} on {settings.host} is already in use (another collector?): stop it, or set "
              f"--port N / TRACECAR_PORT=N (0 picks a free one){data_dir_hint(settings.data_dir)}")
    if args.parent_pid is not None:
        _stop_with_parent(args.parent_pid)
    setup_logging(settings.log_level)
    for line in warnings:
        logging.getLogger("tracecar.collector").warning(line, extra={"event": "config_warning"})
    from tracecar.collector.read_store import StoreStartError

    try:
        serve(settings)
    except DataDirError as exc:  # in use by another collector, or cannot be locked at all
        fail(str(exc))
    except StoreStartError as exc:  # a ClickHouse server unreachable, or its database another collector's
        fail(str(exc), 2)


def _stop_with_parent(parent_pid: int) -> None:
    """``--parent-pid``: when the process that started this collector ends, however it ends, the
    collector gets SIGTERM once and drains (tracecar.client.lifeline: the kernel's signal on Linux,
    a watch thread everywhere)."""
    import signal

    from ..lifeline import die_with_parent, parent_is_gone

    if parent_is_gone(parent_pid):
        fail(f"--parent-pid {parent_pid} is not the process that started this one (its parent is {os.getppid()})", 2)
    die_with_parent(parent_pid, lambda: os.kill(os.getpid(), signal.SIGTERM))


def cmd_config(args: argparse.Namespace) -> None:
    need_collector()
    settings, warnings = _checked_settings(args.config)
    for line in warnings:
        print(f"tracecar: warning: {line}", file=sys.stderr)
    print(json.dumps(settings.masked(), indent=2, default=str))


def cmd_show(args: argparse.Namespace) -> None:
    from .show import limit_of, print_tree

    if args.max_chars < 0:
        fail("--max-chars must be 0 (no cut) or more", 2)
    tree = get_json(args, f"/v1/trajectories/{args.trace_id}")
    if args.json:
        print(json.dumps(tree, indent=2))
        return
    print_tree(tree, limit_of(args))


def cmd_decisions(args: argparse.Namespace) -> None:
    params = {k: v for k, v in {"step": args.step, "experiment": args.experiment, "validate": args.validate}.items() if v is not None}
    page = get_json(args, "/v1/decisions", params)
    if args.experiment is None:
        page = _default_experiment(args, params, page)
    show(args, page, print_decisions)


def _has_decisions(page: dict[str, Any]) -> bool:
    return bool(page.get("decisions") or page.get("open") or page.get("head"))


def _default_experiment(args: argparse.Namespace, params: dict[str, Any], page: dict[str, Any]) -> dict[str, Any]:
    """No --experiment: the trajectories sent without one if they have decisions at this step, else the
    newest experiment that has (said on stderr, with the others); when none has, say that."""
    others = [e for e in page.get("experiments_at_step") or [] if e is not None]
    if _has_decisions(page):
        if others:
            print(f"tracecar: showing trajectories sent without an experiment name; step {args.step} also has decisions "
                  f"in {', '.join(repr(e) for e in others)} (--experiment NAME)", file=sys.stderr)
        return page
    if not others:
        print(f"tracecar: no experiment has sampling decisions at step {args.step} (sampling off, the step not decided "
              "yet, or another step: see `tracecar trajectories --step N` and the viewer's steps overview)", file=sys.stderr)
        return page
    chosen = others[0]
    rest = f"; also: {', '.join(repr(e) for e in others[1:])}" if others[1:] else ""
    print(f"tracecar: no --experiment given: showing {chosen!r}, the newest experiment with decisions at step "
          f"{args.step}{rest} (--experiment NAME for another)", file=sys.stderr)
    return dict(get_json(args, "/v1/decisions", {**params, "experiment": chosen}))


def _experiment_label(experiment: str | None) -> str:
    return "(sent without an experiment name)" if experiment is None else repr(experiment)


def print_decisions(page: dict[str, Any]) -> None:
    head = page.get("head") or []
    if head and not page["decisions"]:
        kept, dropped = sum(len(h["kept"]) for h in head), sum(len(h["dropped"]) for h in head)
        print(f"step {page['step']} of experiment {_experiment_label(page['experiment'])} uses the head-based budget "
              f"(max_samples_per_step_per_worker, {page['budget'] or 'the job' + chr(39) + 's own'}): "
              f"kept {kept} sample indices, dropped {dropped}; all rollouts of a kept sample are kept")
        for h in head:
            where = f"{h['worker']}{' (validation)' if h['validate'] else ''}"
            where += f", policy version {h['policy_version']}" if h.get("policy_version") else ""
            print(f"  {where}: kept {h['kept']}, dropped {h['dropped']}")
        return
    if not page["decisions"] and not page.get("open"):
        if page["mode"] == "pass":
            print(f"sampling is off for experiment {_experiment_label(page['experiment'])}: no budget is set, so every trajectory of "
                  f"step {page['step']} is kept and there are no decisions to show (set a budget, README 'Sampling budgets')")
            return
        if page["mode"] == "head":
            print(f"step {page['step']} of experiment {_experiment_label(page['experiment'])} uses the head-based budget "
                  f"{page['budget'] or {}}: the first sample indices per worker are kept as they arrive; no per-trajectory "
                  "decisions are recorded (set tail_sampling: true to see them)")
            return
    rules = ", ".join(f"{k} {v}" for k, v in sorted(page["kept_by_rule"].items())) or "-"
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(page["dropped_by_reason"].items())) or "-"
    print(f"step {page['step']} of experiment {_experiment_label(page['experiment'])} (mode {page['mode']}, "
          f"budget {page['budget'] or 'none'}): kept {page['kept']} ({rules}); dropped {page['dropped']} ({reasons})")
    for o in page.get("open", []):
        version = f", policy version {o['policy_version']}" if o.get("policy_version") is not None else ""
        where = f"round {o['round']}{', validation' if o['validate'] else ''}{version}"
        print(f"  held, undecided ({where}): {o['held_trajectories']} trajectories, "
              f"{o['with_root']} with root, {o['with_reward']} with reward, idle {o['idle_s']} s")
    print(f"{'trace_id':34} {'idx':>4} {'n':>3} {'worker':16} {'reward':>8} {'err':>3} {'kept':>4}  why")
    for d in page["decisions"]:
        reward = "" if d["reward"] is None else f"{d['reward']:.3f}"
        why = d["rule"] if d["keep"] else d["reason"]
        if d["truncated"]:
            why += " (truncated)"
        if d.get("policy_version") is not None:
            why += f" (policy version {d['policy_version']})"
        print(f"{d['trace_id']:34} {d['sample_index'] if d['sample_index'] is not None else '':>4} "
              f"{d['rollout_n'] if d['rollout_n'] is not None else '':>3} {str(d['worker'])[:16]:16} {reward:>8} "
              f"{'yes' if d['has_error'] else '':>3} {'yes' if d['keep'] else 'no':>4}  {why}")


def cmd_dead_letters(args: argparse.Namespace) -> None:
    params: dict[str, Any] = {"limit": args.limit}
    if args.exporter:
        params["exporter"] = args.exporter
    print(json.dumps(get_json(args, "/v1/dead-letters", params), indent=2))


def cmd_quickstart(args: argparse.Namespace) -> None:
    from .quickstart import run_quickstart

    run_quickstart(args)


def cmd_doctor(args: argparse.Namespace) -> None:
    from .doctor import run_doctor

    url = args.url or os.environ.get("TRACECAR_URL")
    tokenizer = args.tokenizer or os.environ.get("TRACECAR_CLIENT_TOKENIZER")
    sys.exit(run_doctor(url, os.environ.get("TRACECAR_TOKEN") or None, tokenizer, args.timeout))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tracecar",
        description="tracecar: out-of-process rollout tracing. Serve the collector, feed it a demo rollout, "
                    "read what it stored.",
        epilog="examples:\n"
               "  tracecar quickstart                      # collector on the local store + demo rollout\n"
               "  tracecar serve --token2text --tokenizer /models/qwen/tokenizer.json\n"
               "  TRACECAR_URL=http://127.0.0.1:9470 tracecar demo --steps 5\n"
               "  tracecar trajectories --experiment demo --step 2 --sort reward\n"
               "  tracecar show TRACE_ID\n"
               "  tracecar doctor                          # from a worker: will traces arrive?\n"
               "every collector setting is a TRACECAR_* variable; `tracecar config` prints them (README: settings table)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tracecar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the collector (settings: TRACECAR_* env vars, --config YAML, flags)")
    p.add_argument("--config", help="YAML file of settings (same names as the env vars, lower case, no prefix)")
    p.add_argument("--host", help="bind address (default 127.0.0.1; elsewhere set TRACECAR_TOKEN)")
    p.add_argument("--port", type=int, help="port (default 9470)")
    p.add_argument("--data-dir", help="directory of the spool/store (default ./tracecar-data)")
    p.add_argument("--backend", choices=["auto", "local", "weave"],
                   help="weave when WANDB_API_KEY is set (auto, the default), or the embedded local store only")
    p.add_argument("--tokenizer", help="tokenizer.json path, a directory with one, or an HF name in the local cache")
    p.add_argument("--token2text", action=argparse.BooleanOptionalAction, default=None,
                   help="decode prompt_ids/response_ids to text (VERL's token2text)")
    p.add_argument("--max-samples-per-step-per-worker", type=int,
                   help="VERL's budget: distinct sample indices kept per (experiment, step, worker)")
    p.add_argument("--parent-pid", type=int, metavar="PID",
                   help="the pid of the process that started this one: when it ends, however it ends, the collector "
                        "drains and stops (what tracecar quickstart and the Ray helper pass)")
    p.add_argument("--role", choices=["node", "gateway"],
                   help="node (default: the collector beside the workers; with --gateway it forwards to that gateway) or "
                        "gateway (global budgets, store and viewer of a job's node collectors); docs/cluster.md")
    p.add_argument("--gateway", metavar="URL", help="role node: the gateway's http(s)://HOST:PORT (TRACECAR_GATEWAY_URL)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("config", help="print the effective collector configuration (secrets masked)")
    p.add_argument("--config")
    p.set_defaults(func=cmd_config)

    def add_demo_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--experiment", help="experiment name (demo: default $TRACECAR_EXPERIMENT or demo; "
                                            "quickstart: a fresh demo-<timestamp> each run)")
        p.add_argument("--steps", type=int, default=3)
        p.add_argument("--samples", type=int, default=8, help="prompts per step")
        p.add_argument("--rollout-n", type=int, default=4, help="rollouts per prompt")

    p = sub.add_parser("demo", help="run a simulated tool-using rollout that feeds a running collector")
    p.add_argument("--url", help=f"collector URL (default $TRACECAR_URL or {DEFAULT_URL})")
    p.add_argument("--project", help="W&B project (default $TRACECAR_PROJECT or tracecar-demo)")
    p.add_argument("--seed", type=int, default=0)
    add_demo_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("quickstart", help="start a collector on the embedded store, feed it the demo, list the result")
    p.add_argument("--port", type=int, help="collector port on 127.0.0.1 (default $TRACECAR_PORT or 9470; 0 picks a free one); "
                                            "a port already in use is an error, never someone else's collector")
    p.add_argument("--data-dir", default="./tracecar-data", help="store and collector.log (default ./tracecar-data)")
    p.add_argument("--exit", action="store_true", help="stop after listing instead of serving on")
    p.add_argument("--budget", type=int, default=16,
                   help="trajectories kept per step by tail-based sampling (default 16 of the demo's 32, so the "
                        "viewer's sampling panel shows decisions); 0 keeps all")
    add_demo_args(p)
    p.set_defaults(func=cmd_quickstart)

    from .truth import add_list_arguments as add_truth_list_arguments

    p = sub.add_parser("trajectories", help="list stored trajectories, filtered")
    p.add_argument("--url")
    p.add_argument("--experiment")
    p.add_argument("--step", type=int)
    p.add_argument("--sample-index", help="sample index (VERL's extra_info.index): an integer or a string")
    p.add_argument("--rollout-n", type=int)
    p.add_argument("--validate", choices=["true", "false"])
    p.add_argument("--trained", choices=["true", "false"], help="what the trainer did (annotate(trained=...))")
    p.add_argument("--filtered-by", help="the trainer's filter that dropped it (annotate(filtered_by=...))")
    p.add_argument("--step-min", type=int)
    p.add_argument("--step-max", type=int)
    p.add_argument("--kept-because", help="the sampling rule that kept it (tail-based budgets)")
    p.add_argument("--worker")
    p.add_argument("--node", help="on a gateway: the node collector that forwarded it")
    p.add_argument("--has-error", choices=["true", "false"])
    p.add_argument("--reward-min", type=float)
    p.add_argument("--reward-max", type=float)
    p.add_argument("--sort", choices=LIST_SORTS)
    p.add_argument("--order", choices=["asc", "desc"])
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--search", metavar="WORDS", help="only trajectories whose first prompt or last response has all these words")
    add_truth_list_arguments(p)  # --attr, --drift, --where, ... (cli/truth.py: also on groups and export)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_trajectories)

    p = sub.add_parser("show", help="show one trajectory as a tree (its attributes, texts cut at --max-chars, or --full)")
    p.add_argument("trace_id", help="the id, its viewer form (…000000e7) or a unique prefix")
    p.add_argument("--url")
    p.add_argument("--json", action="store_true")
    from .show import add_arguments as add_show_arguments

    add_show_arguments(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("decisions", help="show the tail-based sampling decisions of one step (kept because / dropped why)")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--experiment")
    p.add_argument("--validate", choices=["true", "false"], help="only validation (true) or training (false) steps")
    p.add_argument("--url")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_decisions)

    p = sub.add_parser("doctor", help="from a worker's environment: will traces arrive? (collector, token, tokenizer, "
                                      "spans, Weave; PASS/FAIL per line, exit 1 on any FAIL)")
    p.add_argument("--url", help="collector URL (default $TRACECAR_URL, as the worker uses it)")
    p.add_argument("--tokenizer", help="the tokenizer this job's workers name (default $TRACECAR_CLIENT_TOKENIZER; "
                                       "with VERL, the model's tokenizer_path)")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for the test trajectory and Weave")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("dead-letters", help="list spans the backend rejected permanently")
    p.add_argument("--url")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--exporter", help="only this exporter's dead letters (a TRACECAR_EXPORTERS name)")
    p.set_defaults(func=cmd_dead_letters)

    from .groups_export import add_parsers as add_groups_export_parsers

    add_groups_export_parsers(sub)  # groups, export
    from .tokens import add_parsers as add_tokens_parsers

    add_tokens_parsers(sub)  # tokens
    from .live import add_parsers as add_live_parsers

    add_live_parsers(sub)  # live, health
    from .proxy import add_parsers as add_proxy_parsers

    add_proxy_parsers(sub)  # proxy
    from .truth import add_parsers as add_truth_parsers

    add_truth_parsers(sub)  # truth
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
