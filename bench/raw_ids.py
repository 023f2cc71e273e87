"""What keeping id lists as the bytes received saves the collector (issue 32 item 1), on its own code.

With token2text off, most of the collector's CPU per span was the id lists: ``orjson.loads`` made
2,000 int objects a span, and the store's payload dumped them back to the same digits. The
collector now locates each ``"..._ids":[...]`` array of plain integers as bytes, parses the rest
of the body with a placeholder in its place, and splices the bytes back into the stored payload
(``tracecar.collector.receivers.raw_ids``). This measures both on the real client's bodies
(bench/feed.py's ``BodyMaker``: generate calls of 1,500 + 500 ids packed by the real sender,
wire version 2, ~1.75 MiB bodies), in one process, alternating (ABBA), through the collector's
own functions (``parse_batch``: decompress, parse, validate; ``pack_payload`` of each span):

- ``lists``: ``keep_ids=False`` (the path a batch that decodes takes, and every batch before);
- ``raw``: ``keep_ids=True``;
- ``locate``: the locate pass alone (what a body with id arrays pays first).

Before timing, it checks that both give each span's payload byte for byte the same.

    .venv/bin/python bench/raw_ids.py [--rounds 8] [--spans 732]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tracecar.client.redact import RedactKeys  # noqa: E402
from tracecar.collector.heap import HEAP  # noqa: E402
from tracecar.collector.receivers.raw_ids import locate  # noqa: E402
from tracecar.collector.receivers.worker_pool import parse_batch  # noqa: E402
from tracecar.collector.spool.payload import pack_payload  # noqa: E402

from common import alternating_cpu, print_against  # noqa: E402 - after the path

KEYS = RedactKeys([])


def make_bodies(spans: int) -> list[bytes]:
    import ab

    from feed import BodyMaker

    maker = BodyMaker(ab.DEAD_PROXY, seed=1)
    maker.generate_spans(spans, prompt=1500, response=500)
    bodies = [bytes(body) for body, _ in maker.bodies()]
    maker.close()
    return bodies


def stored(body: bytes, keep_ids: bool) -> list[bytes]:
    validated = parse_batch(body, "application/json", None, 100_000, 64 << 20, KEYS, keep_ids=keep_ids)
    return [pack_payload(span)[0] for span in validated.spans]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--spans", type=int, default=732, help="generate spans packed into the bodies")
    args = parser.parse_args()
    HEAP.configure()  # the heap as `tracecar serve` sets it (large temporaries stay in the heap, no page faults)
    bodies = make_bodies(args.spans)
    spans = sum(len(orjson.loads(b)["spans"]) for b in bodies)
    for body in bodies:
        if stored(body, True) != stored(body, False):
            raise SystemExit("the payloads differ between the two paths: the collector is wrong")
    located = sum(len(locate(b)) for b in bodies)
    paths = {"lists": lambda: [stored(b, False) for b in bodies], "raw": lambda: [stored(b, True) for b in bodies],
             "locate": lambda: [locate(b) for b in bodies]}
    cpu = alternating_cpu(paths, args.rounds, spans)
    print(f"{len(bodies)} bodies, {spans} spans, {located} id arrays located; {args.rounds} rounds (ABBA); "
          "CPU µs a span; ratio to lists: median (spread)")
    print_against(cpu, "lists", 8)


if __name__ == "__main__":
    main()
