"""``tracecar tokens TRACE_ID``: a trajectory's response token by token, from ``/v1/trajectories/{id}/tokens``.

Prints each span that carried per-token data with its text, tool output (outside the loss
mask) in ``⟦…⟧``, unlikely tokens (log-probability under ``--below``) in ``«…»``, then the
least probable generated tokens. ``--json`` prints the API's answer.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _cli() -> Any:
    from . import common

    return common


def render(span: dict[str, Any], below: float) -> str:
    """The span's text with tool tokens and unlikely tokens marked (ids when it was not decoded)."""
    out, outside = [], False
    for token in span["tokens"]:
        piece = token.get("text")
        piece = f"<{token['id']}>" if piece is None else piece
        masked = token.get("mask") == 0
        if masked != outside:
            out.append("⟦" if masked else "⟧")
            outside = masked
        low = not masked and token.get("logprob") is not None and token["logprob"] < below
        out.append(f"«{piece}»" if low and piece else piece)
    if outside:
        out.append("⟧")
    return "".join(out)


def print_tokens(view: dict[str, Any], below: float, show_text: bool) -> None:
    spans = view["spans"]
    print(f"trajectory {view['trace_id']}: {len(spans)} span(s) with per-token data")
    if not spans:
        print("  (no span carried response_logprobs / log_probs / response_mask / entropy)")
    for span in spans:
        kind = "agent loop output" if span["aggregate"] else "turn"
        has = ", ".join(k for k, v in span["has"].items() if v) or "nothing"
        mean = "" if span["mean_logprob"] is None else f", mean logprob {span['mean_logprob']:.3f}"
        print(f"\n== {span['name']} ({kind}: {span['count']} tokens, {span['outside_mask']} outside the loss mask{mean}; has {has})")
        if span["text_note"]:
            print(f"   {span['text_note']}")
        if span.get("exact") is False:  # an older collector's answer has no "exact"
            print("   token boundaries approximated: the pieces join to the text, a token's own text may sit on a neighbour")
        if show_text:
            print(render(span, below))
    if view["lowest"]:
        print("\nlowest-probability generated tokens:")
        for token in view["lowest"]:
            entropy = "" if token.get("entropy") is None else f"  entropy {token['entropy']:.3f}"
            print(f"  #{token['i']:<5} {token['logprob']:>9.3f}  {json.dumps(token.get('text', token['id']), ensure_ascii=False)}"
                  f"{entropy}")
    print("\n⟦…⟧ outside the loss mask (tool output)" + (f", «…» logprob < {below}" if show_text else ""))


def cmd_tokens(args: argparse.Namespace) -> None:
    cli = _cli()
    view = cli.get_json(args, f"/v1/trajectories/{args.trace_id}/tokens", {"lowest": args.lowest})
    if args.json:
        print(json.dumps(view, indent=2, ensure_ascii=False))
    else:
        print_tokens(view, args.below, not args.no_text)


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("tokens", help="one trajectory's response token by token: log-probabilities, loss mask, "
                                      "lowest-probability tokens")
    p.add_argument("trace_id")
    p.add_argument("--lowest", type=int, default=10, help="how many of the least probable tokens to list")
    p.add_argument("--below", type=float, default=-2.0, help="mark tokens with a log-probability under this")
    p.add_argument("--no-text", action="store_true", help="only the summary and the lowest tokens")
    p.add_argument("--url")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_tokens)
