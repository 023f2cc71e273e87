"""The trajectory index's fold, this tree against another revision, same spool, same run (ABAB).

Builds one spool of demo-shaped trajectories (bench/viewer_store.py), then folds it into a fresh
viewer index from nothing under this tree's interpreter and under the other revision's, alternating
``--rounds`` times, and prints each side's process CPU and the ratio per pair (what the index's
background thread spends per span: the cost behind "spans/s to queryable"). The other revision's
interpreter is a build of bench/ab.py (``--keep`` leaves it in ``/tmp/tracecar-ab-<sha>``):

    .venv/bin/python bench/ab.py --against 999b6d7 --parts collector --rounds 1 --keep
    .venv/bin/python bench/index_fold.py --other /tmp/tracecar-ab-999b6d73014d/.venv/bin/python
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from viewer_store import build  # noqa: E402 - after the path

from common import machine_note  # noqa: E402

FOLD = """
import sys, time
from pathlib import Path
from tracecar.collector.viewer.index import TrajectoryIndex
spool, out = Path(sys.argv[1]), Path(sys.argv[2])
for suffix in ("", "-wal", "-shm"):
    Path(str(out) + suffix).unlink(missing_ok=True)
started = time.process_time()
index = TrajectoryIndex(spool, out)
while not index.refresh(budget_s=60):
    pass
index.close()
print(time.process_time() - started)
"""


def fold(python: str, spool: Path, out: Path) -> float:
    """One fold from nothing in a fresh process (run from the spool's folder: the interpreter's own tracecar)."""
    done = subprocess.run([python, "-c", FOLD, str(spool), str(out)], capture_output=True, text=True, check=True,
                          cwd=spool.parent, timeout=1800)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="the other revision's python (a bench/ab.py build)")
    ap.add_argument("--spans", type=int, default=300_000)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    print(machine_note(), flush=True)
    with tempfile.TemporaryDirectory(prefix="tracecar-index-fold-") as tmp:
        spool = Path(tmp) / "spool.sqlite3"
        spans, trajectories = build(spool, args.spans)
        print(f"{spans:,} spans, {trajectories:,} trajectories; process CPU of one fold from nothing, s", flush=True)
        ratios = []
        for n in range(args.rounds):
            this = fold(sys.executable, spool, Path(tmp) / "this.sqlite3")
            other = fold(args.other, spool, Path(tmp) / "other.sqlite3")
            ratios.append(this / other)
            print(f"  round {n + 1}: this {this:6.2f}  other {other:6.2f}  ratio {this / other:5.2f}", flush=True)
    print(machine_note())
    print(f"RATIO this / other: median {statistics.median(ratios):.2f} (spread {min(ratios):.2f}–{max(ratios):.2f},"
          f" {len(ratios)} rounds)")


if __name__ == "__main__":
    main()
