"""The documentation stays in step with the code: every setting and metric is documented on its
reference page (docs/), and the short README's links lead somewhere."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from tracecar.client.config import ClientConfig
from tracecar.collector.metrics import Metrics
from tracecar.collector.settings import CollectorSettings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
COLLECTOR_SETTINGS = (ROOT / "docs" / "settings.md").read_text()
CLIENT_SETTINGS = (ROOT / "docs" / "client.md").read_text()
METRICS = (ROOT / "docs" / "metrics.md").read_text()


def test_every_collector_setting_is_in_the_readme():
    missing = []
    for name, info in CollectorSettings.model_fields.items():
        names = list(info.validation_alias.choices) if info.validation_alias else [f"TRACECAR_{name.upper()}"]
        if not any(f"| `{n}`" in COLLECTOR_SETTINGS or f"/ `{n}`" in COLLECTOR_SETTINGS for n in names):
            missing.append(names[0])
    assert missing == []


def test_every_client_setting_is_in_the_readme():
    source = (Path(__file__).resolve().parents[1] / "client" / "config.py").read_text()
    env_names = set(re.findall(r'"(TRACECAR_[A-Z_]+)"', source)) | {f"TRACECAR_{n}" for n in re.findall(r'_env_(?:int|float)\(env, "([A-Z_]+)"', source)}
    set_in_code_only = {"token2text", "max_samples_per_step_per_worker"}  # the VERL adapter sets them
    assert len(env_names) == len(fields(ClientConfig)) - len(set_in_code_only)
    assert sorted(n for n in env_names if f"`{n}`" not in CLIENT_SETTINGS) == []


def test_every_metric_is_in_the_readme():
    names = set()
    for metric in Metrics().registry.collect():
        names.add(metric.name + ("_total" if metric.type == "counter" else ""))
    assert sorted(n for n in names if f"| `{n}`" not in METRICS) == []


def test_the_readme_is_short_and_its_links_lead_to_pages_that_exist():
    assert len(README.splitlines()) <= 400  # reads in ten minutes: one table or section per topic; the reference lives in docs/
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert links and all((ROOT / link).is_file() for link in links if "://" not in link), links
    for page in (ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in link:
                assert (page.parent / link).is_file(), (page.name, link)
