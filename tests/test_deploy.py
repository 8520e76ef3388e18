"""Deployment artefacts are valid, consistent with each other and with the relay itself.

Nothing here needs Docker or a cluster: Kubernetes manifests are validated offline against
the API schemas of named Kubernetes versions, the Dockerfile is linted and its install
steps are run in a clean virtualenv, alert rules are checked and unit-tested by promtool,
and every metric name the alerts and the dashboard query is compared with a real scrape
of a running relay.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from prometheus_client.parser import text_string_to_metric_families
from psycopg.conninfo import conninfo_to_dict

from relay.settings import SECRET_FIELDS, Settings, is_setting_variable
from tests.conftest import REPO, relay_env, start_relay
from tests.harness import free_port
from tests.harness.kafka import TansuBroker
from tests.harness.postgres import PostgresServer
from tests.support import insert_rows, keyed_rows, scalar, wait_until

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
MONITORING = DEPLOY / "monitoring"
RULES = MONITORING / "relay-alerts.yml"
RULE_TESTS = MONITORING / "relay-alerts.test.yml"
DASHBOARD = MONITORING / "relay-dashboard.json"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"

# The manifests are validated against the oldest Kubernetes release we support and a
# current one (the kubectl client on the project's machines is 1.32). Both must pass.
KUBERNETES_VERSIONS = ("1.29.0", "1.32.0")

# Custom resources have no schema in kubernetes-validate (it only ships the core API).
# They are not skipped silently: the ServiceMonitor is checked against the Service it
# must select, the PrometheusRule against the rules file promtool checks and tests.
CUSTOM_RESOURCE_API_GROUPS = {"monitoring.coreos.com"}


# Series Prometheus itself attaches to every target.
PROMETHEUS_SERIES = {"up"}

# Time the relay needs after RELAY_SHUTDOWN_TIMEOUT_SECONDS: up to 5 s to flush the
# producer and up to 5 s to join the elector and release the lease (relay/daemon/app.py).
SHUTDOWN_AFTER_TIMEOUT_SECONDS = 10


# --- helpers ---


def _tool(name: str) -> str:
    """A tool from this virtualenv (yamllint, hadolint) or, failing that, from PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    assert found, f"{name} is not installed (./dev test installs it)"
    return found


def _run(*argv: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def _load_all(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


def _load(path: Path) -> Any:
    with path.open(encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def _kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def _manifest(kind: str, name: str) -> dict[str, Any]:
    for path in _manifest_files():
        for doc in _load_all(path):
            if doc["kind"] == kind and doc["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"no {kind} {name} under {K8S}")


def _pod_spec(kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = _manifest(kind, name)["spec"]["template"]["spec"]
    return spec


def _dockerfile_uid() -> int:
    match = re.search(r"^ARG RELAY_UID=(\d+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, "Dockerfile must declare ARG RELAY_UID=<number>"
    return int(match[1])


# --- YAML and Kubernetes manifests ---


def test_yaml_files_are_lint_clean() -> None:
    done = _run(_tool("yamllint"), "--strict", "-c", ".yamllint", "deploy", ".yamllint")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version: str) -> None:
    checked = 0
    for path in _manifest_files():
        for doc in _load_all(path):
            group = doc["apiVersion"].split("/")[0]
            if group in CUSTOM_RESOURCE_API_GROUPS:
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{path.relative_to(REPO)}: {exc.message}") from None
            checked += 1
    # sa, configmap, deployment, service, pdb, networkpolicy, job, 2 example secrets
    assert checked >= 9


def test_every_kustomization_lists_exactly_its_manifests() -> None:
    for kustomization in _kustomizations():
        folder = kustomization.parent
        resources = _load(kustomization)["resources"]
        files = {r for r in resources if r.endswith(".yaml")}
        dirs = [r for r in resources if not r.endswith(".yaml")]
        # *.example.yaml holds placeholders that `apply -k` must never apply.
        present = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
        expected = {name for name in present if not name.endswith(".example.yaml")}
        assert files == expected, f"{kustomization.relative_to(REPO)}: {sorted(files ^ expected)}"
        for sub in dirs:
            assert (folder / sub / "kustomization.yaml").is_file(), f"{folder}: {sub}"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) not installed")
def test_kustomize_renders_valid_manifests() -> None:
    for kustomization in _kustomizations():
        done = _run("kubectl", "kustomize", str(kustomization.parent), timeout=60)
        assert done.returncode == 0, done.stderr
        for doc in yaml.safe_load_all(done.stdout):
            if doc["apiVersion"].split("/")[0] in CUSTOM_RESOURCE_API_GROUPS:
                continue
            kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)
            for pod in _pod_templates(doc):
                for container in pod["containers"]:
                    assert container["image"].startswith("registry.example.com/"), container


def _pod_templates(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    template = doc.get("spec", {}).get("template")
    if template:
        yield template["spec"]


def test_deployment_runs_replicas_safely() -> None:
    deployment = _manifest("Deployment", "relay")
    assert 2 <= deployment["spec"]["replicas"] <= 3
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = deployment["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    spec = pod["spec"]

    assert spec["enableServiceLinks"] is False
    job = _manifest("Job", "relay-migrate")["spec"]["template"]["spec"]
    assert job["enableServiceLinks"] is False
    spread = {c["topologyKey"]: c for c in spec["topologySpreadConstraints"]}
    assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"

    (container,) = spec["containers"]
    assert container["args"] == ["run"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    for resource in ("cpu", "memory"):
        assert resource in container["resources"]["requests"]
        assert resource in container["resources"]["limits"]

    config = _manifest("ConfigMap", "relay-config")["data"]
    # The relay binds 127.0.0.1 by default: in a pod, probes and Prometheus would fail.
    assert config["RELAY_METRICS_HOST"] == "0.0.0.0"  # noqa: S104
    assert int(config["RELAY_METRICS_PORT"]) == ports["metrics"]

    shutdown = float(
        config.get(
            "RELAY_SHUTDOWN_TIMEOUT_SECONDS",
            Settings.model_fields["shutdown_timeout_seconds"].default,
        )
    )
    assert spec["terminationGracePeriodSeconds"] > shutdown + SHUTDOWN_AFTER_TIMEOUT_SECONDS

    env = {e["name"]: e for e in container["env"]}
    assert env["RELAY_REPLICA_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # Secrets come from files, never as plain env values.
    for field in SECRET_FIELDS:
        assert f"RELAY_{field.upper()}" not in env
        assert f"RELAY_{field.upper()}" not in config


@pytest.mark.parametrize(("kind", "name"), [("Deployment", "relay"), ("Job", "relay-migrate")])
def test_pods_run_restricted_as_the_image_user(kind: str, name: str) -> None:
    spec = _pod_spec(kind, name)
    uid = _dockerfile_uid()
    pod_security = spec["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    assert pod_security["runAsUser"] == uid
    assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    for container in spec["containers"]:
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True
        assert security["capabilities"]["drop"] == ["ALL"]
        assert security.get("runAsUser", uid) == uid


@pytest.mark.parametrize(("kind", "name"), [("Deployment", "relay"), ("Job", "relay-migrate")])
def test_secret_files_the_pods_read_exist_in_the_example_secrets(kind: str, name: str) -> None:
    spec = _pod_spec(kind, name)
    secrets = {
        doc["metadata"]["name"]: doc
        for doc in _load_all(K8S / "base" / "secrets.example.yaml")
        if doc["kind"] == "Secret"
    }
    mounts: dict[str, set[str]] = {}
    for volume in spec["volumes"]:
        if "secret" in volume:
            secret = secrets[volume["secret"]["secretName"]]
            mounts[volume["name"]] = set(secret["stringData"])
    (container,) = spec["containers"]
    paths = {
        m["mountPath"]: mounts[m["name"]] for m in container["volumeMounts"] if m["name"] in mounts
    }
    file_env = [e for e in container["env"] if e["name"].endswith("_FILE")]
    assert file_env, "secrets are expected as RELAY_*_FILE"
    for entry in file_env:
        folder, key = entry["value"].rsplit("/", 1)
        assert key in paths[folder], f"{entry['name']}: no key {key!r} in the Secret at {folder}"
    if kind == "Job":
        # The migration runs as the schema owner, from its own Secret.
        assert {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v} == {
            "relay-migrate-secrets"
        }
        assert spec["containers"][0]["args"] == ["migrate"]


def test_example_secrets_hold_placeholders_only() -> None:
    for doc in _load_all(K8S / "base" / "secrets.example.yaml"):
        assert "data" not in doc, "use stringData with visible placeholders"
        for key, value in doc["stringData"].items():
            if key.endswith("password") or key.endswith("secret"):
                assert "REPLACE-ME" in value, f"{key} must be a placeholder"
            assert ":" not in value.split("@")[0].removeprefix("postgresql://"), key


def _pod_env(kind: str, name: str) -> dict[str, str]:
    """The RELAY_* values a pod's container gets: its ConfigMaps, then its own env."""
    (container,) = _pod_spec(kind, name)["containers"]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env |= _manifest("ConfigMap", source["configMapRef"]["name"])["data"]
    env |= {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return env


def _example_secret_file(kind: str, name: str, variable: str) -> str:
    """What the pod's RELAY_*_FILE variable reads: the example Secret's key it mounts."""
    spec = _pod_spec(kind, name)
    (container,) = spec["containers"]
    path = next(e["value"] for e in container["env"] if e["name"] == variable)
    folder, key = path.rsplit("/", 1)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    secrets = {
        doc["metadata"]["name"]: doc
        for doc in _load_all(K8S / "base" / "secrets.example.yaml")
        if doc["kind"] == "Secret"
    }
    return str(secrets[volume["secret"]["secretName"]]["stringData"][key])


@pytest.mark.parametrize(
    ("kind", "name"),
    [("Deployment", "relay"), ("Job", "relay-migrate"), ("Deployment", "relay-console")],
)
def test_pods_verify_the_database_server_against_a_mounted_ca(kind: str, name: str) -> None:
    """verify-full, with the URL's sslrootcert a file of a mounted volume. Before:
    sslmode require, which checks no certificate: the password went to whoever answered.
    (RELAY_DATABASE_SSLMODE and _SSLROOTCERT are gone: libpq reads them from the URL.)"""
    env = _pod_env(kind, name)
    assert not {"RELAY_DATABASE_SSLMODE", "RELAY_DATABASE_SSLROOTCERT"} & set(env)
    url = _example_secret_file(kind, name, "RELAY_DATABASE_URL_FILE")
    params = conninfo_to_dict(url)
    assert params["sslmode"] == "verify-full"
    folder, file_name = str(params["sslrootcert"]).rsplit("/", 1)
    spec = _pod_spec(kind, name)
    (container,) = spec["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts[folder]["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mounts[folder]["name"]]
    source = volume.get("configMap") or volume.get("secret")
    assert source is not None, volume
    assert [item["path"] for item in source["items"]] == [file_name]
    # The relay, its migration and the console trust the same CA.
    relay_ca = _pod_spec("Deployment", "relay")["volumes"]
    assert volume in relay_ca


def test_disruption_budget_and_service_select_the_relay_pods() -> None:
    pod_labels = _manifest("Deployment", "relay")["spec"]["template"]["metadata"]["labels"]
    pdb = _manifest("PodDisruptionBudget", "relay")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["minAvailable"] == 1
    service = _manifest("Service", "relay")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert any(p["name"] == "metrics" for p in service["spec"]["ports"])


def test_service_monitor_scrapes_the_relay_service() -> None:
    (monitor,) = _load_all(K8S / "prometheus-operator" / "servicemonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "ServiceMonitor"
    service = _manifest("Service", "relay")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
    # The alert rules select job="relay": the operator names the job after the Service.
    assert service["metadata"]["name"] == "relay"
    assert "jobLabel" not in monitor["spec"]


def _container_port_number(container: dict[str, Any], port: int | str) -> int:
    """A port as a Service or a NetworkPolicy names it (number or name), as a number."""
    for declared in container["ports"]:
        if port in (declared["name"], declared["containerPort"]):
            return int(declared["containerPort"])
    raise AssertionError(f"the container declares no port {port!r}")


def test_network_policy_admits_only_prometheus_to_the_metrics_port() -> None:
    """The relay pods, exactly; ingress from Prometheus pods of one namespace (both
    selectors in one peer: a second list item would admit either), on the port the
    Service and the ServiceMonitor scrape; egress left open (networkpolicy.yaml says why)."""
    policy = _manifest("NetworkPolicy", "relay")
    deployment = _manifest("Deployment", "relay")
    assert policy["spec"]["podSelector"] == deployment["spec"]["selector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"namespaceSelector", "podSelector"}
    assert peer["namespaceSelector"]["matchLabels"]
    assert peer["podSelector"]["matchLabels"]

    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    service = _manifest("Service", "relay")
    (scraped,) = _load_all(K8S / "prometheus-operator" / "servicemonitor.yaml")
    scraped_names = {endpoint["port"] for endpoint in scraped["spec"]["endpoints"]}
    targets = {
        _container_port_number(container, p["targetPort"])
        for p in service["spec"]["ports"]
        if p["name"] in scraped_names | {"metrics"}
    }
    admitted = {_container_port_number(container, p["port"]) for p in rule["ports"]}
    assert all(p["protocol"] == "TCP" for p in rule["ports"])
    assert admitted == targets == {_container_port_number(container, "metrics")}


# --- the operators' console (relay console, docs/console.md) ---


@pytest.mark.parametrize(
    "rule",
    [
        test_pods_run_restricted_as_the_image_user,
        test_secret_files_the_pods_read_exist_in_the_example_secrets,
        test_pods_verify_the_database_server_against_a_mounted_ca,
    ],
)
def test_the_console_pod_keeps_the_relay_pods_rules(rule: Any) -> None:
    rule("Deployment", "relay-console")


def test_the_console_runs_apart_and_only_its_proxy_reaches_it() -> None:
    """Its own Deployment (no service links: a Service named relay-console would set
    RELAY_CONSOLE_PORT), a Service on its port, and a NetworkPolicy of its own that
    admits one peer (both selectors in one item) to that port; the relay's policy does
    not select the console's pods, nor the console's the relay's."""
    deployment = _manifest("Deployment", "relay-console")
    pod = deployment["spec"]["template"]
    spec = pod["spec"]
    assert spec["enableServiceLinks"] is False
    (container,) = spec["containers"]
    assert container["args"] == ["console"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RELAY_CONSOLE_HOST"] == "0.0.0.0"  # noqa: S104
    assert int(env["RELAY_CONSOLE_PORT"]) == _container_port_number(container, "http")
    assert "RELAY_CONSOLE_TOKEN" not in env and "RELAY_CONSOLE_TOKEN_FILE" in env
    console_labels = pod["metadata"]["labels"]
    relay_labels = _manifest("Deployment", "relay")["spec"]["template"]["metadata"]["labels"]

    policy = _manifest("NetworkPolicy", "relay-console")
    assert policy["spec"]["podSelector"] == deployment["spec"]["selector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"namespaceSelector", "podSelector"}
    admitted = {_container_port_number(container, p["port"]) for p in rule["ports"]}
    service = _manifest("Service", "relay-console")
    assert service["spec"]["selector"].items() <= console_labels.items()
    targets = {_container_port_number(container, p["targetPort"]) for p in service["spec"]["ports"]}
    assert admitted == targets == {9109}
    relay_policy = _manifest("NetworkPolicy", "relay")["spec"]["podSelector"]["matchLabels"]
    assert not relay_policy.items() <= console_labels.items()
    assert not policy["spec"]["podSelector"]["matchLabels"].items() <= relay_labels.items()


def test_every_console_variable_in_deploy_is_a_console_setting() -> None:
    from relay.console.settings import check_console_variables

    found = {n for names in _relay_env_names().values() for n in names}
    console = {n for n in found if n.startswith("RELAY_CONSOLE_")}
    assert {"RELAY_CONSOLE_HOST", "RELAY_CONSOLE_TOKEN_FILE"} <= console
    check_console_variables(dict.fromkeys(console, "x"))


# --- settings named anywhere in deploy/ exist ---


def _known_setting(name: str) -> bool:
    return is_setting_variable(name)


def _relay_env_names() -> dict[str, set[str]]:
    """Every RELAY_* variable set by a ConfigMap, a pod, or a compose service."""
    found: dict[str, set[str]] = {}
    for path in _manifest_files():
        for doc in _load_all(path):
            names = set()
            if doc["kind"] == "ConfigMap":
                names |= set(doc["data"])
            for pod in _pod_templates(doc):
                for container in pod["containers"]:
                    names |= {e["name"] for e in container.get("env", [])}
            found[f"{path.relative_to(REPO)}:{doc['metadata']['name']}"] = names
    for service, body in _load(COMPOSE)["services"].items():
        found[f"compose:{service}"] = set(body.get("environment", {}))
    return {where: {n for n in names if n.startswith("RELAY_")} for where, names in found.items()}


def test_every_relay_variable_in_deploy_is_a_real_setting() -> None:
    everything = _relay_env_names()
    assert sum(len(names) for names in everything.values()) > 20
    for where, names in everything.items():
        unknown = sorted(n for n in names if not _known_setting(n))
        assert not unknown, f"{where}: not a relay setting: {unknown}"


def test_known_setting_rejects_typos() -> None:
    assert _known_setting("RELAY_BATCH_SIZE")
    assert _known_setting("RELAY_DATABASE_URL_FILE")
    assert _known_setting("RELAY_KAFKA__SSL_CA_LOCATION")
    assert not _known_setting("RELAY_BATCHSIZE")
    assert not _known_setting("RELAY_LEASE_NAME_FILE")


# --- docker compose ---


def test_compose_stack_is_wired_together() -> None:
    compose = _load(COMPOSE)
    services = compose["services"]
    assert {"postgres", "kafka", "migrate", "grants", "relay-1", "relay-2"} <= set(services)
    for name, body in services.items():
        for dependency in body.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        build = body.get("build")
        if build:
            assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
        for volume in body.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).exists(), f"{name}: {source}"
        image = body["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin {image}"
    assert services["migrate"]["command"] == ["migrate"]
    for replica in ("relay-1", "relay-2"):
        env = services[replica]["environment"]
        assert env["RELAY_METRICS_HOST"] == "0.0.0.0"  # noqa: S104
        assert "relay:" in env["RELAY_DATABASE_URL"]  # the least-privilege role
    replica_ids = {services[r]["environment"]["RELAY_REPLICA_ID"] for r in ("relay-1", "relay-2")}
    assert len(replica_ids) == 2


# --- Dockerfile and image ---


def test_dockerfile_is_lint_clean() -> None:
    done = _run(_tool("hadolint"), "--no-color", "Dockerfile")
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_builds_a_small_non_root_image() -> None:
    text = DOCKERFILE.read_text()
    instructions = [
        line for line in re.sub(r"\\\n", " ", text).splitlines() if line and line[0] != "#"
    ]
    stages = [line for line in instructions if line.startswith("FROM ")]
    assert len(stages) >= 2, "multi-stage: build, then runtime"
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.MULTILINE)
    assert base and re.fullmatch(r"python:3\.11[\w.-]*-slim[\w.-]*", base[1]), "pin the base tag"
    final = instructions[instructions.index(stages[-1]) :]
    assert "USER ${RELAY_UID}:${RELAY_UID}" in final
    assert _dockerfile_uid() >= 10000
    assert 'ENTRYPOINT ["relay"]' in final and 'CMD ["run"]' in final
    assert "STOPSIGNAL SIGTERM" in final
    assert any(line.startswith("HEALTHCHECK ") for line in final)
    assert not re.search(r"\b(gcc|build-essential|apt-get install)\b", " ".join(final))
    assert "--require-hashes" in " ".join(final) and "pip check" in " ".join(final)


def test_dockerignore_admits_exactly_what_the_dockerfile_copies() -> None:
    allowed = {
        line[1:].rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    copied: set[str] = set()
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            copied.update(line.split()[1:-1])
    assert copied == allowed


def _lock_pins(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==(\S+) \\$", line)
        if match:
            pins[canonicalize_name(match[1])] = match[2]
    return pins


def test_lock_file_pins_every_runtime_dependency_with_hashes() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    lock = REPO / "requirements.lock"
    pins = _lock_pins(lock)
    for spec in project["project"]["dependencies"]:
        requirement = Requirement(spec)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} missing from requirements.lock: run deploy/lock.sh"
        assert requirement.specifier.contains(pins[name]), (
            f"requirements.lock pins {name}=={pins[name]}, pyproject wants {requirement}:"
            " run deploy/lock.sh"
        )
    for path in (lock, REPO / "requirements-build.lock"):
        blocks = re.split(r"\n(?=[a-z0-9])", path.read_text())
        for block in blocks[1:]:
            assert "--hash=sha256:" in block, f"{path.name}: {block.splitlines()[0]} has no hash"
    build_requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    for spec in build_requires["requires"]:
        requirement = Requirement(spec)
        build_pins = _lock_pins(REPO / "requirements-build.lock")
        assert requirement.specifier.contains(build_pins[canonicalize_name(requirement.name)])


def _pip_env() -> dict[str, str]:
    """pip as it behaves in the image build: PyPI only, no local mirrors or config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "RELAY_"))}
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env.update({"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return env


def _pip(python: Path, *args: str, cwd: Path) -> None:
    done = subprocess.run(
        [str(python), "-m", "pip", "-q", *args],
        cwd=cwd,
        env=_pip_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"pip {' '.join(args)}:\n{done.stdout}\n{done.stderr}"


def _base_python() -> str:
    # The interpreter this virtualenv was made from, so the clean venvs are not nested.
    return str(Path(getattr(sys, "_base_executable", sys.executable)))


@pytest.mark.slow
def test_image_install_steps_give_a_working_relay_outside_docker(
    tmp_path: Path, pg: PostgresServer, relay_dsn: str, kafka: TansuBroker
) -> None:
    """The Dockerfile's RUN steps, in the same order, in clean virtualenvs.

    Only the files .dockerignore admits go into the build context, and the installed
    relay runs from a directory with no source tree, so it cannot import the checkout.
    """
    context = tmp_path / "context"
    context.mkdir()
    for name in ("pyproject.toml", "README.md", "requirements.lock", "requirements-build.lock"):
        shutil.copy2(REPO / name, context / name)
    for name in ("relay", "migrations"):
        shutil.copytree(REPO / name, context / name, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"

    # Stage "build".
    build = tmp_path / "build-venv"
    subprocess.run([_base_python(), "-m", "venv", str(build)], check=True, timeout=120)
    build_py = build / "bin" / "python"
    _pip(build_py, "install", "--require-hashes", "--only-binary=:all:", "-r",
         "requirements-build.lock", cwd=context)  # fmt: skip
    _pip(build_py, "download", "--require-hashes", "--only-binary=:all:", "--no-deps",
         "--dest", str(wheels), "-r", "requirements.lock", cwd=context)  # fmt: skip
    _pip(build_py, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels), ".",
         cwd=context)  # fmt: skip

    # Stage "runtime".
    runtime = tmp_path / "opt-relay"
    subprocess.run([_base_python(), "-m", "venv", str(runtime)], check=True, timeout=120)
    runtime_py = runtime / "bin" / "python"
    _pip(runtime_py, "install", "--no-index", "--find-links", str(wheels), "--require-hashes",
         "-r", str(context / "requirements.lock"), cwd=tmp_path)  # fmt: skip
    (relay_wheel,) = wheels.glob("pg_outbox_relay-*.whl")
    _pip(runtime_py, "install", "--no-index", "--no-deps", str(relay_wheel), cwd=tmp_path)
    _pip(runtime_py, "check", cwd=tmp_path)

    relay = str(runtime / "bin" / "relay")
    workdir = tmp_path / "run"
    workdir.mkdir()

    def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [relay, *args], cwd=workdir, env=env, capture_output=True, text=True, timeout=60,
            check=False,
        )  # fmt: skip

    def image_env(dsn: str) -> dict[str, str]:
        env = relay_env(dsn, kafka.bootstrap_servers)
        env.pop("PYTHONPATH")
        return env

    helped = run("--help", env=image_env(relay_dsn))
    assert helped.returncode == 0, helped.stderr
    assert "migrate" in helped.stdout and "check" in helped.stdout
    where = subprocess.run(
        [str(runtime_py), "-c", "import relay; print(relay.__file__)"],
        cwd=workdir, env=image_env(relay_dsn), capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert where.stdout.startswith(str(runtime)), where.stdout

    # The migrations travel inside the wheel: migrate an empty database from it.
    name = f"t_{uuid.uuid4().hex[:12]}"
    empty_db = pg.create_database(name)
    try:
        migrated = run("migrate", env=image_env(empty_db))
        assert migrated.returncode == 0, migrated.stderr
        assert "0100_schema.sql" in migrated.stdout
    finally:
        pg.drop_database(name)

    # `relay check` as the least-privilege role, against the test database and broker.
    checked = run("check", env=image_env(relay_dsn))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "database: ok" in checked.stdout and "kafka: ok" in checked.stdout


# --- alert rules and dashboard ---


def _promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool not found: ./dev test installs Debian's prometheus package"
    return found


def test_alert_rules_pass_promtool_check() -> None:
    done = _run(_promtool(), "check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr


def test_alert_rules_pass_their_unit_tests() -> None:
    done = _run(_promtool(), "test", "rules", str(RULE_TESTS), cwd=MONITORING)
    assert done.returncode == 0, done.stdout + done.stderr


def _alert_rules() -> list[dict[str, Any]]:
    return [rule for group in _load(RULES)["groups"] for rule in group["rules"] if "alert" in rule]


def test_prometheus_operator_rule_is_the_alert_rules_file() -> None:
    (rule,) = _load_all(K8S / "prometheus-operator" / "prometheusrule.yaml")
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == _load(RULES)["groups"], (
        "prometheusrule.yaml must carry relay-alerts.yml's groups unchanged"
    )


def test_every_alert_has_a_summary_description_and_a_runbook() -> None:
    readme = (DEPLOY / "README.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in readme.splitlines()
        if line.startswith("#")
    }
    names = set()
    for rule in _alert_rules():
        names.add(rule["alert"])
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning"}
        path, anchor = annotations["runbook_url"].split("#")
        assert path == "deploy/README.md"
        assert anchor in anchors, f"{rule['alert']}: no section #{anchor} in deploy/README.md"
    assert {
        "RelayNoLeaseHolder",
        "RelayMultipleLeaseHolders",
        "RelayOutboxLagHigh",
        "RelayDeadLettersIncreasing",
        "RelayDown",
    } <= names
    tested = {
        case["alertname"]
        for test in _load(RULE_TESTS)["tests"]
        for case in test.get("alert_rule_test", [])
    }
    assert tested == names, f"alerts without a unit test: {sorted(names - tested)}"


def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return dashboard


def _dashboard_queries() -> list[str]:
    """Every PromQL expression in the dashboard: panel targets and variable queries."""
    exprs = []
    for panel in _dashboard()["panels"]:
        exprs += [t["expr"] for t in panel.get("targets", [])]
        for inner in panel.get("panels", []):
            exprs += [t["expr"] for t in inner.get("targets", [])]
    for variable in _dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            match = re.fullmatch(r"label_values\((.+),\s*\w+\)", text)
            assert match, f"unsupported variable query {text!r}"
            exprs.append(match[1])
    return exprs


def test_dashboard_parses_and_shows_what_an_operator_needs() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    text = " ".join(_dashboard_queries())
    for needed in (
        "relay_lease_held",
        "relay_lease_epoch",
        "relay_outbox_oldest_unsent_age_seconds",
        "relay_messages_total",
        "relay_dead_lettered_total",
        "histogram_quantile",
        "relay_shards_held",
        "relay_outbox_shard_oldest_unsent_age_seconds",
        "relay_outbox_shard_unsent_rows",
    ):
        assert needed in text, needed


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each dashboard query, Grafana's variables filled in."""
    rules = [
        {"record": f"dashboard:query:{i}", "expr": expr.replace("$__rate_interval", "1m")}
        for i, expr in enumerate(_dashboard_queries())
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = _run(_promtool(), "check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


_PROMQL_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_PROMQL_MATCHERS = re.compile(r"\{[^{}]*\}")
_PROMQL_RANGES = re.compile(r"\[[^\[\]]*\]")
_PROMQL_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_PROMQL_IDENT = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?")
_PROMQL_KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan", "start", "end",
}  # fmt: skip


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (not functions, labels or keywords)."""
    text = _PROMQL_STRING.sub('""', expr)
    text = _PROMQL_MATCHERS.sub(" ", text)
    text = _PROMQL_RANGES.sub(" ", text)
    text = _PROMQL_GROUPING.sub(" ", text)
    names = set()
    for match in _PROMQL_IDENT.finditer(text):
        if match[2] is None and match[1].lower() not in _PROMQL_KEYWORDS:
            names.add(match[1])
    return names


def test_promql_metric_names_finds_metrics_only() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, sink) (rate(relay_x_bucket{job="a", le!="1"}'
        '[$__rate_interval]))) > 1e3 or on (job) absent(up{job="relay"}) '
        "- max(relay_y offset 15m) and bool relay_z"
    )
    assert promql_metric_names(expr) == {"relay_x_bucket", "up", "relay_y", "relay_z"}


_TYPE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "gauge": ("",),
    "unknown": ("",),
    "untyped": ("",),
}


def exported_series_names(exposition: str) -> set[str]:
    """Series names a scrape of this text yields, including ones with no samples yet
    (a labelled histogram nobody observed still declares its family and type)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + suffix for suffix in _TYPE_SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def _get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback only
            return str(response.read().decode())
    except (urllib.error.URLError, ConnectionError):
        return ""  # not listening yet


@pytest.fixture(scope="module")
def relay_metrics_port(
    tmp_path_factory: pytest.TempPathFactory, pg: PostgresServer, kafka: TansuBroker
) -> Iterator[int]:
    """A real `relay run` that holds its lease and has published; yields its metrics port."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    dsn = pg.create_database(name, template="relay_template")
    topic = f"deploy-{uuid.uuid4().hex[:8]}"
    kafka.create_topic(topic, partitions=1)
    port = free_port()
    env = relay_env(
        dsn,
        kafka.bootstrap_servers,
        RELAY_METRICS_PORT=str(port),
        RELAY_LEASE_NAME="deploy",
        RELAY_LEASE_TTL_SECONDS="3",
    )
    process = start_relay(env, tmp_path_factory.mktemp("scrape") / "relay.log")
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        wait_until(lambda: 'relay_lease_held{lease="deploy"} 1.0' in _get(url), timeout=20)
        insert_rows(dsn, topic, keyed_rows(keys=2, per_key=2))
        wait_until(lambda: scalar(dsn, "SELECT count(*) FROM outbox") == 0, timeout=20)
        yield port
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        pg.drop_database(name)


@pytest.fixture(scope="module")
def scraped_metric_names(relay_metrics_port: int) -> set[str]:
    return exported_series_names(_get(f"http://127.0.0.1:{relay_metrics_port}/metrics"))


def test_the_image_healthcheck_passes_on_a_live_relay_only(relay_metrics_port: int) -> None:
    match = re.search(r"^\s+CMD (\[.*\])$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, "HEALTHCHECK ... CMD [exec form] expected"
    argv = json.loads(match[1])
    assert argv[0] == "relay"  # the image's console script
    argv[:1] = [sys.executable, "-m", "relay"]

    def healthcheck(port: int) -> int:
        # The container's environment: valid settings, nothing the probe connects to.
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        env["RELAY_DATABASE_URL"] = "postgresql://relay@127.0.0.1:9/relay"
        env["RELAY_KAFKA_BOOTSTRAP_SERVERS"] = "127.0.0.1:9"
        env["RELAY_METRICS_PORT"] = str(port)
        done = subprocess.run(argv, env=env, capture_output=True, timeout=10, check=False)
        return done.returncode

    assert healthcheck(relay_metrics_port) == 0
    assert healthcheck(free_port()) != 0


def test_scrape_parsing_covers_histograms_and_counters(scraped_metric_names: set[str]) -> None:
    for name in (
        "relay_lease_held",
        "relay_lease_epoch",
        "relay_messages_total",
        "relay_end_to_end_latency_seconds_bucket",
        "relay_publish_duration_seconds_count",
        "relay_fetch_duration_seconds_count",
        "relay_read_wait_seconds_total",
        "relay_build_info",
    ):
        assert name in scraped_metric_names
    assert "relay_messages" not in scraped_metric_names  # a counter's family is no series


def sink_metric_names() -> set[str]:
    """The series every sink module defines (the scraped relay runs one sink only)."""
    import importlib

    from prometheus_client import REGISTRY, generate_latest

    from relay.sinks import sink_specs

    for spec in sink_specs().values():
        importlib.import_module(spec.implementation.partition(":")[0])
    names = exported_series_names(generate_latest(REGISTRY).decode())
    return {name for name in names if name.startswith("relay_")}


def shard_metric_names() -> set[str]:
    """The per-shard lag series, which only a sharded relay exports (the scraped relay
    runs one shard): one in-process sample's worth, then reset."""
    from prometheus_client import REGISTRY, generate_latest

    from relay.observe import lag

    lag.SHARD_LAG.set("x", [lag.ShardLag(0, 2, 0, 0.0, 1)])
    try:
        names = exported_series_names(generate_latest(REGISTRY).decode())
    finally:
        lag.SHARD_LAG.set("", [])
    return {name for name in names if name.startswith("relay_outbox_shard_")}


@pytest.mark.parametrize("source", ["alert rules", "dashboard"])
def test_every_queried_metric_is_one_the_relay_exports(
    source: str, scraped_metric_names: set[str]
) -> None:
    if source == "alert rules":
        exprs = [rule["expr"] for rule in _alert_rules()]
    else:
        exprs = _dashboard_queries()
    queried = set().union(*(promql_metric_names(e) for e in exprs))
    assert queried, source
    known = scraped_metric_names | PROMETHEUS_SERIES | sink_metric_names()
    known |= shard_metric_names()
    unknown = sorted(queried - known)
    assert not unknown, f"{source} query metrics the relay does not export: {unknown}"
