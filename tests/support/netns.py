"""Network namespaces for the cluster tests: each collector on its own network stack and address.

A Linux bridge in the root namespace connects one veth pair per namespace; the namespaces get
addresses in a private /24 (``10.213.<n>.0``), the root namespace one too (the test process
reaches every collector through it). Nothing leaves the machine: the bridge has no uplink.
``partition(ns)`` takes a namespace's link down on the bridge side (its packets are dropped, so
connections to it hang rather than being refused: a network partition, not a dead process);
``heal(ns)`` brings it back. Needs root and iproute2; :func:`available` says whether this
machine can.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.collector import ProcessCollector, collector_env
from tests.support.processes import start_service


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if sys.platform != "linux" or shutil.which("ip") is None:
        return "needs Linux and iproute2"
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    probe = f"tcprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"ip netns add failed: {exc}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@dataclass
class Namespaces:
    """A bridge and ``count`` namespaces on it; ``address(i)`` is namespace i's, ``host`` the root one's."""

    count: int
    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000}")
    subnet: int = 213
    names: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"tcbr{self.tag}"

    @property
    def host(self) -> str:
        return f"10.{self.subnet}.0.254"

    def address(self, i: int) -> str:
        return f"10.{self.subnet}.0.{i + 1}"

    def _veth(self, i: int) -> str:
        return f"tc{self.tag}h{i}"  # the bridge side (interface names are at most 15 characters)

    def create(self) -> Namespaces:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.count):
                ns, host_side, ns_side = f"tc{self.tag}n{i}", self._veth(i), f"tc{self.tag}p{i}"
                _ip("netns", "add", ns)
                self.names.append(ns)
                _ip("link", "add", host_side, "type", "veth", "peer", "name", ns_side)
                _ip("link", "set", ns_side, "netns", ns)
                _ip("link", "set", host_side, "master", self.bridge)
                _ip("link", "set", host_side, "up")
                _ip("addr", "add", f"{self.address(i)}/24", "dev", ns_side, ns=ns)
                _ip("link", "set", ns_side, "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
        except BaseException:
            self.delete()
            raise
        return self

    def partition(self, i: int) -> None:
        _ip("link", "set", self._veth(i), "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self._veth(i), "up")

    def delete(self) -> None:
        for i, ns in enumerate(self.names):
            subprocess.run(["ip", "link", "del", self._veth(i)], capture_output=True, timeout=30)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.names.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


@dataclass
class NamespacedCollector(ProcessCollector):
    """A collector process inside network namespace ``ns``, listening on ``host:port`` there."""

    ns: str = ""

    def start(self, timeout: float = 60) -> NamespacedCollector:
        self.log_path = Path(self.env["TRACECAR_DATA_DIR"]) / f"collector-{len(self.logs)}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.logs.append(self.log_path)
        # ip netns exec execs the collector: the process we hold (and kill) is the collector itself
        argv = ["ip", "netns", "exec", self.ns, sys.executable, "-m", "tracecar.collector"]
        self.proc = start_service("collector", argv, self.url + "/readyz", self.log_path, timeout=timeout, env=self.env).proc
        return self


def namespaced_collector(ns: str, address: str, port: int, data_dir: Path, **settings: Any) -> NamespacedCollector:
    env = collector_env(port, data_dir, **settings)
    env["TRACECAR_HOST"] = address
    return NamespacedCollector(url=f"http://{address}:{port}", env=env, ns=ns)
