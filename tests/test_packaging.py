"""The thin client installs without the collector's dependencies, under distinct import names."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240)


BUILD_LOG: list[str] = []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy without build/ (setuptools would pack a stale build/lib of an earlier build into it)
    source = tmp_path_factory.mktemp("source") / "tracecar"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "__pycache__",
                                                                  "tracecar-data", ".ruff_cache", ".mypy_cache"))
    # -v shows the backend's own output, so test_build_prints_no_setuptools_warnings can read it
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(out), str(source)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    BUILD_LOG.append(done.stdout + done.stderr)
    [built] = out.glob("tracecar-*.whl")
    return built


def test_build_prints_no_setuptools_warnings(wheel: Path) -> None:
    """A newcomer's install shows no setuptools warnings (issue 12: 134 lines of them about static/)."""
    lines = BUILD_LOG[0].splitlines()
    # pip's own notes about this machine's index configuration and Python's byte-compile switch
    # (PYTHONDONTWRITEBYTECODE) are not the package's doing
    ours = [ln for ln in lines if ("warn" in ln.lower() or "would be ignored" in ln.lower())
            and "is neither a file nor a directory" not in ln and "byte-compiling is disabled" not in ln]
    assert ours == [], "\n".join(ours[:20])
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    for data in ("tracecar/collector/viewer/static/index.html", "tracecar/collector/viewer/static/app.js",
                 "tracecar/collector/viewer/static/vendor/chart.umd.min.js"):
        assert data in names


def test_bare_install_is_the_thin_client(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        meta = Parser().parsestr(zf.read(next(n for n in zf.namelist() if n.endswith("METADATA"))).decode())
    requires = meta.get_all("Requires-Dist") or []
    bare = sorted(r.split(";")[0].split(">")[0].split("=")[0].strip() for r in requires if "extra ==" not in r)
    assert bare == ["httpx", "orjson"]
    collector_extra = " ".join(r for r in requires if 'extra == "collector"' in r)
    for dep in ("fastapi", "uvicorn", "pydantic", "weave", "wandb", "tokenizers", "prometheus-client"):
        assert dep in collector_extra


def test_import_names_are_namespaced(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    top = {n.split("/")[0] for n in names if not n.startswith("tracecar-")}
    assert top == {"tracecar"}  # never a bare `client` or `collector` in site-packages
    assert "tracecar/client/tracing.py" in names and "tracecar/collector/service/app.py" in names
    # every module of the source tree is in the wheel (the package list is explicit: a new folder must join it)
    root = Path(__file__).resolve().parents[1]
    sources = {f"tracecar/{p.relative_to(root).as_posix()}" for folder in ("client", "collector")
               for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts}
    assert sources - set(names) == set(), "modules missing from the wheel: add their package to pyproject.toml"


def test_client_imports_without_collector_dependencies(tmp_path: Path) -> None:
    """Import the client with fastapi/pydantic/weave/tokenizers made unimportable."""
    blocker = tmp_path / "sitecustomize_block.py"
    blocker.write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'fastapi','pydantic','weave','wandb','tokenizers','uvicorn','msgpack','prometheus_client'}:\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import tracecar.client as c\n"
        "assert not c.get_tracer() and c.get_tracer().stats()['enabled'] is False\n"
        "@c.rollout_trace_op\n"
        "def f(x): return x + 1\n"
        "assert f(1) == 2\n"
        "print('ok', sorted(m for m in sys.modules if m.split('.')[0] in {'fastapi','pydantic','weave'}))\n"
    )
    out = subprocess.run([sys.executable, str(blocker)], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok []"
