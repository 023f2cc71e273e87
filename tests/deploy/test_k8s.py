"""deploy/k8s: a native sidecar, probes, secrets from secretKeyRef, a bounded spool, the grace period."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from .manifests import (
    DATA_DIR,
    K8S_DIR,
    KUSTOMIZATION,
    LOOPBACK,
    WORKER_ENV_REQUIRED,
    Stage,
    _assert_client_reads,
    build_settings,
    container_port,
    iter_strings,
    k8s_env,
    k8s_env_item,
    looks_secret,
    parse_quantity,
)

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_PROBE_HANDLERS = {"httpGet", "tcpSocket", "exec", "grpc"}


def test_k8s_objects_have_the_required_fields(k8s_docs: list[dict[str, Any]], pod_spec: dict[str, Any], pod_metadata: dict[str, Any]) -> None:
    assert k8s_docs
    for doc in k8s_docs:
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert _DNS_LABEL.fullmatch(doc["metadata"]["name"]) or re.fullmatch(r"[a-z0-9.-]+", doc["metadata"]["name"])
        assert doc["kind"] != "Secret" or not (doc.get("data") or doc.get("stringData")), "no Secret with values in the manifests"
    for key in ("labels", "annotations"):
        for k, v in (pod_metadata.get(key) or {}).items():
            assert isinstance(v, str), f"{key}.{k} must be a string, got {v!r}"
    containers = (pod_spec.get("initContainers") or []) + pod_spec["containers"]
    names = [c["name"] for c in containers]
    assert len(names) == len(set(names))
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    used: set[str] = set()
    for c in containers:
        assert _DNS_LABEL.fullmatch(c["name"]) and c.get("image"), c["name"]
        for item in c.get("env") or []:
            assert ("value" in item) != ("valueFrom" in item), f"{c['name']}: env {item['name']} needs exactly one of value/valueFrom"
            assert "value" not in item or isinstance(item["value"], str), f"{c['name']}: env {item['name']} value must be a string (quote it)"
        for p in c.get("ports") or []:
            assert isinstance(p["containerPort"], int) and 0 < p["containerPort"] < 65536
        for mount in c.get("volumeMounts") or []:
            assert mount["name"] in volumes, f"{c['name']} mounts undefined volume {mount['name']}"
            used.add(mount["name"])
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe in c:
                assert len(_PROBE_HANDLERS & set(c[probe])) == 1, f"{c['name']}.{probe} needs one handler"
    assert set(volumes) == used, f"volumes defined but not mounted: {set(volumes) - used}"
    for c in pod_spec["containers"]:
        assert "restartPolicy" not in c, "restartPolicy is only valid on init containers"


def test_k8s_tracecar_is_a_native_sidecar(sidecar: dict[str, Any], runtime: Stage, image_uid_gid: tuple[int, int | None], pod_spec: dict[str, Any]) -> None:
    assert sidecar.get("restartPolicy") == "Always", "native sidecar: initContainer with restartPolicy: Always"
    assert sidecar["image"].split(":")[0].rsplit("/", 1)[-1] == "tracecar"
    assert sidecar.get("command") in (None, ["tracecar"]), "the image's ENTRYPOINT is tracecar"
    assert (sidecar.get("args") or runtime.last("CMD").exec_form) == ["serve"]
    sc = sidecar["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert "ALL" in sc.get("capabilities", {}).get("drop", [])
    uid, gid = image_uid_gid
    assert sc.get("runAsUser", uid) == uid
    assert pod_spec.get("securityContext", {}).get("fsGroup") in (None, gid, sc.get("runAsGroup"))
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(sidecar["resources"][kind]), f"sidecar resources.{kind}"
    assert parse_quantity(sidecar["resources"]["requests"]["memory"]) <= parse_quantity(sidecar["resources"]["limits"]["memory"])


def test_k8s_sidecar_settings_are_valid(sidecar: dict[str, Any], settings_cls: type, collector_env_names: set[str], monkeypatch: pytest.MonkeyPatch) -> None:
    env = k8s_env(sidecar)
    for name in env:
        if name.startswith("TRACECAR_"):
            assert name in collector_env_names, f"sidecar env {name} is not a CollectorSettings setting"
    settings = build_settings(settings_cls, env, monkeypatch)  # raises on an invalid value
    assert settings.port == settings_cls.model_fields["port"].default
    assert [container_port(sidecar, p["name"]) for p in sidecar["ports"]] == [settings.port]
    assert settings.effective_backend == "weave"


def test_k8s_probes_point_at_health_endpoints(sidecar: dict[str, Any], settings_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = build_settings(settings_cls, k8s_env(sidecar), monkeypatch)
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    if "startupProbe" in sidecar:
        expected["startupProbe"] = sidecar["startupProbe"]["httpGet"]["path"]
        assert expected["startupProbe"] in ("/healthz", "/readyz")
    uses_http = False
    for probe, path in expected.items():
        get = sidecar[probe]["httpGet"]
        assert get["path"] == path, f"{probe} should call {path}"
        assert container_port(sidecar, get["port"]) == settings.port
        assert "host" not in get, "kubelet probes must target the pod IP"
        uses_http = True
    # The kubelet (and Prometheus) connect to the pod IP, not the pod's loopback: a collector
    # bound to 127.0.0.1 would fail every httpGet probe. Binding wider makes the token mandatory.
    if uses_http:
        assert settings.host not in LOOPBACK, "httpGet probes cannot reach a collector bound to loopback"
    if settings.host not in LOOPBACK:
        item = k8s_env_item(sidecar, "TRACECAR_TOKEN")
        assert item and "secretKeyRef" in item.get("valueFrom", {}), "a non-loopback collector needs TRACECAR_TOKEN from a Secret"


def test_k8s_prometheus_annotations(pod_metadata: dict[str, Any], sidecar: dict[str, Any]) -> None:
    ann = pod_metadata["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/path"] == "/metrics"
    assert int(ann["prometheus.io/port"]) == sidecar["ports"][0]["containerPort"]


def test_k8s_spool_volume_is_bounded_and_mounted_at_the_data_dir(
    sidecar: dict[str, Any], pod_spec: dict[str, Any], settings_cls: type, image_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The image's ENV applies unless the pod overrides it.
    settings = build_settings(settings_cls, {"TRACECAR_DATA_DIR": image_env["TRACECAR_DATA_DIR"], **k8s_env(sidecar)}, monkeypatch)
    assert str(settings.data_dir) == DATA_DIR
    mounts = {m["mountPath"]: m for m in sidecar["volumeMounts"]}
    assert DATA_DIR in mounts and not mounts[DATA_DIR].get("readOnly")
    volume = next(v for v in pod_spec["volumes"] if v["name"] == mounts[DATA_DIR]["name"])
    if "emptyDir" in volume:
        size_limit = parse_quantity(volume["emptyDir"]["sizeLimit"])
        # Going over sizeLimit evicts the whole pod, trainer included: the store must stay a
        # bounded spool (forwarded spans deleted) well under the limit (SQLite overhead, WAL).
        assert settings.keep_forwarded is False, "with an emptyDir spool set TRACECAR_KEEP_FORWARDED=false"
        assert settings.spool_max_bytes * 2 <= size_limit, f"spool_max_bytes {settings.spool_max_bytes} too close to sizeLimit {size_limit}"
    else:
        assert "persistentVolumeClaim" in volume, "the spool lives on an emptyDir or a PVC"
    # A read-only root still needs writable /tmp and HOME.
    for path in ("/tmp", image_env["HOME"]):
        assert path in mounts and not mounts[path].get("readOnly"), f"{path} must be a writable mount"


def test_k8s_secrets_come_from_secret_refs(pod_spec: dict[str, Any], sidecar: dict[str, Any], trainer: dict[str, Any],
                                          k8s_docs: list[dict[str, Any]], secret_env_names: set[str]) -> None:
    wandb = k8s_env_item(sidecar, "WANDB_API_KEY")
    assert wandb and "secretKeyRef" in wandb["valueFrom"], "WANDB_API_KEY must come from a Secret"
    refs = []
    for c in (pod_spec.get("initContainers") or []) + pod_spec["containers"]:
        for item in c.get("env") or []:
            if looks_secret(item["name"], secret_env_names):
                assert "value" not in item, f"{c['name']}: literal {item['name']}"
                assert "secretKeyRef" in item["valueFrom"], f"{c['name']}: {item['name']} must use secretKeyRef"
    for c in (sidecar, trainer):
        item = k8s_env_item(c, "TRACECAR_TOKEN")
        assert item, f"{c['name']} lacks TRACECAR_TOKEN"
        refs.append((item["valueFrom"]["secretKeyRef"]["name"], item["valueFrom"]["secretKeyRef"]["key"]))
    assert refs[0] == refs[1], "sidecar and trainer must share one token"
    for text in iter_strings(k8s_docs):
        assert not re.search(r"\b[0-9a-f]{40}\b", text), "something that looks like a W&B API key"


def test_k8s_trainer_reaches_the_sidecar_on_loopback(trainer: dict[str, Any], sidecar: dict[str, Any], client_config_cls: type) -> None:
    env = k8s_env(trainer)
    assert WORKER_ENV_REQUIRED <= set(env)
    port = sidecar["ports"][0]["containerPort"]
    config = client_config_cls.from_env(env)
    assert config.url == f"http://127.0.0.1:{port}", config.url
    _assert_client_reads(client_config_cls, env, "trainer")
    command = " ".join((trainer.get("command") or []) + (trainer.get("args") or []))
    assert "actor_rollout_ref.rollout.trace.backend=tracecar" in command


def test_k8s_grace_period_outlasts_the_drain(pod_spec: dict[str, Any], sidecar: dict[str, Any], settings_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = build_settings(settings_cls, k8s_env(sidecar), monkeypatch)
    grace = pod_spec.get("terminationGracePeriodSeconds", 30)
    # The trainer is stopped first and the sidecar after it, both inside this one budget.
    assert grace >= settings.shutdown_drain_s + 10, f"terminationGracePeriodSeconds {grace} vs drain {settings.shutdown_drain_s}s"


def test_kustomization_lists_the_manifests(sidecar: dict[str, Any], pyproject: dict[str, Any]) -> None:
    kust = yaml.safe_load(KUSTOMIZATION.read_text())
    assert kust["kind"] == "Kustomization"
    resources = kust["resources"]
    for res in resources:
        assert (K8S_DIR / res).is_file(), f"kustomization lists missing {res}"
    on_disk = {p.name for p in K8S_DIR.glob("*.y*ml")} - {KUSTOMIZATION.name}
    assert on_disk <= set(resources), f"manifests not in the kustomization: {on_disk - set(resources)}"
    image = sidecar["image"]
    name, _, tag = image.rpartition(":")
    version = pyproject["project"]["version"]
    assert tag == version, f"sidecar image tag {tag} vs project version {version}"
    entry = next(i for i in kust.get("images", []) if i["name"] == name)
    assert str(entry.get("newTag", version)) == version


@pytest.mark.skipif(shutil.which("kubectl") is None and shutil.which("kustomize") is None, reason="no kubectl/kustomize")
def test_kustomize_build_renders(sidecar: dict[str, Any]) -> None:
    tool = ["kubectl", "kustomize"] if shutil.which("kubectl") else ["kustomize", "build"]
    out = subprocess.run([*tool, str(K8S_DIR)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    pod = next(d for d in docs if d["kind"] == "Pod")
    init = pod["spec"]["initContainers"][0]
    assert init["restartPolicy"] == "Always" and init["image"].split(":")[0].endswith("tracecar")

