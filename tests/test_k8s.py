"""deploy/k8s, validated offline (no cluster here): every core object strictly against the Kubernetes 1.29
and the newest schemas that kubernetes-validate bundles, the ServiceMonitor and the ScaledObject against
small JSON schemas, and the pieces checked against each other and against the controller's own code."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from controller.cli import build_parser
from controller.config import parse_config
from controller.telemetry import ControllerMetrics

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
VERSIONS = ["1.29", kubernetes_validate.latest_version()]
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}
TRITON_PROBES = {"/v2/health/live", "/v2/health/ready"}


# ---- a small kustomize: resources (files and folders), $patch: delete ----------------------------------

def kustomize(folder: Path) -> list[dict]:
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    objs: list[dict] = []
    for res in k.get("resources", []):
        path = (folder / res).resolve()
        objs += kustomize(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for p in k.get("patches", []):
        patch = yaml.safe_load(p["patch"])
        if patch.pop("$patch", None) == "delete":
            key = (patch["apiVersion"], patch["kind"], patch["metadata"]["name"])
            before = len(objs)
            objs = [o for o in objs if (o["apiVersion"], o["kind"], o["metadata"]["name"]) != key]
            assert len(objs) == before - 1, f"{folder}: the delete patch matches nothing: {key}"
    for image in k.get("images", []):
        for o in objs:
            for c in _containers(o):
                if c["image"] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return objs


def _containers(obj: dict) -> list[dict]:
    if obj["kind"] != "Deployment":
        return []
    return obj["spec"]["template"]["spec"]["containers"]


def one(objs: list[dict], kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, (kind, [o["kind"] for o in objs])
    return found[0]


HPA_OBJS = kustomize(K8S)
KEDA_OBJS = kustomize(K8S / "keda")
DEPLOY = one(HPA_OBJS, "Deployment")
POD = DEPLOY["spec"]["template"]["spec"]
SERVER = next(c for c in POD["containers"] if c["name"] == "tritonserver")
SIDECAR = next(c for c in POD["containers"] if c["name"] == "autotune")
CONFIG_MAP = one(HPA_OBJS, "ConfigMap")
CONFIG = parse_config(yaml.safe_load(CONFIG_MAP["data"]["config.yaml"]))


def test_the_two_variants_hold_what_they_should():
    assert sorted(o["kind"] for o in HPA_OBJS) == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Service",
                                                  "ServiceMonitor"]
    assert sorted(o["kind"] for o in KEDA_OBJS) == ["ConfigMap", "Deployment", "ScaledObject", "Service",
                                                   "ServiceMonitor"]
    assert SIDECAR["image"] == "triton-autotune:0.1.0"     # the kustomization's images entry applies


# ---- the schemas ----------------------------------------------------------------------------------------

def core_objects():
    seen = {}
    for o in HPA_OBJS + KEDA_OBJS:
        if (o["apiVersion"], o["kind"]) not in CRDS:
            seen[(o["kind"], o["metadata"]["name"])] = o
    return list(seen.values())


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("obj", core_objects(), ids=lambda o: f"{o['kind']}/{o['metadata']['name']}")
def test_core_objects_validate_strictly(obj, version):
    # why: a missing schema (SchemaNotFoundError) for a core group means a removed API version: it fails here
    kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_removed_api_version_or_an_unknown_field_fails(version):
    hpa = json.loads(json.dumps(one(HPA_OBJS, "HorizontalPodAutoscaler")))
    hpa["apiVersion"] = "autoscaling/v2beta2"               # removed in Kubernetes 1.26
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(hpa, version, strict=True)
    dep = json.loads(json.dumps(DEPLOY))
    dep["spec"]["template"]["spec"]["containers"][1]["securityContext"]["runAsNonroot"] = True   # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, version, strict=True)


SERVICE_MONITOR_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
                 "properties": {
                     "selector": {"type": "object", "properties": {"matchLabels": {"type": "object"}}},
                     "namespaceSelector": {"type": "object"},
                     "jobLabel": {"type": "string"},
                     "endpoints": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "additionalProperties": False, "required": ["port"],
                         "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                                        "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                        "scrapeTimeout": {"type": "string"}, "scheme": {"enum": ["http", "https"]},
                                        "honorLabels": {"type": "boolean"}}}}}}},
}

SCALED_OBJECT_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "additionalProperties": False, "required": ["scaleTargetRef", "triggers"],
                 "properties": {
                     "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                        "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                       "name": {"type": "string"}}},
                     "minReplicaCount": {"type": "integer", "minimum": 0},
                     "maxReplicaCount": {"type": "integer", "minimum": 1},
                     "pollingInterval": {"type": "integer", "minimum": 1},
                     "cooldownPeriod": {"type": "integer", "minimum": 0},
                     "advanced": {"type": "object", "additionalProperties": False, "properties": {
                         "horizontalPodAutoscalerConfig": {"type": "object", "properties": {
                             "behavior": {"type": "object"}, "name": {"type": "string"}}},
                         "restoreToOriginalReplicaCount": {"type": "boolean"}}},
                     "triggers": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "required": ["type", "metadata"],
                         "properties": {"type": {"type": "string"},
                                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                        "metadata": {"type": "object",
                                                     "additionalProperties": {"type": "string"}}}}}}}},
}


def test_service_monitor_and_scaled_object_match_their_schemas():
    jsonschema.validate(one(HPA_OBJS, "ServiceMonitor"), SERVICE_MONITOR_SCHEMA)
    jsonschema.validate(one(KEDA_OBJS, "ScaledObject"), SCALED_OBJECT_SCHEMA)
    so = one(KEDA_OBJS, "ScaledObject")
    # KEDA's HPA behavior is the autoscaling/v2 one: validate it as part of an HPA
    hpa = json.loads(json.dumps(one(HPA_OBJS, "HorizontalPodAutoscaler")))
    hpa["spec"]["behavior"] = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    for v in VERSIONS:
        kubernetes_validate.validate(hpa, v, strict=True)


# ---- consistency ------------------------------------------------------------------------------------------

def registered_metric_names() -> set[str]:
    m = ControllerMetrics()
    gauges = [m.capacity, m.pod_capacity, m.saturated, m.p99_ratio, m.capacity_rps]
    return {g._name for g in gauges} | {f.name for f in m.registry.collect()}


def test_the_metric_the_scalers_read_is_one_the_controller_exports():
    names = registered_metric_names()
    hpa = one(HPA_OBJS, "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert name == "triton_autotune_pod_capacity_utilization" and name in names
    assert 0.7 <= _quantity(metric["pods"]["target"]["averageValue"]) <= 0.85
    b = hpa["spec"]["behavior"]
    assert b["scaleUp"]["stabilizationWindowSeconds"] < b["scaleDown"]["stabilizationWindowSeconds"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == DEPLOY["metadata"]["name"]
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert rule["name"]["as"] == name and rule["seriesQuery"].startswith(name + "{")
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    # a range in the query (max_over_time(...[1m])) would hold one high reading longer than the HPA's scale-up
    # window and so defeat it: any range must be no longer than that window
    units = {"s": 1, "m": 60, "h": 3600}
    ranges = [int(n) * units[u] for n, u in re.findall(r"\[(\d+)([smh])\]", rule["metricsQuery"])]
    assert all(r <= b["scaleUp"]["stabilizationWindowSeconds"] for r in ranges), rule["metricsQuery"]
    so = one(KEDA_OBJS, "ScaledObject")
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert re.search(rf"\bsum\({name}\{{", trigger["metadata"]["query"])
    assert float(trigger["metadata"]["threshold"]) == _quantity(metric["pods"]["target"]["averageValue"])
    assert so["spec"]["scaleTargetRef"]["name"] == DEPLOY["metadata"]["name"]


def _quantity(q) -> float:
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def test_ports_and_probes_agree_between_containers_service_and_monitor():
    server_ports, sidecar_ports = _ports(SERVER), _ports(SIDECAR)
    all_ports = {**server_ports, **sidecar_ports}
    assert len(all_ports) == len(server_ports) + len(sidecar_ports)          # no name twice in the pod
    assert all(len(n) <= 15 for n in all_ports)                             # IANA service names
    svc = one(HPA_OBJS, "Service")
    assert svc["spec"]["selector"].items() <= DEPLOY["spec"]["template"]["metadata"]["labels"].items()
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    for p in svc_ports.values():
        assert p["targetPort"] in all_ports and p["port"] == all_ports[p["targetPort"]]
    mon = one(HPA_OBJS, "ServiceMonitor")
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    scraped = {e["port"] for e in mon["spec"]["endpoints"]}
    assert scraped == {"metrics", "tuner-metrics"} and scraped <= set(svc_ports)
    # the server's metrics port is the one the controller scrapes; the sidecar's is its metrics_port
    assert CONFIG.server.metrics_url == f"http://127.0.0.1:{server_ports['metrics']}/metrics"
    assert CONFIG.server.http_url == f"127.0.0.1:{server_ports['http']}"
    assert CONFIG.server.grpc_url == f"127.0.0.1:{server_ports['grpc']}"
    assert CONFIG.loop.metrics_port == sidecar_ports["tuner-metrics"] and CONFIG.loop.metrics_address == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe"):
        get = SERVER[probe]["httpGet"]
        assert get["path"] in TRITON_PROBES and get["port"] == "http", probe
    assert SERVER["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    # liveness over gRPC (grpc.health.v1, which Triton answers): the hang seen here left HTTP's health answering
    live = SERVER["livenessProbe"]
    assert live["grpc"]["port"] == server_ports["grpc"] and "httpGet" not in live
    assert live["periodSeconds"] * live["failureThreshold"] >= 60 and live["timeoutSeconds"] >= 5
    startup = SERVER["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300       # model loading: minutes
    assert SIDECAR["livenessProbe"]["httpGet"]["port"] in sidecar_ports
    # `run` opens its endpoint only once the server answers: the sidecar's start-up allowance covers the server's
    s_startup = SIDECAR["startupProbe"]
    assert s_startup["httpGet"]["port"] in sidecar_ports
    assert s_startup["periodSeconds"] * s_startup["failureThreshold"] > startup["periodSeconds"] * startup["failureThreshold"]


def _flags(container: dict) -> list[str]:
    return list(container.get("command", [])[1:]) + list(container.get("args", []))


def test_the_server_runs_as_the_controller_needs_it():
    flags = _flags(SERVER)
    assert SERVER["image"].startswith("nvcr.io/nvidia/tritonserver:")
    assert "--model-control-mode=explicit" in flags
    trace = [f for f in flags if f.startswith("--trace-config=triton,file=")]
    assert len(trace) == 1 and "--trace-config=level=OFF" in flags
    trace_path = trace[0].split("file=", 1)[1]
    # the trace folder is one volume mounted at the same path in both containers (or controller.trace_file)
    seen_by_controller = CONFIG.loop.trace_file or trace_path
    def volume_at(container, path):
        for m in container["volumeMounts"]:
            if path.startswith(m["mountPath"].rstrip("/") + "/"):
                return m["name"], path[len(m["mountPath"]):]
        return None
    assert volume_at(SERVER, trace_path) is not None
    assert volume_at(SERVER, trace_path) == volume_at(SIDECAR, seen_by_controller)
    assert not any(m.get("readOnly") for m in SIDECAR["volumeMounts"] if m["name"] == volume_at(SERVER, trace_path)[0])
    assert SERVER["resources"]["limits"]["nvidia.com/gpu"] == 1
    repo = next(f.split("=", 1)[1] for f in flags if f.startswith("--model-repository="))
    assert volume_at(SERVER, repo.rstrip("/") + "/x") is not None


def test_one_secret_guards_the_repository_api_for_both_containers():
    def secret_env(container):
        return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    header, env = CONFIG.server.auth_header, CONFIG.server.auth_key_env
    assert header and env in secret_env(SIDECAR)
    restricted = [f for f in _flags(SERVER) if f.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))]
    assert len(restricted) == 2
    for flag in restricted:
        m = re.fullmatch(r"--(?:http-restricted-api|grpc-restricted-protocol)=model-repository:([\w-]+)=\$\((\w+)\)", flag)
        assert m, flag
        assert m.group(1) == header
        assert secret_env(SERVER)[m.group(2)] == secret_env(SIDECAR)[env]


def test_the_sidecar_command_parses_with_the_project_parser_and_is_locked_down():
    cmd = SIDECAR["command"]
    assert cmd == ["python", "-m", "controller"]
    args = build_parser().parse_args(SIDECAR["args"])
    assert args.command == "run" if hasattr(args, "command") else True
    assert str(args.config) == "/etc/triton-autotune/config.yaml"
    mount = next(m for m in SIDECAR["volumeMounts"] if m["mountPath"] == str(args.config.parent))
    vol = next(v for v in POD["volumes"] if v["name"] == mount["name"])
    assert vol["configMap"]["name"] == CONFIG_MAP["metadata"]["name"] and "config.yaml" in CONFIG_MAP["data"]
    sc = SIDECAR["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "nvidia.com/gpu" not in SIDECAR["resources"].get("limits", {})
    # the decision log is on a writable mount (the root filesystem is read-only)
    log_dir = str(Path(CONFIG.loop.decision_log).parent)
    assert any(m["mountPath"] == log_dir and not m.get("readOnly") for m in SIDECAR["volumeMounts"])
    # the image runs the same thing by default
    docker = (K8S / "Dockerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", docker, re.M).group(1))
    default = json.loads(re.search(r"^CMD (.+)$", docker, re.M).group(1))
    assert entry == cmd and default == SIDECAR["args"]
    assert "tritonserver" not in docker.split("FROM", 1)[1].split("ENTRYPOINT")[0].replace("the server image", "")


def test_the_sidecar_image_installs_what_the_controller_imports():
    """Every third-party module the controller's run path imports is in sidecar-requirements.txt."""
    reqs = {re.split(r"[<>=\[ ]", ln, 1)[0].lower() for ln in (K8S / "sidecar-requirements.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")}
    module_of = {"yaml": "pyyaml", "prometheus_client": "prometheus-client", "pynvml": "nvidia-ml-py",
                 "tritonclient": "tritonclient", "numpy": "numpy"}
    run_path = ["cli", "loop", "actuation", "signals", "traces", "service", "gpu", "observer", "arbiter", "policy",
                "capacity", "status", "runstate", "server", "telemetry", "config", "types", "decision_log", "sweep_schema"]
    imported = set()
    for mod in run_path:
        for line in (ROOT / "controller" / f"{mod}.py").read_text().splitlines():
            m = re.match(r"\s*(?:import|from)\s+([a-zA-Z_]\w*)", line)
            if m and m.group(1) in module_of:
                imported.add(module_of[m.group(1)])
            # at module level (a function's lazy import, e.g. `serve` finding the pytriton wheel, is not run by `run`)
            assert not re.match(r"(?:import|from)\s+(torch|matplotlib|pytriton)\b", line), (mod, line)
    assert imported <= reqs, imported - reqs


def test_the_readme_names_the_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Kubernetes", 1)[1].split("\n## ", 1)[0]
    for needle in ("kubectl apply -k deploy/k8s", "kubectl apply -k deploy/k8s/keda", "docker build -f deploy/k8s/Dockerfile",
                   "kubectl create secret generic triton-admin-key", "triton_autotune_pod_capacity_utilization",
                   "metrics_address"):
        assert needle in section, needle
    assert shlex.split("kubectl apply -k deploy/k8s")
