"""TRACECAR_* variables that nothing reads: a typo in a name costs a setting silently, so it is
said, once per variable and process, in one line with the closest known name.

Known names are the ones the package's own source reads (the client's, the VERL adapter's, Ray's, and
the collector's settings, which a worker's environment often shares), found by reading the source
once, and the few read outside it. Reading the source costs tens of milliseconds, so it happens only
when a TRACECAR_* variable is not one of the client's own (read from client/config.py alone), and,
with tracing on, on the sender thread, never on the caller's path.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

log = logging.getLogger("tracecar.client")

PACKAGE = Path(__file__).resolve().parents[1]  # the tracecar package: client/ and collector/
NAME = re.compile(r"TRACECAR_[A-Z0-9_]*[A-Z0-9]")
QUOTED = re.compile(r"[\"'](TRACECAR_[A-Z0-9_]*[A-Z0-9])[\"']")  # read by code, not named in a comment
_FIELD = re.compile(r"^    ([a-z][a-z0-9_]*): .*Field\(", re.M)  # a collector setting (TRACECAR_ + its name)
# read outside the package (tests/run.sh, CI switches, the test suite's server venvs)
OTHER_ENV = frozenset({"TRACECAR_CONFIG", "TRACECAR_HINT_CWD", "TRACECAR_FULL_LOAD", "TRACECAR_WEAVE_SERVER_PYTHON",
                       "TRACECAR_TEST_VERL", "TRACECAR_TEST_WEAVE_SERVER", "TRACECAR_TEST_OTLP_SERVERS", "TRACECAR_TEST_PY310",
                       "TRACECAR_MLFLOW_SERVER_PYTHON", "TRACECAR_PHOENIX_SERVER_PYTHON", "TRACECAR_ARTIFACTS"})

_warned: set[str] = set()
_lock = threading.Lock()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def client_names() -> frozenset[str]:
    """What the client reads (its config module alone: cheap)."""
    text = _read(PACKAGE / "client" / "config.py")
    prefixed = {f"TRACECAR_{n}" for n in re.findall(r'_env_(?:int|float)\(env, "([A-Z0-9_]+)"', text)}
    return frozenset(set(NAME.findall(text)) | prefixed)


@functools.lru_cache(maxsize=1)
def known_names() -> frozenset[str]:
    """Every TRACECAR_* name the package reads, the collector's settings included."""
    names = set(client_names()) | OTHER_ENV
    for file in list(PACKAGE.glob("client/**/*.py")) + list(PACKAGE.glob("collector/**/*.py")):
        names.update(QUOTED.findall(_read(file)))
    names.update(f"TRACECAR_{field.upper()}" for field in _FIELD.findall(_read(PACKAGE / "collector" / "settings.py")))
    return frozenset(names)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_env_warnings(env: Mapping[str, str], known: frozenset[str] | None = None) -> list[str]:
    """One line per TRACECAR_* variable that nothing reads, with the closest known name."""
    suspects = [n for n in sorted(env) if n.startswith("TRACECAR_") and n not in client_names()]
    if not suspects:
        return []
    known = known_names() if known is None else known
    return [f"{name} is not a tracecar setting and is ignored{did_you_mean(name, known)}" for name in suspects if name not in known]


def warn_unknown_env(env: Mapping[str, str] | None = None, tracing_off: bool = False) -> None:
    """Logs each unknown TRACECAR_* variable once per process (never raises: it only speaks).

    ``tracing_off``: only a mistyped TRACECAR_URL is said (what turned tracing off); the rest matter to
    a worker that traces (said by its sender thread) or to the collector (whose start-up check says them).
    """
    try:
        lines = unknown_env_warnings(os.environ if env is None else env)
    except Exception:  # noqa: BLE001 - a check that fails must not cost the worker anything
        return
    for line in lines:
        if tracing_off and not line.endswith(URL_HINT):
            continue
        with _lock:
            if line in _warned:
                continue
            _warned.add(line)
        log.warning("tracecar: %s%s", line, "; tracing is off (TRACECAR_URL is unset)" if tracing_off else "")


URL_HINT = "(did you mean 'TRACECAR_URL'?)"
