"""glibc's heap for a process that parses one large body after another (glibc on Linux; elsewhere a no-op),
and the garbage collector's thresholds for the same processes (:func:`tune_gc`: the serving process
and each worker-pool process).

Two costs pull against each other. A fresh ``mmap`` per large allocation returns memory to the
OS as soon as it is freed, but every page of it is faulted in and zeroed again next time:
orjson's parse buffer is 12 x the body (``len / 2 * 24`` bytes), so a 1 MiB (then the default)
client body cost ~940 page faults per parse with a 1 MiB mmap threshold, and the body's own
buffer 256 more: together about half of the collector's extra CPU per span over 26c393c
(issue 32). Left in the heap, glibc keeps the high-water mark of every large body ever
processed, which broke the bound on RSS under 64 concurrent 16 MiB uploads
(tests/test_fault_memory.py).

So, with :meth:`Heap.configure` (the serving process only):

- allocations over :data:`MMAP_THRESHOLD` (2 MiB) are their own mmap, returned when freed:
  a large or hostile body never stays in the heap;
- :meth:`Heap.parse_buffer` raises the threshold while one body of at most
  :data:`WARM_BODY_MAX` is parsed, so that its parse buffer (at most 12 x 2 MiB) comes from
  the heap and is reused warm by the next parse of that thread; orjson holds the GIL for the
  whole parse, so no other Python code allocates in that window;
- at most :data:`ARENA_MAX` heaps (arenas): with glibc's default (8 per core) each thread that
  touched a large body could keep up to ``TRIM_THRESHOLD`` of free memory in its own arena, which
  let test_fault_memory's peak wander from +283 to +415 MiB over its 384 MiB bound (+242 to +305
  with two);
- after a request, if RSS grew more than :data:`RETAINED_MAX` since the last trim (one
  ``pread`` of /proc/self/statm, ~2 µs; glibc's own count, ``mallinfo2``, walks every free
  chunk: ~0.5 ms), ``malloc_trim(0)`` hands the free heap back. What stays is at most one
  parse buffer per parsing thread.
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable
from typing import Any, TypeVar

MMAP_THRESHOLD = 2 << 20  #: above: an allocation is its own mmap (a 1 MiB body's buffer stays in the heap)
WARM_BODY_MAX = 2 << 20  #: bodies up to this size are parsed with their parse buffer in the heap
WARM_MMAP_THRESHOLD = 32 << 20  #: the threshold while such a body is parsed (its buffer: <= 12 x 2 MiB)
TRIM_THRESHOLD = 32 << 20  #: free memory at a heap's top kept before glibc shrinks it (a warm parse buffer)
RETAINED_MAX = 64 << 20  #: RSS growth since the last trim a request may leave; above, malloc_trim(0)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
ARENA_MAX = 2  #: glibc heaps at most (its default, 8 x cores, lets each thread's arena keep its own free memory)
_T = TypeVar("_T")


class Heap:
    """The process's malloc settings, the warm parse window and the release of retained memory."""

    def __init__(self) -> None:
        self._mallopt: Any = None
        self._trim: Any = None
        self._statm = -1
        self._floor = 0  # RSS just after the last trim (or the least seen since)
        self.trims = 0

    def configure(self) -> bool:
        """Sets the thresholds; False (and nothing changed) where this is not glibc on Linux."""
        try:
            libc = ctypes.CDLL("libc.so.6")
            mallopt, trim = libc.mallopt, libc.malloc_trim
            statm = os.open("/proc/self/statm", os.O_RDONLY)
        except (OSError, AttributeError):  # not glibc (musl, macOS)
            return False
        trim.argtypes = [ctypes.c_size_t]
        if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
                and mallopt(_M_ARENA_MAX, ARENA_MAX)):
            os.close(statm)
            return False
        self._mallopt, self._trim, self._statm = mallopt, trim, statm
        return True

    def parse(self, loads: Callable[[Any], _T], body: bytes | bytearray) -> _T:
        """``loads(body)`` with its scratch memory in the heap when the body is of usual size."""
        mallopt = self._mallopt
        if mallopt is None or len(body) > WARM_BODY_MAX:
            return loads(body)
        mallopt(_M_MMAP_THRESHOLD, WARM_MMAP_THRESHOLD)
        try:
            return loads(body)
        finally:
            mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)

    def rss(self) -> int:
        """This process's resident set, in bytes (0 where unknown)."""
        if self._statm < 0:
            return 0
        return int(os.pread(self._statm, 128, 0).split()[1]) * _PAGE

    def release_retained(self) -> bool:
        """After a request: malloc_trim(0) when RSS grew more than RETAINED_MAX since the last one."""
        if self._trim is None:
            return False
        rss = self.rss()
        if not self._floor or rss < self._floor:
            self._floor = rss
            return False
        if rss - self._floor <= RETAINED_MAX:
            return False
        self._trim(0)
        self.trims += 1
        self._floor = self.rss()
        return True


_PAGE = os.sysconf("SC_PAGE_SIZE")
HEAP = Heap()


GC_YOUNG_THRESHOLD = 50_000  #: net new containers (allocated minus freed) before a young collection; CPython: 700


def tune_gc() -> None:
    """What exists once the collector is built (every imported module's objects: most of the
    heap) is moved out of the garbage collector's reach (gc.freeze): each full collection walked
    it again, a cost per span that grows with the batches' id lists.

    A young collection comes after :data:`GC_YOUNG_THRESHOLD` net new containers, not 700: a
    body's parsed spans (a few containers each, ~10,000 for a 4 MiB body) are alive from the
    parse to the store write and freed then by reference counting, so with CPython's 700 every
    body was walked, id lists and all, by ~20 young and ~2 middle collections that found nothing
    to free: ~12 % of the CPU per span with token2text off in-process (bench/ingest_inproc.py;
    end to end 1.11x 26c393c's CPU per span before, 1.08x after, docs/performance.md). The
    count is net, so garbage cycles (asyncio's, httpx's) are still collected once 50,000
    containers of them pile up; tests/test_fault_memory.py's peak RSS is unchanged (+275 to +347
    MiB of its 384 MiB bound in 6 runs; with 700, +305 to +348 in 4 runs the same hour)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)
