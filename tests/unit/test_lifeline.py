"""tracecar.client.lifeline: a child ends when the process that started it ends, however it ends.

Real processes: the test starts a "parent" Python process that starts a "child" calling
``die_with_parent``; the test SIGKILLs the parent and watches the child with psutil.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest

from tracecar.client import lifeline

pytestmark = pytest.mark.timeout(60)
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# The child: armed (or with prctl made unavailable: the watch thread alone), then prints "ready" and sleeps.
CHILD = """
import os, sys, time
from tracecar.client import lifeline
if sys.argv[1] == "no-prctl":
    lifeline.set_parent_death_signal = lambda signum: False
armed = lifeline.die_with_parent(int(sys.argv[2]))
print("ready", armed, flush=True)
time.sleep(120)
"""

# The parent: starts the child (from the main thread, or from a thread that then ends), prints its pid, sleeps.
PARENT = """
import os, subprocess, sys, threading, time
child = {}
def start():
    child["p"] = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(os.getpid())],
                                  stdout=subprocess.PIPE, text=True)
    child["line"] = child["p"].stdout.readline().strip()  # armed
if sys.argv[3] == "thread":
    t = threading.Thread(target=start)
    t.start()
    t.join()  # the thread that started the (armed) child has ended: the kernel has sent the death signal
    time.sleep(0.5)  # for the child to handle it
else:
    start()
print(child["p"].pid, child["line"], flush=True)
time.sleep(120)
"""


def _start(mode: str, started_from: str = "main") -> tuple[subprocess.Popen[str], psutil.Process, str]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, mode, started_from], stdout=subprocess.PIPE, text=True)
    line = parent.stdout.readline().split()  # type: ignore[union-attr]
    assert line[1:2] == ["ready"], line
    return parent, psutil.Process(int(line[0])), line[2]


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _seconds_until_gone(proc: psutil.Process, limit_s: float) -> float:
    started = time.monotonic()
    while not _gone(proc):
        if time.monotonic() - started > limit_s:
            break
        time.sleep(0.01)
    return time.monotonic() - started


def _cleanup(*procs: Any) -> None:
    for p in procs:
        try:
            p.kill()
        except (ProcessLookupError, psutil.NoSuchProcess, OSError):
            pass


@pytest.mark.parametrize("mode", [pytest.param("prctl", marks=linux_only), "no-prctl"])
def test_a_child_ends_within_a_second_of_its_parents_sigkill(mode: str) -> None:
    parent, child, armed = _start(mode)
    try:
        assert armed == str(mode == "prctl")
        assert child.ppid() == parent.pid
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        took = _seconds_until_gone(child, 5)
        assert _gone(child), "the child outlived its parent's SIGKILL"
        assert took < 1.0, f"the child took {took:.2f} s to notice its parent was gone"
    finally:
        _cleanup(parent, child)


@linux_only
def test_a_child_started_from_a_thread_that_ends_lives_on_while_its_parent_does() -> None:
    """PR_SET_PDEATHSIG fires when the *thread* that started the child ends: that alone must not end it."""
    parent, child, armed = _start("prctl", started_from="thread")
    try:
        assert armed == "True"
        assert not _gone(child), "the child died with the thread that started it, its parent process alive"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _seconds_until_gone(child, 5) < 1.0
    finally:
        _cleanup(parent, child)


def test_a_child_whose_parent_ended_before_it_was_armed_exits_at_once() -> None:
    """The race between start and arming: the parent pid it was given is no longer its parent."""
    done = subprocess.run([sys.executable, "-c", CHILD, "prctl", str(os.getpid() + 10**6)], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == lifeline.ORPHANED_EXIT, done.stderr
    assert "ready" not in done.stdout
