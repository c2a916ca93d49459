"""The Kubernetes deployment (deploy/k8s/), checked as far as it can be without a cluster.

- values.yaml uses only keys the official Dagster Helm chart reads, at the paths it reads
  them, and wires what the code location needs. The key sets below are written down from
  the chart's pydantic schema, which generates its values.schema.json (dagster-io/dagster,
  ``helm/dagster/schema/schema/charts/``: ``dagster/values.py`` for the top level,
  ``dagster/subschema/{postgresql,run_launcher,daemon,global_}.py``,
  ``dagster_user_deployments/subschema/user_deployments.py``) and, for ``runMonitoring``
  (a free-form dict in the schema), from the keys ``templates/configmap-instance.yaml``
  reads. The schema forbids unknown keys in the run launcher and run coordinator blocks:
  a misspelled key there fails ``helm install``; elsewhere it would be silently ignored.
- The code location loads with the pod's environment: ``dagster definitions validate`` on
  the module the chart's ``dagsterApiGrpcArgs`` name, with the env and the example secrets.
- The Dockerfile's install step, run as written in a fresh venv (slow: it installs Dagster).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from resources import ArchiveResource

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "k8s"

CHART_TOP = {
    "dagsterWebserver", "dagster-user-deployments", "postgresql", "generatePostgresqlPasswordSecret",
    "generateCeleryConfigSecret", "rabbitmq", "redis", "flower", "ingress", "imagePullSecrets",
    "computeLogManager", "scheduler", "runLauncher", "pythonLogs", "dagsterDaemon", "busybox", "migrate",
    "telemetry", "serviceAccount", "global", "retention", "additionalInstanceConfig",
}  # fmt: skip
GLOBAL = {"postgresqlSecretName", "dagsterHome", "serviceAccountName", "celeryConfigSecretName"}
POSTGRESQL = {
    "image", "enabled", "postgresqlHost", "postgresqlUsername", "postgresqlPassword", "postgresqlDatabase",
    "postgresqlParams", "postgresqlScheme", "service",
}  # fmt: skip
USER_DEPLOYMENTS = {"enabled", "enableSubchart", "imagePullSecrets", "deployments"}
USER_DEPLOYMENT = {
    "name", "image", "dagsterApiGrpcArgs", "codeServerArgs", "includeConfigInLaunchedRuns", "port", "env",
    "envConfigMaps", "envSecrets", "annotations", "nodeSelector", "affinity", "tolerations",
    "podSecurityContext", "securityContext", "resources", "livenessProbe", "readinessProbe", "startupProbe",
    "labels", "volumeMounts", "volumes", "schedulerName",
}  # fmt: skip
IMAGE = {"repository", "tag", "pullPolicy"}
RUN_LAUNCHER = {"type", "config"}
K8S_RUN_LAUNCHER = {
    "image", "imagePullPolicy", "jobNamespace", "loadInclusterConfig", "kubeconfigFile", "envConfigMaps",
    "envSecrets", "envVars", "volumeMounts", "volumes", "labels", "failPodOnRunFailure", "resources",
    "schedulerName", "securityContext", "runK8sConfig",
}  # fmt: skip
RUN_K8S_CONFIG = {"containerConfig", "podSpecConfig", "podTemplateSpecMetadata", "jobSpecConfig", "jobMetadata"}
DAEMON = {
    "enabled", "image", "runCoordinator", "heartbeatTolerance", "env", "envConfigMaps", "envSecrets",
    "deploymentLabels", "labels", "nodeSelector", "affinity", "tolerations", "podSecurityContext",
    "securityContext", "resources", "livenessProbe", "readinessProbe", "startupProbe", "annotations",
    "runMonitoring", "runRetries", "sensors", "schedules", "schedulerName", "volumeMounts", "volumes",
}  # fmt: skip
RUN_COORDINATOR = {"enabled", "type", "config"}
QUEUED = {
    "maxConcurrentRuns",
    "tagConcurrencyLimits",
    "dequeueIntervalSeconds",
    "dequeueNumWorkers",
    "dequeueUseThreads",
}
TAG_LIMIT = {"key", "value", "limit"}
RUN_MONITORING = {
    "enabled", "startTimeoutSeconds", "cancelTimeoutSeconds", "maxResumeRunAttempts", "pollIntervalSeconds",
    "freeSlotsAfterRunEndSeconds",
}  # fmt: skip


def values() -> dict:
    return yaml.safe_load((DEPLOY / "values.yaml").read_text())


def secrets() -> dict[str, dict]:
    docs = yaml.safe_load_all((DEPLOY / "secrets.example.yaml").read_text())
    return {d["metadata"]["name"]: d["stringData"] for d in docs if d and d["kind"] == "Secret"}


def unknown(block: dict, allowed: set[str]) -> set[str]:
    return set(block) - allowed


def test_values_use_only_keys_the_chart_reads():
    v = values()
    assert not unknown(v, CHART_TOP)
    assert not unknown(v["global"], GLOBAL)
    assert not unknown(v["postgresql"], POSTGRESQL)
    users = v["dagster-user-deployments"]
    assert not unknown(users, USER_DEPLOYMENTS)
    for d in users["deployments"]:
        assert not unknown(d, USER_DEPLOYMENT) and not unknown(d["image"], IMAGE)
    assert not unknown(v["runLauncher"], RUN_LAUNCHER)
    k8s = v["runLauncher"]["config"]["k8sRunLauncher"]
    assert not unknown(k8s, K8S_RUN_LAUNCHER) and not unknown(k8s.get("runK8sConfig", {}), RUN_K8S_CONFIG)
    daemon = v["dagsterDaemon"]
    assert not unknown(daemon, DAEMON) and not unknown(daemon["runCoordinator"], RUN_COORDINATOR)
    queued = daemon["runCoordinator"]["config"]["queuedRunCoordinator"]
    assert not unknown(queued, QUEUED) and all(not unknown(t, TAG_LIMIT) for t in queued["tagConcurrencyLimits"])
    assert not unknown(daemon["runMonitoring"], RUN_MONITORING)


def test_values_wire_the_code_location_secrets_and_queue():
    v, named = values(), secrets()
    [d] = v["dagster-user-deployments"]["deployments"]
    assert v["dagster-user-deployments"]["enabled"] and d["includeConfigInLaunchedRuns"]["enabled"]
    assert isinstance(d["port"], int) and d["image"]["repository"] and str(d["image"]["tag"]) != "latest"
    assert d["dagsterApiGrpcArgs"] == ["-m", "pipelines.definitions"]
    env = d["env"]
    assert env["CKPTFLOW_DEPLOYMENT"] == "production"
    assert env["CKPTFLOW_STORE"].startswith("s3://") and env["CKPTFLOW_ARCHIVE"].startswith("s3://")
    for ref in d["envSecrets"]:
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"} <= set(named[ref["name"]])
    # the policy files: the ConfigMap of policy.yaml, mounted where the env says they are
    [volume] = d["volumes"]
    [mount] = d["volumeMounts"]
    assert mount["name"] == volume["name"] and mount["readOnly"] is True
    files = config_maps()[volume["configMap"]["name"]]
    for var in ("CKPTFLOW_RETENTION", "CKPTFLOW_PRICES"):
        folder, _, name = env[var].rpartition("/")
        assert folder == mount["mountPath"] and name in files, var
    # runs go to Kubernetes Jobs; the chart-made PostgreSQL and password secret are off
    assert v["runLauncher"]["type"] == "K8sRunLauncher"
    assert isinstance(v["runLauncher"]["config"]["k8sRunLauncher"]["loadInclusterConfig"], bool)
    assert v["generatePostgresqlPasswordSecret"] is False and v["postgresql"]["enabled"] is False
    assert v["postgresql"]["postgresqlHost"] and "postgresql-password" in named[v["global"]["postgresqlSecretName"]]
    # the same PostgreSQL driver, queue and run monitoring as the instance the daemon tests run on
    production = yaml.safe_load((REPO / "pipelines" / "instance" / "production.yaml").read_text())
    assert v["postgresql"]["postgresqlScheme"] == production["storage"]["postgres"]["postgres_db"]["scheme"]
    queued = v["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]
    want = production["run_coordinator"]["config"]
    assert queued["maxConcurrentRuns"] == want["max_concurrent_runs"]
    assert queued["tagConcurrencyLimits"] == want["tag_concurrency_limits"]
    monitoring = v["dagsterDaemon"]["runMonitoring"]
    assert (
        monitoring["enabled"]
        and monitoring["startTimeoutSeconds"] == production["run_monitoring"]["start_timeout_seconds"]
    )


def config_maps() -> dict[str, dict[str, str]]:
    docs = yaml.safe_load_all((DEPLOY / "policy.yaml").read_text())
    return {d["metadata"]["name"]: d["data"] for d in docs if d and d["kind"] == "ConfigMap"}


def pod_env(tmp_path: Path) -> dict[str, str]:
    """What the code server's container holds: the deployment's env and its secrets
    (the example's placeholder credentials: loading the definitions reads no S3 object),
    and its ConfigMap volumes, written under ``tmp_path`` with the env's paths into them
    pointed there."""
    [d] = values()["dagster-user-deployments"]["deployments"]
    env = {k: str(v) for k, v in d["env"].items()}
    for ref in d["envSecrets"]:
        env.update(secrets()[ref["name"]])
    volumes = {v["name"]: v for v in d.get("volumes", [])}
    for mount in d.get("volumeMounts", []):
        local = tmp_path / mount["name"]
        local.mkdir(exist_ok=True)
        for key, text in config_maps()[volumes[mount["name"]]["configMap"]["name"]].items():
            (local / key).write_text(text)
        inside = mount["mountPath"].rstrip("/") + "/"
        env = {k: str(local / v[len(inside) :]) if v.startswith(inside) else v for k, v in env.items()}
    return env


def validate(python_bin: Path, cwd: Path, tmp_path: Path, pythonpath: str) -> subprocess.CompletedProcess:
    [d] = values()["dagster-user-deployments"]["deployments"]
    home = tmp_path / "dagster_home"
    home.mkdir(exist_ok=True)
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTFLOW_", "AWS_"))}
    env = {**keep, **pod_env(tmp_path), "DAGSTER_HOME": str(home), "PYTHONPATH": pythonpath}
    return subprocess.run(
        [str(python_bin / "dagster"), "definitions", "validate", *d["dagsterApiGrpcArgs"]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_production_definitions_validate_with_the_pods_environment(tmp_path):
    out = validate(Path(sys.executable).parent, REPO, tmp_path, str(REPO))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Validation successful for code location pipelines.definitions" in out.stdout + out.stderr


def dockerfile() -> tuple[list[tuple[list[str], str]], list[str]]:
    """The Dockerfile's COPY (sources, destination) pairs and RUN commands, in order."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    copies, runs = [], []
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "COPY":
            *sources, dest = shlex.split(rest)
            copies.append((sources, dest))
        elif word == "RUN":
            runs.append(rest)
    return copies, runs


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_user_code_image_install_step_in_a_fresh_venv(tmp_path):
    """The image's WORKDIR laid out by its COPY lines, its `pip install` line run by a shell
    in a fresh venv (pip as configured on this machine: PyPI, torch's wheel from its disk),
    then the code location validated from there, and dagster-k8s importable for run pods."""
    copies, runs = dockerfile()
    workdir = tmp_path / "opt" / "ckptflow"
    for sources, dest in copies:
        target = workdir / dest
        for src in sources:  # Docker copies a directory's contents, a file into a dest ending in /
            path = REPO / src
            if path.is_dir():
                shutil.copytree(path, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target / path.name if dest.endswith("/") else target)
    [install] = [r for r in runs if r.startswith("pip install")]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": "", "TORCH_INDEX": ""}
    subprocess.run(["sh", "-c", install], cwd=workdir, env=env, check=True, timeout=1200)
    py = venv / "bin" / "python"
    check = "import dagster_k8s, dagster_postgres, dagster_aws, ckptflow; print(dagster_k8s.K8sRunLauncher.__name__)"
    out = subprocess.run([str(py), "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "K8sRunLauncher" in out.stdout, out.stderr
    out = validate(venv / "bin", workdir, tmp_path, "")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_shipped_policy_files_load_as_the_defaults_the_docs_name(tmp_path, monkeypatch):
    """policy.yaml is deployable as it is: its files load, and say what the defaults say."""
    from resources import PricingResource, RetentionResource

    env = pod_env(tmp_path)
    for var in ("CKPTFLOW_RETENTION", "CKPTFLOW_PRICES"):
        monkeypatch.setenv(var, env[var])
    assert RetentionResource.from_env() == RetentionResource()
    assert PricingResource.from_env().model(ArchiveResource(url=str(tmp_path))) == PricingResource().model(
        ArchiveResource(url=str(tmp_path))
    )
