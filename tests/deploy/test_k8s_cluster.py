"""deploy/k8s-cluster: a gateway StatefulSet + Services, the training pods' sidecars as node collectors;
deploy/k8s-two-gateways: the same with two gateways, every node listing both.

Validated statically, like deploy/k8s: the files parsed, each collector's environment built
into the collector's own settings and checked with the checks ``tracecar serve`` runs
(service/roles.py: the role's contradictions; config_check: the exporters), the Services'
selectors and ports against the StatefulSet, the node's gateway URLs against the Services and
the gateways' pod names. The overlays are rendered by ``kubectl kustomize`` when it is installed;
otherwise the base pod's sidecar is patched here by the same rule (env merged by name, ``$patch:
delete`` removes).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from .manifests import DATA_DIR, REPO, build_settings, container_port, k8s_env, k8s_env_item, looks_secret

CLUSTER_DIR = REPO / "deploy" / "k8s-cluster"
GATEWAY_YAML = CLUSTER_DIR / "gateway.yaml"
NODE_PATCH = CLUSTER_DIR / "node-sidecar.yaml"
TWO_DIR = REPO / "deploy" / "k8s-two-gateways"


@pytest.fixture(scope="module")
def gateway_docs() -> dict[str, dict[str, Any]]:
    """The gateway's documents by kind; the two Services as ``Service`` (ClusterIP) and ``Service/headless``."""
    out: dict[str, dict[str, Any]] = {}
    for d in yaml.safe_load_all(GATEWAY_YAML.read_text()):
        if d:
            headless = d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"
            out[d["kind"] + ("/headless" if headless else "")] = d
    return out


@pytest.fixture(scope="module")
def gateway_container(gateway_docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (container,) = gateway_docs["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    return container


def _checked(settings: Any) -> None:
    """What ``tracecar serve`` checks before it starts (a failure is its one-line error)."""
    from tracecar.collector.service.config_check import check_backend
    from tracecar.collector.service.roles import check_role

    check_role(settings)
    check_backend(settings)


def _merge_env(base: list[dict[str, Any]], patch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Strategic merge of a container's env (merge key: name; ``$patch: delete`` removes)."""
    out = {item["name"]: item for item in copy.deepcopy(base)}
    for item in patch:
        if item.get("$patch") == "delete":
            out.pop(item["name"], None)
        else:
            out[item["name"]] = item
    return list(out.values())


@pytest.fixture(scope="module")
def node_sidecar(sidecar: dict[str, Any]) -> dict[str, Any]:
    """The base's sidecar with the overlay's patch applied."""
    patch = yaml.safe_load(NODE_PATCH.read_text())
    (patched,) = [c for c in patch["spec"]["initContainers"] if c["name"] == sidecar["name"]]
    node = copy.deepcopy(sidecar)
    node["env"] = _merge_env(sidecar.get("env") or [], patched["env"])
    return node


def test_gateway_is_a_stateful_set_each_with_its_volume_behind_its_services(gateway_docs: dict[str, dict[str, Any]],
                                                                          gateway_container: dict[str, Any]) -> None:
    assert {"StatefulSet", "Service", "Service/headless"} <= set(gateway_docs)
    statefulset = gateway_docs["StatefulSet"]
    spec = statefulset["spec"]
    # one writer of each store: a StatefulSet replaces a pod only once the old one is gone
    assert spec["replicas"] == 1 and spec["updateStrategy"]["type"] == "RollingUpdate"
    assert spec["serviceName"] == gateway_docs["Service/headless"]["metadata"]["name"]  # each pod's DNS name
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    for service in (gateway_docs["Service"], gateway_docs["Service/headless"]):
        assert service["spec"]["selector"].items() <= labels.items()
        (port,) = service["spec"]["ports"]
        assert container_port(gateway_container, port["targetPort"]) == 9470
    data = next(m for m in gateway_container["volumeMounts"] if m["mountPath"] == DATA_DIR)
    claims = {c["metadata"]["name"]: c for c in spec["volumeClaimTemplates"]}
    assert data["name"] in claims and claims[data["name"]]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert data["name"] not in {v["name"] for v in spec["template"]["spec"]["volumes"]}  # its own volume, not a shared one
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert gateway_container[probe]["httpGet"]["path"] == path
        assert container_port(gateway_container, gateway_container[probe]["httpGet"]["port"]) == 9470
    sc = gateway_container["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]


def test_gateway_settings_are_a_valid_gateway_with_the_credentials(gateway_container: dict[str, Any],
                                                                    gateway_docs: dict[str, dict[str, Any]], settings_cls: type,
                                                                    secret_env_names: set[str], monkeypatch: pytest.MonkeyPatch) -> None:
    settings = build_settings(settings_cls, k8s_env(gateway_container), monkeypatch)
    assert settings.role == "gateway" and settings.gateway_url is None
    assert settings.host == "0.0.0.0" and settings.token is not None and str(settings.data_dir) == DATA_DIR
    assert settings.effective_exporters == ["weave"] and settings.max_trajectories_per_step == 256
    _checked(settings)
    for item in gateway_container["env"]:
        if looks_secret(item["name"], secret_env_names):
            assert "secretKeyRef" in item["valueFrom"], item["name"]
    grace = gateway_docs["StatefulSet"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings.shutdown_drain_s + 5


def test_node_sidecar_forwards_to_the_gateway_service_without_credentials(node_sidecar: dict[str, Any],
                                                                          gateway_docs: dict[str, dict[str, Any]],
                                                                          gateway_container: dict[str, Any], settings_cls: type,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    settings = build_settings(settings_cls, k8s_env(node_sidecar), monkeypatch)
    service = gateway_docs["Service"]
    assert settings.role == "node"
    assert settings.gateway_url == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert settings.effective_exporters == ["gateway"] and settings.wandb_api_key is None
    _checked(settings)  # no W&B key, no exporter, no tail budget on a node with a gateway
    token = k8s_env_item(node_sidecar, "TRACECAR_GATEWAY_TOKEN") or k8s_env_item(node_sidecar, "TRACECAR_TOKEN")
    assert token is not None
    assert token["valueFrom"]["secretKeyRef"] == k8s_env_item(gateway_container, "TRACECAR_TOKEN")["valueFrom"]["secretKeyRef"]
    assert k8s_env_item(node_sidecar, "TRACECAR_NODE_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")
def test_the_cluster_overlay_renders_with_kustomize(node_sidecar: dict[str, Any]) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(CLUSTER_DIR)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert {"StatefulSet", "Service", "Pod"} <= {d["kind"] for d in docs}
    pod = next(d for d in docs if d["kind"] == "Pod")
    rendered = next(c for c in pod["spec"]["initContainers"] if c["name"] == node_sidecar["name"])
    assert sorted(rendered["env"], key=lambda i: i["name"]) == sorted(node_sidecar["env"], key=lambda i: i["name"])
    statefulset = next(d for d in docs if d["kind"] == "StatefulSet")
    assert statefulset["spec"]["template"]["spec"]["containers"][0]["image"] == rendered["image"]


def two_gateways(node_sidecar: dict[str, Any], gateway_docs: dict[str, dict[str, Any]],
                 gateway: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """deploy/k8s-two-gateways applied by its own rules: (the StatefulSet's replicas, the node's sidecar); the
    gateway container's env patched into ``gateway`` when given."""
    kustomization = yaml.safe_load((TWO_DIR / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../k8s-cluster"]
    replicas = gateway_docs["StatefulSet"]["spec"]["replicas"]
    node = copy.deepcopy(node_sidecar)
    pinned = None
    for patch in kustomization["patches"]:
        if "target" in patch and patch["target"]["kind"] == "StatefulSet":  # JSON 6902: the replicas, the peer list
            assert patch["target"]["name"] == gateway_docs["StatefulSet"]["metadata"]["name"]
            ops = yaml.safe_load(patch["patch"])
            for op in ops:
                if op["path"] == "/spec/replicas":
                    assert op["op"] == "replace"
                    replicas = op["value"]
                else:
                    assert op["op"] == "add" and op["path"] == "/spec/template/spec/containers/0/env/-"
                    if gateway is not None:
                        gateway["env"] = _merge_env(gateway["env"], [op["value"]])
        elif "target" in patch:  # the ClusterIP Service (the viewer's address) pinned to one gateway
            assert patch["target"] == {"kind": "Service", "name": gateway_docs["Service"]["metadata"]["name"]}
            (op,) = yaml.safe_load(patch["patch"])
            assert op["op"] == "add" and op["path"] == "/spec/selector/statefulset.kubernetes.io~1pod-name"
            pinned = op["value"]
        else:
            pod = yaml.safe_load((TWO_DIR / patch["path"]).read_text())
            (patched,) = [c for c in pod["spec"]["initContainers"] if c["name"] == node["name"]]
            node["env"] = _merge_env(node["env"], patched["env"])
    assert pinned == f"{gateway_docs['StatefulSet']['metadata']['name']}-0"  # not a different gateway per connection
    return replicas, node


def test_two_gateways_are_two_replicas_every_node_lists_by_their_pod_names(node_sidecar: dict[str, Any],
                                                                          gateway_docs: dict[str, dict[str, Any]],
                                                                          settings_cls: type,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    replicas, node = two_gateways(node_sidecar, gateway_docs)
    settings = build_settings(settings_cls, k8s_env(node), monkeypatch)
    statefulset, headless = gateway_docs["StatefulSet"], gateway_docs["Service/headless"]
    port = headless["spec"]["ports"][0]["port"]
    want = [f"http://{statefulset['metadata']['name']}-{i}.{headless['metadata']['name']}:{port}" for i in range(replicas)]
    assert replicas == 2 and settings.gateway_urls == want  # every gateway, by the name the StatefulSet gives it
    assert settings.effective_exporters == [f"gateway@{u.split('//')[1]}" for u in want]  # a delivery cursor each
    assert settings.wandb_api_key is None
    _checked(settings)


def test_each_of_the_two_gateways_lists_both_to_answer_reads_for_the_job(node_sidecar: dict[str, Any],
                                                                        gateway_docs: dict[str, dict[str, Any]],
                                                                        gateway_container: dict[str, Any],
                                                                        settings_cls: type,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = copy.deepcopy(gateway_container)
    _, node = two_gateways(node_sidecar, gateway_docs, gateway)
    nodes = build_settings(settings_cls, k8s_env(node), monkeypatch)
    settings = build_settings(settings_cls, k8s_env(gateway), monkeypatch)
    assert settings.role == "gateway" and settings.gateway_peer_urls == nodes.gateway_urls  # the same gateways, same order
    _checked(settings)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")
def test_the_two_gateways_overlay_renders_with_kustomize(node_sidecar: dict[str, Any],
                                                         gateway_docs: dict[str, dict[str, Any]]) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(TWO_DIR)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    gateway = copy.deepcopy(next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"][0])
    replicas, node = two_gateways(node_sidecar, gateway_docs, want := copy.deepcopy(gateway_docs["StatefulSet"]["spec"]
                                                                                     ["template"]["spec"]["containers"][0]))
    assert sorted(gateway["env"], key=lambda i: i["name"]) == sorted(want["env"], key=lambda i: i["name"])
    assert next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["replicas"] == replicas
    pod = next(d for d in docs if d["kind"] == "Pod")
    rendered = next(c for c in pod["spec"]["initContainers"] if c["name"] == node["name"])
    assert sorted(rendered["env"], key=lambda i: i["name"]) == sorted(node["env"], key=lambda i: i["name"])
