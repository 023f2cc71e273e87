"""A process tracecar starts ends when the process that started it ends, however that ends.

SIGKILL, the OOM killer or a Ray actor's death give the parent no chance to stop its children,
and a child re-parented to init lives on for ever (issue 33: 45 orphaned worker processes, 3 GiB,
after 15 collector kills). Two mechanisms, because neither covers every case alone:

* Linux's ``PR_SET_PDEATHSIG`` (:func:`set_parent_death_signal`): the kernel signals the child the
  moment its parent goes. The "parent" is the *thread* that started the child, though: a child
  started from a thread that ends before the process does gets the signal while its parent
  process still runs. So :func:`die_with_parent` never obeys the signal blindly: its handler
  checks that the parent process is really gone.
* a daemon thread in the child (:func:`watch_parent`) that compares ``os.getppid()`` with the pid
  it was started by, every :data:`POLL_S`: it works on every platform, and bounds the delay where
  ``prctl`` is not available or the signal was lost.

Imported by the thin client (the quickstart, the Ray helper) and by the collector (its worker
pool); it needs nothing beyond the standard library.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
#: How often the watch thread compares os.getppid() with the parent's pid (the bound without prctl).
POLL_S = 0.2
#: What :func:`die_with_parent` asks the kernel to send: a signal nothing else in a worker uses, so
#: its handler can tell "parent gone" from "the thread that started me ended" (see the module).
ORPHAN_SIGNAL = signal.SIGUSR1
#: The exit status of a child that found itself orphaned (:func:`exit_now`).
ORPHANED_EXIT = 75


def set_parent_death_signal(signum: int) -> bool:
    """Linux: the kernel sends ``signum`` to this process when its parent thread ends (even by SIGKILL).

    Safe between fork and exec (it is one ``prctl`` call) and kept across ``exec``. False where
    unavailable (not Linux, no libc symbol): the caller then relies on :func:`watch_parent`.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return int(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def parent_is_gone(parent_pid: int) -> bool:
    """Whether the process ``parent_pid`` that started this one has ended (this one was re-parented)."""
    return os.getppid() != parent_pid


def exit_now() -> None:
    """Ends this process at once: no atexit hooks, no finalizers, no flushing of anything the parent owned."""
    os._exit(ORPHANED_EXIT)


def watch_parent(parent_pid: int, on_orphan: Callable[[], None], poll_s: float = POLL_S) -> threading.Thread:
    """Calls ``on_orphan`` (once, from a daemon thread) within ``poll_s`` of the parent process ending."""

    def watch() -> None:
        while not parent_is_gone(parent_pid):
            time.sleep(poll_s)
        on_orphan()

    thread = threading.Thread(target=watch, name="tracecar-parent-watch", daemon=True)
    thread.start()
    return thread


def die_with_parent(parent_pid: int, on_orphan: Callable[[], None] = exit_now, *, poll_s: float = POLL_S,
                    signum: int = ORPHAN_SIGNAL) -> bool:
    """In a child, as early as it can run Python: ``on_orphan`` runs once when ``parent_pid`` ends.

    Call it from the main thread (it installs a signal handler). The kernel's signal (Linux) makes
    it immediate, the watch thread makes it certain; a parent that ended before this call is
    caught too. ``on_orphan`` defaults to :func:`exit_now` (a worker that owns nothing); a process
    with something to drain passes its own (e.g. send itself SIGTERM). True when the kernel's
    signal is armed.
    """
    once = threading.Lock()

    def orphaned() -> None:
        if once.acquire(blocking=False):
            on_orphan()

    def on_signal(sig: int, frame: object) -> None:
        if parent_is_gone(parent_pid):  # not merely the thread that started this process ending
            orphaned()

    signal.signal(signum, on_signal)  # before prctl, so the signal never finds the default action (terminate)
    armed = set_parent_death_signal(signum)
    if parent_is_gone(parent_pid):  # it ended before the signal was armed
        orphaned()
    watch_parent(parent_pid, orphaned, poll_s)
    return armed
