"""The README's "Getting started with VERL" steps, walked as written (issue 31, item 1).

The commands are read from the README itself: step 1's check, step 2's `tracecar serve` with its
variables (W&B key, entity, TRACECAR_TOKENIZER_ROOT, TRACECAR_TOKEN2TEXT), step 2's readiness
check and step 4's `tracecar doctor`. Only what cannot run here is substituted: the W&B key is a
fake one and Weave is a loopback stand-in (WF_TRACE_SERVER_URL), ``/models`` is a directory of this
test holding a model's tokenizer.json, and port 9470 is a free port. Every doctor line must PASS.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import FAKE_WANDB_KEY
from tests.support import clean_env, free_port, start_service, stop_process
from tests.support.weave_stub import WeaveStub

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
SECTION = (ROOT / "README.md").read_text().split("## Getting started with VERL, step by step", 1)[1].split("\n## ", 1)[0]
BIN = Path(sys.executable).parent


def shell_words(command: str) -> list[str]:
    """A README command as argv: continuation lines joined, the trailing comment dropped."""
    return shlex.split(command.replace("\\\n", " "), comments=True)


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def readme_steps() -> dict[str, str]:
    """The commands of each step, as the README prints them."""
    blocks = re.findall(r"```bash\n(.*?)```", SECTION, re.S)
    serve = "\n".join(line for line in blocks[0].splitlines() if not line.strip().startswith("pip install"))  # installed here
    return {
        "import_check": re.search(r"Check: `(python -c [^`]+)` in the image", SECTION).group(1),  # type: ignore[union-attr]
        "serve": serve,
        "ready_check": re.search(r"Check: `(curl -s [^`]+/readyz)`", SECTION).group(1),  # type: ignore[union-attr]
        "doctor": re.search(r"\*\*Check from a worker's environment:\*\* `([^`]+)`", SECTION).group(1),  # type: ignore[union-attr]
    }


def test_the_readme_verl_steps_as_written_end_in_pass_on_every_doctor_line(tmp_path: Path, deepseek_tokenizer_path: str) -> None:
    steps = readme_steps()
    port = free_port()

    # step 1's check, in this environment (the image)
    words = shell_words(steps["import_check"])
    assert words[0] == "python"
    assert subprocess.run([sys.executable, *words[1:]], capture_output=True, timeout=60).returncode == 0

    # step 2: the collector as the README starts it
    env_words, command = split_env(shell_words(steps["serve"]))
    assert command == ["tracecar", "serve"] and env_words["TRACECAR_TOKENIZER_ROOT"] == "/models", steps["serve"]
    assert env_words["WANDB_API_KEY"] == "..." and "TRACECAR_TOKENIZER" not in env_words  # VERL names the tokenizer
    models = tmp_path / "models"
    (models / "my-model").mkdir(parents=True)
    shutil.copy(deepseek_tokenizer_path, models / "my-model" / "tokenizer.json")
    env_words.update({"WANDB_API_KEY": FAKE_WANDB_KEY, "TRACECAR_TOKENIZER_ROOT": str(models)})
    with WeaveStub() as weave:
        env = clean_env()
        env.update(env_words)
        env.update({"WF_TRACE_SERVER_URL": weave.url, "TRACECAR_PORT": str(port), "TRACECAR_DATA_DIR": str(tmp_path / "data")})
        ready_url = steps["ready_check"].split()[-1].replace(":9470", f":{port}")
        collector = start_service("collector", [str(BIN / "tracecar"), "serve"], ready_url, tmp_path / "collector.log", env=env)
        try:
            assert httpx.get(ready_url, timeout=10).status_code == 200  # step 2's check

            # step 4: doctor from a worker's environment, as printed
            doctor_env, doctor_command = split_env(shell_words(steps["doctor"]))
            assert doctor_command == ["tracecar", "doctor"] and doctor_env == {"TRACECAR_URL": "http://127.0.0.1:9470"}
            worker_env = clean_env()
            worker_env["TRACECAR_URL"] = doctor_env["TRACECAR_URL"].replace(":9470", f":{port}")
            done = subprocess.run([str(BIN / "tracecar"), "doctor"], env=worker_env, capture_output=True, text=True, timeout=120)
        finally:
            stop_process(collector.proc)
    lines = done.stdout.splitlines()
    assert [line.split(":", 1)[0].split()[-1] for line in lines] == [
        "TRACECAR_URL", "collector", "ready", "token", "tokenizer", "spans", "backend"], done.stdout + done.stderr
    assert all(line.startswith("PASS") for line in lines), done.stdout + done.stderr + collector.log_tail()
    assert done.returncode == 0
    tokenizer_line = next(line for line in lines if line.startswith("PASS  tokenizer"))
    assert str(models / "my-model") in tokenizer_line and "TRACECAR_TOKENIZER_ROOT" in tokenizer_line
    assert "forwards to weave" in lines[-1] and weave.completed_calls()
