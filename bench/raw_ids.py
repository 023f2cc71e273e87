"""What the collector would save by keeping id lists as the bytes it received (issue 32 item 1's next lever).

With token2text off, most of the collector's CPU per span is the id lists: ``orjson.loads`` makes
2,000 int objects a span, and the store's payload is dumped back to the same digits. A design that
never turns them into Python ints would locate each ``"..._ids":[...]`` array in the body as bytes,
check that it is plain JSON integers, parse the rest of the body with a placeholder in its place, and
splice the bytes back into the stored payload (``orjson.Fragment``). This measures both on the
real client's bodies (bench/feed.py's ``BodyMaker``: generate calls of 1,500 + 500 ids, prompt deltas
and short ids as the sender packs them, ~1 MiB bodies), in one process, alternating (ABAB):

- ``today``: ``orjson.loads`` of the body, then ``orjson.dumps`` of each span (the parse and the
  payload dump, without the rest of the pipeline);
- ``raw``: the locate pass, the placeholder parse and the spliced dumps;
- ``locate``: the locate pass alone (what every body would pay, token2text on included).

Before timing, it checks that ``raw`` gives each span's bytes exactly as ``today`` does. Nothing
in the collector uses this yet: it is the measurement behind the design, not the design.

    .venv/bin/python bench/raw_ids.py [--rounds 8] [--spans 732]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import alternating_cpu, print_against  # noqa: E402 - after the path

KEY_END = b'_ids":['
DIGITS_AND_COMMAS = b"0123456789,"
PLACEHOLDER_KEY = "\x00raw"  # the placeholder's key; a body that already holds it (escaped) is parsed as it is


def make_bodies(spans: int) -> list[bytes]:
    import ab

    from feed import BodyMaker

    maker = BodyMaker(ab.DEAD_PROXY, seed=1)
    maker.generate_spans(spans, prompt=1500, response=500)
    bodies = [bytes(body) for body, _ in maker.bodies()]
    maker.close()
    return bodies


def locate(body: bytes) -> list[tuple[int, int]]:
    """(start, end) of each ``"…_ids":[…]`` array of plain non-negative integers, in body order.

    In valid JSON ``_ids":[`` can only end a key (a quote inside a string is escaped, and an
    opening quote never follows a letter); an array holding anything but digits and commas, an
    empty item or a leading zero is left to the parser."""
    out, pos, find = [], 0, body.find
    while True:
        key = find(KEY_END, pos)
        if key < 0:
            return out
        start = key + len(KEY_END) - 1
        end = find(b"]", start)
        if end < 0:
            return out
        items = body[start + 1:end]
        if items and not items.translate(None, DIGITS_AND_COMMAS) and b",," not in items \
                and not items.startswith(b",") and not items.endswith(b",") and not _leading_zero(items):
            out.append((start, end + 1))
        pos = end


def _leading_zero(items: bytes) -> bool:
    """A number written with a leading zero ("07"): only an item that starts with 0 can be one, and
    only the id 0 itself does so in a client's packing, so the places to look at are few."""
    if items[0] == 0x30 and len(items) > 1 and items[1] != 0x2C:
        return True
    at = items.find(b",0")
    while at != -1:
        if at + 2 < len(items) and items[at + 2] != 0x2C:
            return True
        at = items.find(b",0", at + 2)
    return False


def today(body: bytes) -> list[bytes]:
    return [orjson.dumps(span) for span in orjson.loads(body)["spans"]]


def raw(body: bytes) -> list[bytes]:
    if b"\\u0000raw" in body:  # a client's own key of that name: no placeholders in this body
        return today(body)
    arrays = locate(body)
    pieces, kept, last = [], [], 0
    for i, (start, end) in enumerate(arrays):
        pieces.append(body[last:start])
        pieces.append(b'{"\\u0000raw":%d}' % i)
        kept.append(orjson.Fragment(body[start:end]))
        last = end
    pieces.append(body[last:])
    parsed = orjson.loads(b"".join(pieces))
    return [orjson.dumps(_splice(span, kept)) for span in parsed["spans"]]


def _splice(value: Any, kept: list[Any]) -> Any:
    """The placeholders put back as the received bytes (the places a client's packing puts id lists:
    the span's inputs and output, and a prompt reference's ``add`` one level down)."""
    for part in ("inputs", "output"):
        container = value.get(part)
        if type(container) is dict:
            for key, item in container.items():
                if type(item) is dict:
                    if PLACEHOLDER_KEY in item:
                        container[key] = kept[item[PLACEHOLDER_KEY]]
                    else:
                        for inner, ids in item.items():
                            if type(ids) is dict and PLACEHOLDER_KEY in ids:
                                item[inner] = kept[ids[PLACEHOLDER_KEY]]
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--spans", type=int, default=732, help="generate spans packed into the bodies")
    args = parser.parse_args()
    bodies = make_bodies(args.spans)
    spans = sum(len(orjson.loads(b)["spans"]) for b in bodies)
    for body in bodies:
        if raw(body) != today(body):
            raise SystemExit("the spliced spans differ from the parsed ones: the probe is wrong")
    located = sum(len(locate(b)) for b in bodies)
    paths = {"today": lambda: [today(b) for b in bodies], "raw": lambda: [raw(b) for b in bodies],
             "locate": lambda: [locate(b) for b in bodies]}
    cpu = alternating_cpu(paths, args.rounds, spans)
    print(f"{len(bodies)} bodies, {spans} spans, {located} id arrays located; {args.rounds} rounds (ABBA); "
          "CPU µs a span; ratio to today: median (spread)")
    print_against(cpu, "today", 8)


if __name__ == "__main__":
    main()
