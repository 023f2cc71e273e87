"""One revision's ingest pipeline in-process, its executors run inline: for instruction counts.

The collector's stages (parse, validate, prompt contexts, serialise, store write) on the same
pre-packed client bodies as bench/ab.py's collector workload (generate calls of 1,500 + 500 ids,
~1 MiB bodies), without HTTP, threads or the machine's load in the way. Run it under
``valgrind --tool=callgrind`` twice, with ``--bodies 3`` and ``--bodies 9``, and difference the
totals (and per function): instructions per span that do not move with the machine, for small
differences the process runs of bench/ab.py cannot resolve. It imports whichever tracecar the
interpreter has, the current layout or 26c393c's (``collector/pipeline.py``, ``collector/spool.py``),
so the same file measures a build of bench/ab.py (``/tmp/tracecar-ab-<sha>/.venv/bin/python``).
The bodies are made once by this tree's client and kept in ``--bodies-file`` (the other
revision's interpreter reads them from there, with this file's directory on its path).

    .venv/bin/python bench/ingest_inproc.py --make-bodies
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=this-9.out \
        .venv/bin/python bench/ingest_inproc.py --bodies 9
    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=old-9.out \
        /tmp/tracecar-ab-26c393c71760/.venv/bin/python bench/ingest_inproc.py --bodies 9

Without valgrind it prints the process CPU per span (and the garbage collector's share).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import gc
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from feed import fresh  # noqa: E402 - after the path


def make_bodies(path: Path, spans: int, prompt: int, response: int) -> None:
    import ab

    from feed import BodyMaker

    maker = BodyMaker(ab.DEAD_PROXY, seed=1)
    maker.generate_spans(spans, prompt=prompt, response=response)
    path.write_bytes(pickle.dumps((maker.bodies(), maker.content_type)))
    maker.close()


def pipeline(data_dir: Path, tokenizer: str | None = None) -> tuple[Any, Any]:
    """(IngestPipeline, Spool) of the installed revision, local store, executors inline; token2text with
    ``tokenizer`` (a tokenizer.json), else off."""
    from tracecar.collector.metrics import Metrics
    from tracecar.collector.settings import CollectorSettings

    try:  # the current layout: the serving process's heap and garbage-collector settings too
        from tracecar.collector.heap import HEAP
        from tracecar.collector.receivers.pipeline import IngestPipeline
        from tracecar.collector.service.server import tune_gc
        from tracecar.collector.spool.store import Spool
        HEAP.configure()
    except ImportError:  # 26c393c: flat modules, no mmap threshold, no gc.freeze
        from tracecar.collector.pipeline import IngestPipeline  # type: ignore[no-redef]
        from tracecar.collector.spool import Spool  # type: ignore[no-redef]

        def tune_gc() -> None:
            pass
    settings = CollectorSettings(data_dir=data_dir, token2text=tokenizer is not None, tokenizer=tokenizer,
                                 workers=1)
    spool = Spool(settings.spool_path, local_only=True)
    pl = IngestPipeline(settings, spool, Metrics())
    tune_gc()
    pl.cpu = pl.writer = Inline()
    return pl, spool


class Inline(cf.Executor):
    """Runs each stage at once on the calling thread (no thread hand-offs to count)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        future: cf.Future[Any] = cf.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            future.set_exception(exc)
        return future


async def feed(pl: Any, bodies: list[tuple[bytes, int]], content_type: str, first: int, n: int) -> tuple[int, float]:
    """(spans acknowledged, process CPU seconds) for bodies ``first`` .. ``first + n`` (fresh ids each)."""
    prepared = [(bytearray(fresh(bodies[i % len(bodies)][0], 0x77, i)), bodies[i % len(bodies)][1]) for i in range(first, first + n)]
    spans, cpu0 = 0, time.process_time()
    for body, count in prepared:
        result = await pl.ingest(body, content_type, None)
        if result.accepted != count:
            raise RuntimeError(f"{count} spans sent, {result.accepted} accepted: {result.as_dict()}")
        spans += count
    return spans, time.process_time() - cpu0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bodies", type=int, default=20, help="bodies measured (after --warm)")
    parser.add_argument("--warm", type=int, default=2, help="bodies ingested first, not measured")
    parser.add_argument("--bodies-file", type=Path, default=Path(tempfile.gettempdir()) / "tracecar-ingest-inproc-bodies.pkl")
    parser.add_argument("--make-bodies", action="store_true", help="(re)make the bodies file with this tree's client")
    parser.add_argument("--spans", type=int, default=1600, help="with --make-bodies: generate spans in all")
    parser.add_argument("--ids", type=int, default=2000, help="with --make-bodies: ids per span (3/4 prompt)")
    parser.add_argument("--tokenizer", help="token2text on, with this tokenizer.json (default: off)")
    args = parser.parse_args()
    if args.make_bodies or not args.bodies_file.exists():
        make_bodies(args.bodies_file, args.spans, args.ids * 3 // 4, args.ids - args.ids * 3 // 4)
        if args.make_bodies:
            return
    bodies, content_type = pickle.loads(args.bodies_file.read_bytes())
    with tempfile.TemporaryDirectory(prefix="ingest-inproc-") as tmp:
        pl, spool = pipeline(Path(tmp), args.tokenizer)
        gc_cpu = [0.0, 0.0]

        def timer(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                gc_cpu[1] = time.process_time()
            else:
                gc_cpu[0] += time.process_time() - gc_cpu[1]
        async def run() -> tuple[int, float]:
            await feed(pl, bodies, content_type, 0, args.warm)
            gc.callbacks.append(timer)
            try:
                return await feed(pl, bodies, content_type, 100, args.bodies)
            finally:
                gc.callbacks.remove(timer)
        try:
            spans, cpu = asyncio.run(run())
        finally:
            pl.close()
            spool.close()
    print(f"{cpu / spans * 1e6:.1f} µs CPU per span over {spans} spans ({args.bodies} bodies); "
          f"garbage collector {gc_cpu[0] / spans * 1e6:.1f} µs of it")


if __name__ == "__main__":
    main()
