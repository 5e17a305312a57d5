"""deploy/kubernetes: every manifest is valid for Kubernetes (checked offline against the
schemas kubernetes-validate ships), and the routers, the agents and the store agree on
names, counts and options the programs really accept."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from hivenet_router.config.agent import AgentConfig
from hivenet_router.config.options import load
from hivenet_router.config.router import RouterConfig

MANIFESTS = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"
# The newest Kubernetes whose schemas kubernetes-validate 1.37 ships.
KUBERNETES = "1.37.0"
NAMESPACE = "hivenet"
Doc = dict[str, Any]


def _documents() -> list[tuple[str, Doc]]:
    found: list[tuple[str, Doc]] = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((path.name, doc))
    return found


DOCUMENTS = _documents()


def _one(kind: str, name: str) -> Doc:
    matches = [d for _, d in DOCUMENTS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def _container(workload: Doc, name: str) -> Doc:
    containers: list[Doc] = workload["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name)


def _environment(container: Doc, pod: str) -> dict[str, str]:
    """The container's environment as the kubelet would set it in pod `pod`: downward-API
    fields filled in, $(VAR) references to earlier variables expanded."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = _expand(item["value"], env)
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            env[item["name"]] = {"metadata.name": pod, "metadata.namespace": NAMESPACE}[path]
        else:
            env[item["name"]] = "from-a-secret"
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


@pytest.mark.parametrize(
    "doc",
    [d for _, d in DOCUMENTS],
    ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCUMENTS],
)
def test_every_manifest_is_valid_kubernetes(doc: Doc) -> None:
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_validation_is_strict() -> None:
    router = copy.deepcopy(_one("StatefulSet", "router"))
    router["spec"]["replica"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(router, KUBERNETES, strict=True)


def test_every_object_names_the_namespace_and_kustomize_applies_every_file() -> None:
    for _, doc in DOCUMENTS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == NAMESPACE
    files = {p.name for p in MANIFESTS.glob("*.yaml")}
    # The example secret holds placeholders: it is applied by hand, never by kustomize.
    assert set(kustomization["resources"]) == files - {"kustomization.yaml", "secret.example.yaml"}


def test_the_router_count_is_the_same_everywhere() -> None:
    router = _one("StatefulSet", "router")
    replicas = router["spec"]["replicas"]
    env = _environment(_container(router, "router"), "router-0")
    assert int(env["HIVENET_ROUTER_SYNC_MIN_ROUTERS"]) == replicas
    headless = _one("Service", router["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert {"port": 50051, "name": "grpc"}.items() <= headless["spec"]["ports"][0].items()
    agent = _container(_one("Deployment", "agent"), "agent")
    routers = _environment(agent, "agent-x")["HIVENET_AGENT_ROUTERS"].split(",")
    expected = [f"router-{i}.{headless['metadata']['name']}:50051" for i in range(replicas)]
    assert routers == expected


def test_the_sentinels_the_routers_ask_are_the_ones_deployed() -> None:
    sentinels = _one("StatefulSet", "valkey-sentinel")
    service = sentinels["spec"]["serviceName"]
    env = _environment(_container(_one("StatefulSet", "router"), "router"), "router-0")
    assert env["HIVENET_ROUTER_SYNC_SENTINELS"].split(",") == [
        f"valkey-sentinel-{i}.{service}:26379" for i in range(sentinels["spec"]["replicas"])
    ]
    script = _one("ConfigMap", "valkey-sentinel-scripts")["data"]["sentinel.sh"]
    master = env["HIVENET_ROUTER_SYNC_MASTER"]
    assert f"sentinel monitor {master} ${{primary}} 6379 2" in script
    assert "sentinel resolve-hostnames yes" in script
    assert "sentinel announce-hostnames yes" in script


def test_valkey_keeps_its_data_and_lets_the_routers_ask_for_acknowledgements() -> None:
    script = _one("ConfigMap", "valkey-scripts")["data"]["valkey.sh"]
    assert 'echo "appendonly yes"' in script
    assert "replicaof" in script
    assert "min-replicas-to-write" not in script
    assert _one("StatefulSet", "valkey")["spec"]["replicas"] == 3


def test_the_router_accepts_its_flags_and_environment() -> None:
    router = _container(_one("StatefulSet", "router"), "router")
    env = _environment(router, "router-1")
    args = [_expand(a, env) for a in router["args"]]
    config = load(RouterConfig, args, env, "hivenet-router")
    assert config.sync_store == "valkey"
    assert config.router_id == "router-1"
    assert config.sync_site == "site-a"
    assert config.advertise_grpc_addr == "router-1.router-headless.hivenet.svc.cluster.local:50051"
    assert config.p2p_announce_addr.startswith("/dns4/router-1.router-headless.hivenet.svc")
    assert config.jwt_secret_file == "/etc/hivenet/jwt/secret"
    mounts = {m["mountPath"] for m in router["volumeMounts"]}
    assert str(Path(config.jwt_secret_file).parent) in mounts
    assert str(Path(config.sync_password_file).parent) in mounts
    probe = router["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and probe["port"] == "http"
    assert {"name": "http", "containerPort": 8080} in router["ports"]
    assert router["resources"]["requests"]


def test_the_agent_accepts_its_flags_and_environment() -> None:
    agent = _container(_one("Deployment", "agent"), "agent")
    env = _environment(agent, "agent-x")
    config = load(AgentConfig, agent["args"], env, "hivenet-agent")
    assert len(config.routers) == _one("StatefulSet", "router")["spec"]["replicas"]
    assert config.backend_url == "http://127.0.0.1:8000"
