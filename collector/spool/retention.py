"""Retention: the store of forwarded spans gets a bound; the spool of unforwarded ones keeps its own.

With ``TRACECAR_KEEP_FORWARDED=true`` (the default) forwarded spans stay in the SQLite file so
the viewer and ``/v1/trajectories`` can read them. Without a bound that file would grow until
the disk is full, and then even the spool of not-yet-forwarded spans could not take a batch.
So the oldest forwarded trajectories are evicted, always whole (every span of the trace is
forwarded, else the trace is left alone):

* above ``TRACECAR_STORE_MAX_BYTES`` of used file pages (reason ``max_bytes``);
* older than ``TRACECAR_STORE_MAX_AGE_S`` by their last span's arrival (reason ``max_age``);
* when a write failed on a full disk, when forwarding to a backend, which holds the forwarded
  spans (reason ``disk_full``). In local mode the store is the only copy: a full disk answers
  503 and nothing stored is evicted unless a bound above says so.

Spans waiting to be forwarded (pending) or held for a sampling decision are never evicted.
The sampling-decision tables get a row bound of their own (``TRACECAR_DECISIONS_MAX_ROWS``,
oldest rows first), checked with the age rule.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from ..loudness import BackgroundFailures, RateLimited, describe_error
from ..metrics import Metrics
from .archive import SpanArchive
from .store import ArchiveFailed, Spool, SpoolFull

log = logging.getLogger("tracecar.collector.retention")

_DISK_FULL_EVICT_BYTES = 16 * 2**20  # at least this much is evicted after a full-disk refusal
_AGE_CHECK_S = 10.0  # the age rule scans the store; the size rule is three PRAGMAs
_ARCHIVE_CHECK_S = 60.0  # the span archive's bound: one query of ClickHouse's parts


class Retention:
    def __init__(self, spool: Spool, metrics: Metrics, *, max_bytes: int | None, max_age_s: float | None,
                 evict_on_disk_full: bool, reserve_bytes: int = 0, tick_s: float = 1.0,
                 decisions_max_rows: int | None = None, forgotten_ids_max: int | None = None,
                 archive_max_bytes: int | None = None) -> None:
        self.spool = spool
        # disk space held back (a preallocated file): SQLite cannot even delete on a full disk
        # (a delete writes the WAL, a checkpoint may grow the main file), so a full disk first
        # releases this, then evicts, then gives the freed pages back and takes it again
        self.reserve_bytes = reserve_bytes if evict_on_disk_full else 0
        self.reserve_path = spool.path.parent / "reserve"
        self.reserve_out = False  # released on a full disk and not taken back yet: ingest waits
        self.metrics = metrics
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.evict_on_disk_full = evict_on_disk_full
        self.tick_s = tick_s
        self.decisions_max_rows = decisions_max_rows
        self.forgotten_ids_max = forgotten_ids_max
        self._age_checked = 0.0
        self._decisions_checked = 0.0
        self._disk_full_seen: float | None = None
        self._archive_failures = RateLimited()
        self._failures = BackgroundFailures(metrics.background_failures)
        self.archive_max_bytes = archive_max_bytes  # the span archive's own bound (spool/archive.py)
        self._archive_checked = 0.0

    async def run(self) -> None:
        """Applies the rules every tick until cancelled (on a worker thread: SQLite work)."""
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await asyncio.to_thread(self.apply)
            except Exception:  # noqa: BLE001 - retention must not stop; the next tick retries
                self._failures.failed("retention", "retention: eviction failed; retrying next tick")

    def take_reserve(self) -> bool:
        """Preallocates the reserve file if it is missing; False when the disk has no room for it."""
        if self.reserve_bytes <= 0 or self.reserve_path.exists():
            return True
        try:
            fd = os.open(self.reserve_path, os.O_CREAT | os.O_WRONLY, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.reserve_bytes)
            finally:
                os.close(fd)
            return True
        except OSError:
            self.reserve_path.unlink(missing_ok=True)
            return False

    def _release_reserve(self) -> bool:
        if self.reserve_path.exists():
            self.reserve_path.unlink(missing_ok=True)
            return True
        return False

    def apply(self) -> None:
        full_at = self.spool.disk_full_at
        if self.evict_on_disk_full and (self.reserve_out or (full_at is not None and full_at != self._disk_full_seen)):
            self._disk_full_seen = full_at
            self.make_room(_DISK_FULL_EVICT_BYTES)
        elif full_at is None or time.monotonic() - full_at > 5.0:
            self.take_reserve()  # e.g. there was no room for it at start
        if self.max_bytes is not None:
            self._enforce_max_bytes()
        if self.decisions_max_rows is not None and time.monotonic() - self._decisions_checked >= _AGE_CHECK_S:
            self._decisions_checked = time.monotonic()  # a COUNT(*) per table: not every tick
            for table, rows in self.spool.trim_decisions(self.decisions_max_rows).items():
                self.metrics.decisions_evicted.labels(table=table).inc(rows)
            if self.forgotten_ids_max is not None:
                self.metrics.decisions_evicted.labels(table="forgotten_spans").inc(self.spool.trim_forgotten(self.forgotten_ids_max))
        archive = self.spool.archive
        if archive is not None and self.archive_max_bytes is not None and \
                time.monotonic() - self._archive_checked >= _ARCHIVE_CHECK_S:
            self._archive_checked = time.monotonic()
            self._trim_archive(archive, self.archive_max_bytes)
        now = time.time()
        if self.max_age_s is not None and time.monotonic() - self._age_checked >= min(_AGE_CHECK_S, self.max_age_s):
            self._age_checked = time.monotonic()
            while True:
                batch = self.spool.oldest_forwarded(500, before=now - self.max_age_s, listed_only=True)
                if not batch or not self._evict([t for t, _, _ in batch], "max_age")[0]:
                    break

    def make_room(self, need_bytes: int) -> bool:
        """After a full-disk refusal: release the reserve, evict forwarded trajectories, take it back.

        While the reserve is out (``reserve_out``) ingest answers 503: the released space is for
        the forwarder to record what the backend took and for the evictions, not for new spans.
        The WAL is checkpointed first, so the deletes reuse its space instead of growing it.
        Returns True when there is room again (the refused write is worth one more try).
        """
        if not self.evict_on_disk_full:
            return False
        released_now = self._release_reserve()
        if released_now:
            self.reserve_out = True
        self.spool.checkpoint()
        freed = 0
        while freed < max(need_bytes, _DISK_FULL_EVICT_BYTES):
            batch = self.spool.oldest_forwarded(200)
            if not batch:
                break
            try:  # deleted, not moved: an embedded ClickHouse on this same full disk could not take them
                done, _ = self._evict([t for t, _, _ in batch], "disk_full", to_archive=False)
            except SpoolFull:
                break
            if not done:
                break
            freed += sum(b for _, _, b in batch)
        if freed:
            self.spool.shrink()
            log.warning("disk full: evicted %d bytes of forwarded trajectories to make room", freed,
                        extra={"event": "store_evicted", "reason": "disk_full", "bytes": freed})
        # taken back on a later tick, not in the call that released it: the forwarder needs that
        # space to record what the backend took (only then are those trajectories evictable), and
        # retaking it at once left it no moment to do so (a full disk could stay full for good)
        if self.reserve_out and not released_now and self.take_reserve():
            self.reserve_out = False
        return not self.reserve_out if self.reserve_bytes > 0 else freed > 0

    def _enforce_max_bytes(self) -> None:
        assert self.max_bytes is not None
        for _ in range(50):  # pages free up roughly as rows go: re-measure after each chunk
            excess = self.spool.used_bytes() - self.max_bytes
            if excess <= 0:
                return
            target = excess + self.max_bytes // 20  # evict 5 % below the bound: fewer, larger rounds
            chosen, total = [], 0
            for trace_id, _, nbytes in self.spool.oldest_forwarded(2000, listed_only=True):
                chosen.append(trace_id)
                total += nbytes
                if total >= target:
                    break
            if not chosen or not self._evict(chosen, "max_bytes")[0]:
                return  # nothing forwarded left to evict: the spool's own bound applies
            self.spool.shrink()  # the file itself follows the bound

    def _trim_archive(self, archive: SpanArchive, max_bytes: int) -> None:
        try:
            dropped = archive.trim(max_bytes)
        except Exception as exc:  # noqa: BLE001 - the store's own error count has it; the next check retries
            log.warning("retention: could not bound %s's span archive: %s", archive.describe, describe_error(exc),
                        extra={"event": "store_archive_trim_failed"})
            return
        if dropped:
            self.metrics.store_archive_dropped_bytes.inc(dropped)
            log.warning("retention: dropped the oldest %d bytes of archived spans above TRACECAR_STORE_ARCHIVE_MAX_BYTES",
                        dropped, extra={"event": "store_archive_dropped", "bytes": dropped})

    def _evict(self, trace_ids: list[str], reason: str, to_archive: bool = True) -> tuple[int, int]:
        """Evicts these trajectories (to the archive first, when there is one and ``to_archive``: spool/archive.py);
        an archive that refuses keeps them in the spool, counted and logged (at most once a minute), never lost."""
        try:
            trajectories, spans = self.spool.evict(trace_ids, to_archive)
        except ArchiveFailed as failed:
            trajectories, spans = failed.moved, failed.spans
            self.metrics.store_archive_failures.inc()
            count = self._archive_failures.hit()
            if count is not None:
                archive = self.spool.archive
                log.warning("retention: %s refused evicted trajectories (%d time(s) since last said); they stay in the "
                            "spool, retried next tick: %s", archive.describe if archive else "the archive", count,
                            str(failed)[:300], extra={"event": "store_archive_failed", "reason": reason})
        if spans and self.spool.archive is not None and to_archive:
            self.metrics.store_archived_spans.inc(spans)
        if trajectories:
            self.metrics.store_evicted_trajectories.labels(reason=reason).inc(trajectories)
            self.metrics.store_evicted_spans.labels(reason=reason).inc(spans)
        return trajectories, spans
