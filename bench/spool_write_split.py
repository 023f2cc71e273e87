"""Where the store's write CPU goes: the WAL append, the checkpoint's copy, and its fsyncs.

A span with 2,000 token ids is a ~12.6 kB payload: SQLite writes it to the WAL at commit, and
an automatic checkpoint (every 1,000 WAL pages) copies it into the database file and fsyncs
both files, all on the writing thread. This separates the three with the spool's own
connection settings (``tracecar.collector.spool.store._connect``: WAL, ``synchronous=NORMAL``)
and a table shaped like the spool's (a unique span id, an indexed trace id, the payload), by
turning one thing off at a time (neither is safe to ship: see the docstring of each variant);
variants alternate in every round (ABAB), and each prints its process user and system CPU per
row and its total against ``spool`` (the shipped settings) in the same round:

- ``spool``: the shipped settings;
- ``no-checkpoint``: ``wal_autocheckpoint=0``: the WAL grows without bound (what a checkpoint costs);
- ``no-fsync``: ``synchronous=OFF``: the checkpoint copies but never fsyncs (a power loss can
  corrupt the file).

    .venv/bin/python bench/spool_write_split.py [--rounds 4] [--transactions 40]
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import tempfile
from pathlib import Path

import orjson

from tracecar.collector.spool.store import _connect

VARIANTS = {"spool": (), "no-checkpoint": ("PRAGMA wal_autocheckpoint=0",), "no-fsync": ("PRAGMA synchronous=OFF",)}
ROWS_PER_TRANSACTION = 183  # bench/ab.py's collector workload: a 1.75 MiB client body


def payloads(rng: random.Random) -> list[bytes]:
    return [orjson.dumps({"inputs": {"prompt_ids": [rng.randrange(150_000) for _ in range(1500)]},
                          "output": {"response_ids": [rng.randrange(150_000) for _ in range(500)]}})
            for _ in range(ROWS_PER_TRANSACTION)]


def run(path: Path, pragmas: tuple[str, ...], bodies: list[bytes], transactions: int) -> tuple[float, float]:
    """(user, system) CPU µs per row."""
    conn = _connect(path, "normal")
    for pragma in pragmas:
        conn.execute(pragma)
    conn.execute("CREATE TABLE spans (seq INTEGER PRIMARY KEY AUTOINCREMENT, span_id TEXT NOT NULL UNIQUE,"
                 " trace_id TEXT NOT NULL, payload BLOB NOT NULL)")
    conn.execute("CREATE INDEX spans_trace ON spans(trace_id)")
    before = resource.getrusage(resource.RUSAGE_SELF)
    for t in range(transactions):
        rows = [(f"{t:08x}{i:08x}", f"{t:08x}{i // 5:08x}", body) for i, body in enumerate(bodies)]
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO spans (span_id, trace_id, payload) VALUES (?,?,?)", rows)
        conn.execute("COMMIT")
    after = resource.getrusage(resource.RUSAGE_SELF)
    conn.close()
    n = transactions * len(bodies)
    return (after.ru_utime - before.ru_utime) * 1e6 / n, (after.ru_stime - before.ru_stime) * 1e6 / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--transactions", type=int, default=40, help="per variant and round")
    args = parser.parse_args()
    bodies = payloads(random.Random(1))
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="tracecar-spool-split-") as tmp:
        for r in range(args.rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
            for name in order:
                cpu[name].append(run(Path(tmp) / f"{name}-{r}.db", VARIANTS[name], bodies, args.transactions))
    print(f"{len(bodies[0]):,}-byte payloads, {ROWS_PER_TRANSACTION} rows a transaction, {args.transactions} transactions "
          f"per variant and round, {args.rounds} rounds (ABAB)")
    print(f"{'variant':15s} {'user µs/row':>12s} {'system µs/row':>14s} {'total / spool (spread)':>24s}")
    base = [u + s for u, s in cpu["spool"]]
    for name, rows in cpu.items():
        ratios = sorted((u + s) / b for (u, s), b in zip(rows, base))
        print(f"{name:15s} {statistics.median(u for u, _ in rows):12.1f} {statistics.median(s for _, s in rows):14.1f} "
              f"{statistics.median(ratios):>12.2f}× ({ratios[0]:.2f}–{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
