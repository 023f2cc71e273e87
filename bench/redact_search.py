"""The redaction byte search (``RedactKeys.might_hold``) on the bodies it meets, by size and kind.

Every span the sender packs, and every body the collector receives, is searched for a quoted
redact key before it may skip the Python walk. Two ways exist (tracecar.client.redact): the
quoted-key regex, and memchr passes over each key's rarest letter with a Python look at each
place. This prints, for each body, the current rule (the regex below ``REGEX_BELOW`` bytes, the
letters above, 16 places before the regex decides) against the previous release's (the letters at
any size, 64 places), alternating in every round (ABAB), as the ratio's median and spread:

- the sender's span without its id lists (hot_path.py's call: names, a tool call, a reward);
- a chat span's text (messages, a tool call: the letters y / h / z are common in English);
- a one-span collector body (2,000 ids) and a 1 MiB body of such spans (the ids dominate);
- 5 KiB of text (over the bound: the letters, cut short at 16 places).

    .venv/bin/python bench/redact_search.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import orjson

from tracecar.client import redact
from tracecar.client.redact import RedactKeys

RULES = {"current": (redact.REGEX_BELOW, redact._MIN_PLACES), "previous": (0, 64)}


def bodies(rng: random.Random) -> dict[str, bytes]:
    ids = [rng.randrange(150_000) for _ in range(2000)]
    shell = orjson.dumps({
        "attributes": {"sample_index": 3, "step": 1, "rollout_n": 0, "validate": False, "experiment_name": "bench",
                       "tracecar": {"top": True}},
        "inputs": {"prompt_ids": None, "response_ids": None,
                   "tool_call": {"name": "python_interpreter", "arguments": {"code": "print(sum(range(496)))", "timeout_s": 10},
                                 "id": "call_67c7bf109e08"}, "reward": 0.383},
        "output": {"num_turns": 3, "reward": 0.383, "tool": "python_interpreter", "response_len": 500}, "exception": None})
    chat = orjson.dumps({"attributes": {"step": 1}, "inputs": {"messages": [
        {"role": "system", "content": "You are a helpful assistant. Think step by step, then answer."},
        {"role": "user", "content": "Why is the sky blue? Explain the physics, and mention who worked it out."},
        {"role": "assistant", "content": "Rayleigh scattering: shorter wavelengths scatter more strongly off molecules."}]},
        "output": {"content": "The sky looks blue because air molecules scatter blue light more than red light."}})
    span = orjson.dumps({"span_id": "90f6e7e4c9a26eee0000000000000002", "inputs": {"prompt_ids": ids[:1500]},
                         "output": {"response_ids": ids[1500:]}})
    return {"sender span, ids apart": shell, "chat span text": chat, "one-span body (2,000 ids)": span,
            "1 MiB body of such spans": b"[" + b",".join([span] * 85) + b"]", "5 KiB of text": chat * 12}


def per_call_us(fn: Callable[[], object], budget_s: float = 0.05) -> float:
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if n & 15 == 0 and time.perf_counter() - t0 > budget_s:
            return (time.perf_counter() - t0) * 1e6 / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    keys = RedactKeys()
    measured = {name: {rule: [] for rule in RULES} for name in bodies(random.Random(1))}
    for name, body in bodies(random.Random(1)).items():
        for r in range(args.rounds):
            for rule in (("current", "previous") if r % 2 == 0 else ("previous", "current")):
                redact.REGEX_BELOW, redact._MIN_PLACES = RULES[rule]
                measured[name][rule].append(per_call_us(lambda: keys.might_hold(body)))
    redact.REGEX_BELOW, redact._MIN_PLACES = RULES["current"]
    print(f"{'body':28s} {'bytes':>9s} {'current µs':>11s} {'previous µs':>12s}  current / previous (spread)")
    for name, body in bodies(random.Random(1)).items():
        cur, prev = measured[name]["current"], measured[name]["previous"]
        ratios = sorted(c / p for c, p in zip(cur, prev))
        print(f"{name:28s} {len(body):9,d} {statistics.median(cur):11.2f} {statistics.median(prev):12.2f}  "
              f"{statistics.median(ratios):.2f}× ({ratios[0]:.2f}–{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
