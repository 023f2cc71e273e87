"""What a worker process's parsed batch costs to send back to the ingest process (TRACECAR_WORKERS > 1).

A worker parses and validates each body and sends the ingest process the span heads
(``worker_pool.prepare``: ids, attributes, and in v2 batches the id lists prompt references need,
packed). Until this stop the ``Validated`` it sent also held the batch envelope's raw span items
(``batch.spans``: every span whole, its id lists as Python ints), which only validation reads:
pickled in the worker and unpickled in the ingest process, the single process every batch goes
through. This measures that round trip (``pickle.dumps`` + ``pickle.loads``, one thread) on the
real client's bodies (bench/feed.py's ``BodyMaker``: generate calls of 1,500 + 500 ids packed by
the real sender, wire version 2), alternating (ABBA):

- ``with_items``: the result as it was sent before (heads + the raw items);
- ``heads``: as it is sent now (the raw items dropped).

    .venv/bin/python bench/worker_heads.py [--rounds 8] [--spans 372]
"""

from __future__ import annotations

import argparse
import copy
import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from raw_ids import make_bodies  # noqa: E402

from tracecar.client.redact import RedactKeys  # noqa: E402
from tracecar.collector.receivers.worker_pool import head_of, parse_batch  # noqa: E402

from common import alternating_cpu, print_against  # noqa: E402 - after the path


def results(spans: int) -> tuple[list[object], list[object], int]:
    """(as sent before, as sent now, spans): prepare's result for each body, both ways."""
    before, now, count = [], [], 0
    for body in make_bodies(spans):
        validated = parse_batch(body, "application/json", None, 100_000, 64 << 20, RedactKeys([]))
        validated.spans = [head_of(s, validated.batch.v) for s in validated.spans]
        count += len(validated.spans)
        before.append((validated, None))
        lean = copy.copy(validated)
        lean.batch = validated.batch.model_copy(update={"spans": []})
        now.append((lean, None))
    return before, now, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--spans", type=int, default=372, help="generate spans packed into the bodies")
    args = parser.parse_args()
    before, now, spans = results(args.spans)
    sizes = {name: sum(len(pickle.dumps(r)) for r in rs) for name, rs in (("with_items", before), ("heads", now))}
    paths = {"with_items": lambda: [pickle.loads(pickle.dumps(r)) for r in before],
             "heads": lambda: [pickle.loads(pickle.dumps(r)) for r in now]}
    cpu = alternating_cpu(paths, args.rounds, spans)
    print(f"{len(before)} bodies, {spans} spans; pickled: with_items {sizes['with_items'] / 1e6:.2f} MB, "
          f"heads {sizes['heads'] / 1e6:.2f} MB; {args.rounds} rounds (ABBA); CPU µs a span (dumps + loads); "
          "ratio to with_items: median (spread)")
    print_against(cpu, "with_items", 10)


if __name__ == "__main__":
    main()
