"""One collector per data dir: an exclusive lock held for the process's life.

Two collectors on one store double what the viewer lists and race each other's forwarding
(issue 28, item 8: the quickstart's own "port busy" hint once led there). ``flock`` on a file in
the data dir decides: the kernel drops the lock with the last descriptor of its holder, so a
collector killed by SIGKILL never leaves a stale lock behind, and the file's content (the
holder's pid and, once it has bound, its port) is only ever read to name the holder. The file is
never deleted (unlinking a lock file races a process about to lock it). Any process tracecar
runs on a data dir takes it the same way (:func:`hold`).
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCK_NAME = "collector.lock"
NOTE_BYTES = 255


class DataDirError(RuntimeError):
    """The data dir cannot be taken: the message says why, in one line."""


class DataDirInUse(DataDirError):
    """Another live process holds the data dir; the message names it (one line)."""

    def __init__(self, data_dir: Path | str, holder: dict[str, Any], options: str = "--data-dir / TRACECAR_DATA_DIR") -> None:
        self.data_dir, self.holder = data_dir, holder
        super().__init__(f"data dir {data_dir} is in use by {describe(holder)}: stop it, or give this one another "
                         f"{options} (one collector per data dir)")


def describe(holder: dict[str, Any]) -> str:
    """'the collector with pid 123 on port 9470', from what the holder wrote (either may be missing)."""
    pid, port = holder.get("pid"), holder.get("port")
    role = holder.get("role") or "collector"
    where = f" on port {port}" if port is not None else " (not listening yet)"
    return f"the {role} with pid {pid if pid is not None else 'unknown'}{where}"


def _read(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw.decode()) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


@dataclass
class DataDirLock:
    """The held lock: its descriptor stays open (not inherited by children) until :meth:`release` or exit."""

    path: Path
    fd: int
    holder: dict[str, Any]

    def note(self, **fields: Any) -> None:
        """Adds what a second process should be told (``port=`` once bound) to the lock file."""
        self.holder.update(fields)
        data = json.dumps(self.holder).encode()
        # one write of a fixed size, never a truncation first: a reader sees the old content or the new
        os.pwrite(self.fd, data.ljust(max(NOTE_BYTES, len(data))) + b"\n", 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = -1


def hold(data_dir: Path | str, role: str = "collector") -> DataDirLock:
    """Takes the data dir's lock for this process, or raises :class:`DataDirInUse` naming the holder
    (:class:`DataDirError` when the dir or its lock file cannot be made or locked at all)."""
    directory = Path(data_dir)
    path = directory / LOCK_NAME
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise DataDirError(f"data dir {data_dir}: cannot open {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise DataDirInUse(data_dir, holder) from None
    except OSError as exc:  # e.g. a file system without locks
        os.close(fd)
        raise DataDirError(f"data dir {data_dir}: cannot lock {path}: {exc.strerror or exc}") from None
    lock = DataDirLock(path, fd, {})
    lock.note(pid=os.getpid(), role=role)
    return lock


def holder_of(data_dir: Path | str) -> dict[str, Any] | None:
    """Who holds ``data_dir`` now (what it wrote: pid, port), or None when nobody does. Takes nothing."""
    path = Path(data_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
