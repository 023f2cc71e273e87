"""collector/cores.py: the cores a container may use, from its affinity and cgroup CPU quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tracecar.collector.cores import available_cores, cgroup_quota, default_workers


def _cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(("files", "quota"), [
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "garbage\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"}, 3.0),
    ({"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"}, None),
    ({}, None),
])
def test_cgroup_quota_reads_v2_and_v1(tmp_path: Path, files: dict[str, str], quota: float | None) -> None:
    assert cgroup_quota(_cgroup(tmp_path, files)) == quota


def test_the_quota_caps_the_affinity_rounded_down_never_below_one(tmp_path: Path) -> None:
    mine = len(os.sched_getaffinity(0))
    assert available_cores(_cgroup(tmp_path / "none", {})) == mine
    assert available_cores(_cgroup(tmp_path / "half", {"cpu.max": "50000 100000"})) == 1
    assert available_cores(_cgroup(tmp_path / "big", {"cpu.max": f"{(mine + 8) * 100000} 100000"})) == mine
    if mine >= 2:
        assert available_cores(_cgroup(tmp_path / "1.9", {"cpu.max": "190000 100000"})) == 1


@pytest.mark.parametrize(("cores", "workers"), [(1, 1), (2, 1), (3, 3), (4, 4), (16, 16)])
def test_default_workers_need_a_core_beside_the_ingest_process(cores: int, workers: int) -> None:
    assert default_workers(cores) == workers
