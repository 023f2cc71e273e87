"""``tracecar show ID``: one trajectory as a tree, its attributes one per line, its texts readable.

The root's attributes come first, the RL keys in a fixed order (experiment, step, sample, rollout,
reward, ...), the rest sorted, each ``key: value`` (nested values as compact JSON). Each span's
decoded ``prompt_text`` / ``response_text`` is cut at ``--max-chars`` (default 200; the cut is
said, with how many characters are left); ``--full`` prints every text whole, line breaks kept.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

DEFAULT_MAX_CHARS = 200
FIRST = ("experiment_name", "step", "sample_index", "rollout_n", "validate", "reward", "kept_because", "advantage",
         "trained", "filtered_by", "policy_version", "trained_on_version")
TEXT_KEYS = ("prompt_text", "response_text")


def value_text(value: Any, limit: int | None) -> str:
    """A value as a user reads it: strings as they are, true/false/null, structures as compact JSON."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, bool) or value is None:
        text = json.dumps(value)
    elif isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (int,)):
        text = str(value)
    else:
        text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "), default=str)
    return cut(text, limit)


def cut(text: str, limit: int | None) -> str:
    if limit is None or len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters: --full, or --max-chars N)"


def attribute_lines(attributes: dict[str, Any], limit: int | None, indent: str = "  ") -> list[str]:
    keys = [k for k in FIRST if k in attributes] + sorted(k for k in attributes if k not in FIRST)
    return [f"{indent}{key}: {value_text(attributes[key], limit)}" for key in keys]


def text_lines(key: str, text: Any, limit: int | None, indent: str) -> list[str]:
    """A decoded text: one line (line breaks shown as ⏎) when cut, else whole with its line breaks."""
    if not isinstance(text, str):
        return [f"{indent}{key}: {value_text(text, limit)}"]
    if limit is not None:
        return [f"{indent}{key}: {cut(text, limit).replace(chr(10), '⏎')}"]
    body = text.splitlines() or [""]
    return [f"{indent}{key}:"] + [f"{indent}  │ {line}" for line in body]


def print_tree(tree: dict[str, Any], limit: int | None) -> None:
    root = tree["root"]
    print(f"trajectory {tree['trace_id']} ({tree['span_count']} spans)")
    for line in attribute_lines(root.get("attributes") or {}, limit):
        print(line)

    def walk(span: dict[str, Any], depth: int) -> None:
        pad = "  " * depth
        duration = (span.get("end_time") or 0) - (span.get("start_time") or 0)
        flag = "  ! " + value_text(span["exception"], limit) if span.get("exception") else ""
        print(f"{pad}- {span['name']} [{span.get('kind')}] {duration * 1000:.1f} ms{flag}")
        output = span.get("output")
        if isinstance(output, dict):
            for key in TEXT_KEYS:
                if key in output:
                    for line in text_lines(key, output[key], limit, pad + "    "):
                        print(line)
        for child in span.get("children", []):
            walk(child, depth + 1)

    walk(root, 0)
    for note in tree.get("annotations", []):  # annotate() sends its values (the reward) as attributes
        values = {**(note.get("inputs") or {}), **(note.get("attributes") or {})}
        print("  annotation: " + (", ".join(f"{k}={value_text(v, limit)}" for k, v in values.items()) or "(empty)"))


def limit_of(args: argparse.Namespace) -> int | None:
    if args.full or args.max_chars == 0:
        return None
    return args.max_chars


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--full", action="store_true", help="print every text and attribute whole, line breaks kept")
    p.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS, metavar="N",
                   help=f"cut texts and attribute values at N characters (default {DEFAULT_MAX_CHARS}; 0: no cut, as --full)")
