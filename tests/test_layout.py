"""The collector's folders are its pipeline, and imports only go down it (README "Code map").

Every ``import`` in the collector package (module level, inside functions and under
``TYPE_CHECKING`` alike) is read with ``ast`` and checked against the layering:

    shared modules (collector/*.py)  <  spool/  <  processors/, exporters/  <  receivers/, viewer/  <  service/

A module may import its own component or a strictly lower layer, never a sibling or a higher one,
and the module graph has no cycle. The thin client imports the collector only lazily.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLLECTOR = ROOT / "collector"
PACKAGE = "tracecar.collector"

# component -> layer; the shared top-level modules are the component "" (layer 0)
LAYERS = {"": 0, "spool": 1, "processors": 2, "exporters": 2, "receivers": 3, "viewer": 3, "service": 4, "__main__": 5}


def module_name(path: Path, folder: Path = COLLECTOR, package: str = PACKAGE) -> tuple[str, bool]:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join([package, *parts]), is_package


def modules(folder: Path = COLLECTOR, package: str = PACKAGE) -> dict[str, Path]:
    return {module_name(p, folder, package)[0]: p for p in folder.rglob("*.py") if "__pycache__" not in p.parts}


def imports_of(path: Path, known: set[str], folder: Path = COLLECTOR, package_name: str = PACKAGE) -> set[str]:
    """The package's modules ``path`` imports (a ``from pkg import mod`` names the module)."""
    name, is_package = module_name(path, folder, package_name)
    package = name if is_package else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t == package_name or t.startswith(package_name + "."))
    return found


def component(module: str) -> str:
    """The folder a module lives in ("" for the shared top-level modules)."""
    first = module[len(PACKAGE) + 1:].split(".")[0]
    return first if first in LAYERS else ""


def graph(folder: Path = COLLECTOR, package: str = PACKAGE) -> dict[str, set[str]]:
    found = modules(folder, package)
    known = set(found)
    return {name: imports_of(path, known, folder, package) - {name} for name, path in found.items()}


def test_every_collector_folder_has_a_layer() -> None:
    folders = {p.name for p in COLLECTOR.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == {c for c in LAYERS if c not in ("", "__main__")}, "a new component needs its layer in LAYERS"
    assert {component(m) for m in modules()} <= set(LAYERS)
    assert component(f"{PACKAGE}.settings") == "" and component(f"{PACKAGE}.spool.store") == "spool"
    assert component(f"{PACKAGE}.viewer") == "viewer" and component(f"{PACKAGE}.__main__") == "__main__"


def test_imports_only_go_down_the_pipeline() -> None:
    wrong = []
    for module, targets in graph().items():
        mine = component(module)
        for target in targets:
            theirs = component(target)
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                wrong.append(f"{module} ({mine or 'shared'}) imports {target} ({theirs or 'shared'})")
    assert wrong == [], "\n".join(sorted(wrong))


def test_the_checker_sees_imports_of_every_kind() -> None:
    """The layering check is only as good as its import reading: relative, nested and TYPE_CHECKING ones count."""
    edges = graph()
    assert f"{PACKAGE}.spool.store" in edges[f"{PACKAGE}.processors.sampling.tail"]  # from ...spool.store import
    assert f"{PACKAGE}.receivers.receive" in edges[f"{PACKAGE}.receivers.worker_pool"]  # from . import receive, in a function
    assert f"{PACKAGE}.exporters.registry" in edges[f"{PACKAGE}.service.config_check"]  # imported inside a function
    assert f"{PACKAGE}.spool.store" in edges[f"{PACKAGE}.viewer"]  # under TYPE_CHECKING


def cycles_in(edges: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, set())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    return cycles


def test_no_import_cycle() -> None:
    cycles = cycles_in(graph())
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


CLIENT_PACKAGE = "tracecar.client"
#: the old flat paths job configs name (model.external_lib, Ray setup hooks): kept as the same modules
KEPT_PATHS = {"verl": "integrations.verl", "verl_trainer": "integrations.verl_trainer",
              "ray_collectors": "integrations.ray_collectors", "verl_tokens": "integrations.verl_tokens",
              "verl_fate": "integrations.verl_fate"}


def test_the_client_reads_as_core_cli_and_integrations_without_cycles() -> None:
    """client/: the tracing core at the top, the command in cli/ (its subcommands share cli/common.py, never
    the parser's module (command.py)), the frameworks in integrations/; no import cycle, lazy imports counted."""
    client = ROOT / "client"
    edges = graph(client, CLIENT_PACKAGE)
    cycles = cycles_in(edges)
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)
    core = {m for m in edges if m.count(".") == 2 and m.rsplit(".", 1)[1] not in {*KEPT_PATHS, "cli", "integrations"}}
    assert {m.rsplit(".", 1)[1] for m in core} >= {"tracing", "tracer", "sender", "wire", "spans"}
    upward = sorted(f"{m} imports {t}" for m in core for t in edges[m]
                    if t.startswith((f"{CLIENT_PACKAGE}.cli", f"{CLIENT_PACKAGE}.integrations")))
    assert upward == [], "the tracing core imports neither the command nor an integration:\n" + "\n".join(upward)
    into_main = sorted(m for m, targets in edges.items() if f"{CLIENT_PACKAGE}.cli.command" in targets)
    assert into_main == [f"{CLIENT_PACKAGE}.cli", f"{CLIENT_PACKAGE}.cli.__main__"]


def test_the_paths_job_configs_name_still_work() -> None:
    """``model.external_lib=tracecar.client.verl``, ``worker_process_setup_hook=tracecar.client.verl.install`` and
    ``...ray_collectors.configure_from_node`` keep working, in a fresh interpreter, as the very same modules."""
    import subprocess
    import sys

    code = ("import importlib\n"
            f"for old, new in {KEPT_PATHS!r}.items():\n"
            "    a = importlib.import_module('tracecar.client.' + old)\n"
            "    b = importlib.import_module('tracecar.client.' + new)\n"
            "    assert a is b, (old, a, b)\n"
            "import tracecar.client.verl as v\n"
            "from tracecar.client.ray_collectors import configure_from_node\n"
            "from tracecar.client.verl_trainer import hook_trainer\n"
            "assert callable(v.install) and callable(configure_from_node) and callable(hook_trainer)\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_the_thin_client_imports_the_collector_only_lazily() -> None:
    """``pip install tracecar`` (no collector extra) must import: the client names the collector inside functions only."""
    eager = []
    for path in (ROOT / "client").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                eager.append(f"{path.name}: from {node.module}")
            elif isinstance(node, ast.Import) and any(a.name.startswith(PACKAGE) for a in node.names):
                eager.append(f"{path.name}: import {node.names[0].name}")
    assert eager == []
