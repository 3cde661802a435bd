"""compose.yaml and the Dockerfile, checked with the real compose binary (no Docker engine)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import compose
import pytest

from radixmesh.core.flags import parse_config
from radixmesh.core.service_settings import CachectlConfig

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "compose.yaml"
BINARY = Path(compose.__file__).parent / "docker-compose"
MESH = ("cachectl", "worker", "scheduler", "detokenizer", "tokenizer")
SCALABLE = ("tokenizer", "detokenizer", "scheduler", "worker")
# Profile pd: prefill/decode disaggregation, each role's engines their own services.
ROLES = ("prefill", "decode")
PD = tuple(f"{service}-{role}" for role in ROLES for service in ("worker", "scheduler"))
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def render(*overrides: Path, profiles: tuple[str, ...] = ()) -> dict[str, Any]:
    """The project as the compose binary resolves it, with optional override files and
    profiles."""
    files = [arg for f in (COMPOSE_FILE, *overrides) for arg in ("-f", str(f))]
    files += [arg for profile in profiles for arg in ("--profile", profile)]
    # COMPOSE_* from the caller's shell (COMPOSE_FILE, COMPOSE_PROFILES) would change the model.
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    done = subprocess.run(
        [str(BINARY), *files, "config", "--format", "json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    """The resolved services of compose.yaml alone."""
    return render()["services"]


@pytest.fixture(scope="module")
def pd_services() -> dict[str, dict[str, Any]]:
    """The resolved services with the pd profile on."""
    return render(profiles=("pd",))["services"]


def module_of(service: dict[str, Any]) -> str:
    """The module a `python -m` service command runs."""
    command = service["command"]
    assert command[:2] == ["python", "-m"], command
    return command[2]


def host_ports(published: str) -> range:
    """Host ports of a published entry: "30000" or a range "30000-30009"."""
    low, _, high = published.partition("-")
    return range(int(low), int(high or low) + 1)


def runnable(module: str) -> bool:
    """Whether `python -m module` has something to run."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.submodule_search_locations is None:
        return spec is not None
    return importlib.util.find_spec(module + ".__main__") is not None


def test_expected_services(services):
    assert {"nats", "jaeger", *MESH} <= set(services)
    assert {name for name, s in services.items() if "build" in s} == set(MESH)


def test_mesh_services_share_one_image(services):
    builds = {json.dumps(services[name]["build"], sort_keys=True) for name in MESH}
    assert builds == {json.dumps({"args": {"BASE_IMAGE": "python:3.11-slim"},
                                  "context": str(ROOT), "dockerfile": "Dockerfile"})}
    assert len({services[name]["image"] for name in MESH}) == 1
    for name in MESH:
        assert module_of(services[name]) == f"radixmesh.services.{name}"
        assert services[name]["restart"] == "unless-stopped"


def test_service_modules_exist(services):
    modules = [module_of(services[name]) for name in MESH]
    assert [m for m in modules if not runnable(m)] == []


def test_every_service_but_jaeger_has_a_healthcheck(services):
    for name in ("nats", *MESH):
        assert services[name]["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
    assert "http://127.0.0.1:8222/healthz" in services["nats"]["healthcheck"]["test"]
    assert {"-js", "-m", "8222"} <= set(services["nats"]["command"])


def test_mesh_healthchecks_get_their_own_health_port(services):
    for name in MESH:
        env = services[name]["environment"]
        port = env["RADIXMESH_PORT"] if name == "tokenizer" else env["RADIXMESH_METRICS_PORT"]
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"], name
        assert test[-1] == f"http://127.0.0.1:{port}/health", name


def test_scalable_services_publish_only_port_ranges(services):
    for name in SCALABLE:
        assert "container_name" not in services[name]
        for port in services[name].get("ports", []):
            assert len(host_ports(port["published"])) >= 2, (name, port)
    targets = {p["target"] for p in services["tokenizer"]["ports"]}
    env = services["tokenizer"]["environment"]
    assert targets == {int(env["RADIXMESH_PORT"]), int(env["RADIXMESH_GRPC_PORT"])}


def test_no_host_port_is_published_twice(services):
    taken: list[int] = []
    for service in services.values():
        for port in service.get("ports", []):
            taken.extend(host_ports(port["published"]))
    assert len(taken) == len(set(taken))


def test_scaling_out_the_front_validates(tmp_path):
    override = tmp_path / "scale.yaml"
    override.write_text("services:\n" + "".join(f"  {n}:\n    scale: 2\n" for n in SCALABLE))
    scaled = render(override)["services"]
    assert all(scaled[name]["scale"] == 2 for name in SCALABLE)


def test_engines_find_their_workers_on_nats(services):
    """No worker address and no engine id in the file: each scheduler claims a worker that
    announced itself, and takes its container's name, so both scale without edits."""
    scheduler, worker = services["scheduler"], services["worker"]
    assert "RADIXMESH_WORKER_ADDRS" not in scheduler["environment"]
    assert "RADIXMESH_ENGINE_ID" not in scheduler["environment"]
    assert worker["environment"]["RADIXMESH_ANNOUNCE"] == "true"
    for dependency in ("nats", "worker"):
        assert scheduler["depends_on"][dependency]["condition"] == "service_healthy"
    assert worker["depends_on"]["nats"]["condition"] == "service_healthy"


def test_cachectl_shares_its_shared_memory_with_the_worker(services):
    cachectl, worker = services["cachectl"], services["worker"]
    assert cachectl["ipc"] == "shareable"
    assert int(cachectl["shm_size"]) >= 1 << 30
    assert worker["ipc"] == "service:cachectl"
    assert "shm_size" not in worker  # a joined IPC namespace has the owner's /dev/shm
    assert worker["depends_on"]["cachectl"]["condition"] == "service_started"
    assert "ports" not in cachectl  # only the engine's own scheduler talks to it


def test_cachectl_keeps_storage_pages_in_a_volume(services):
    cachectl = services["cachectl"]
    env = cachectl["environment"]
    assert env["RADIXMESH_HICACHE_STORAGE_BACKEND"] == "file"
    path = json.loads(env["RADIXMESH_HICACHE_STORAGE_BACKEND_EXTRA_CONFIG"])["path"]
    mounts = {m["target"]: m for m in cachectl["volumes"]}
    assert mounts[path]["type"] == "volume"
    assert mounts[path]["source"] == "hicache-storage"
    # The service reads these values as they are.
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        config = parse_config(CachectlConfig, [])
    assert config.hicache_storage_backend == "file"
    assert config.storage_config == {"path": path}


def test_scheduler_reaches_cachectl_with_the_host_tier_off(services):
    env = services["scheduler"]["environment"]
    cachectl_port = services["cachectl"]["environment"]["RADIXMESH_PORT"]
    assert env["RADIXMESH_CACHECTL_ADDR"] == f"cachectl:{cachectl_port}"
    assert env["RADIXMESH_ENABLE_HIERARCHICAL_CACHE"] == "false"
    assert services["scheduler"]["depends_on"]["cachectl"]["condition"] == "service_healthy"


def test_mesh_environment_reaches_nats_and_jaeger(services):
    for name in MESH:
        env = services[name]["environment"]
        nats_url = urlparse(env["NATS_URL"])
        assert (nats_url.scheme, nats_url.hostname, nats_url.port) == ("nats", "nats", 4222)
        otlp = urlparse(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert (otlp.hostname, otlp.port) == ("jaeger", 4317)
        assert env["OTEL_SERVICE_NAME"] == f"radixmesh-{name}"
        assert env["RADIXMESH_HOST"] == "0.0.0.0"
        if name != "cachectl":
            assert services[name]["depends_on"]["nats"]["condition"] == "service_healthy"
    assert 4317 in {p["target"] for p in services["jaeger"]["ports"]}
    assert services["worker"]["environment"]["RADIXMESH_DTYPE"] == "bfloat16"


def test_dockerfile_installs_cpu_torch_then_the_project():
    """From PyPI's CPU index by default, from the wheelhouse alone when it has wheels."""
    text = (ROOT / "Dockerfile").read_text()
    assert re.findall(r"^ARG BASE_IMAGE=(\S+)", text, re.MULTILINE) == ["python:3.11-slim"]
    assert set(re.findall(r"^FROM (\S+)", text, re.MULTILINE)) == {"${BASE_IMAGE}"}
    torch_lines = [line for line in text.splitlines() if "torch==" in line]
    assert len(torch_lines) == 1
    assert "torch==2.13.0" in torch_lines[0].split()
    assert f"--index-url {CPU_INDEX}" in torch_lines[0]
    assert text.index("torch==2.13.0") < text.index("pip install /src")
    assert "pip install --no-index --find-links /wheelhouse /wheelhouse/*.whl" in text
    users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert users and users[-1] not in ("root", "0")


def test_dockerignore_keeps_local_state_out():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".git", "benchmarks"} <= ignored


def test_default_profile_leaves_the_pd_services_out(services, pd_services):
    """`docker compose up` is the mesh it was; the pd profile only adds services."""
    assert not set(PD) & set(services)
    assert set(pd_services) == set(services) | set(PD)
    for name, service in services.items():
        assert pd_services[name] == service, name
    for name in PD:
        assert pd_services[name]["profiles"] == ["pd"], name


def without_role(service: dict[str, Any]) -> dict[str, Any]:
    """A service less what sets its role apart: profile, mode, trace name, dependencies."""
    env = {k: v for k, v in service["environment"].items()
           if k not in ("RADIXMESH_DISAGGREGATION_MODE", "OTEL_SERVICE_NAME")}
    rest = {k: v for k, v in service.items()
            if k not in ("profiles", "environment", "depends_on")}
    return {**rest, "environment": env}


@pytest.mark.parametrize("role", ROLES)
def test_pd_engines_are_the_plain_ones_in_a_role(pd_services, role):
    """Same image, command, volumes, health check and settings as worker and scheduler,
    with RADIXMESH_DISAGGREGATION_MODE set, so the scheduler claims only its role's
    workers; both keep to cachectl as the plain ones do."""
    worker, scheduler = pd_services[f"worker-{role}"], pd_services[f"scheduler-{role}"]
    for name, service in (("worker", worker), ("scheduler", scheduler)):
        env = service["environment"]
        assert env["RADIXMESH_DISAGGREGATION_MODE"] == role, name
        assert env["OTEL_SERVICE_NAME"] == f"radixmesh-{name}-{role}"
        assert without_role(service) == without_role(pd_services[name]), name
        assert module_of(service) == f"radixmesh.services.{name}"
    assert worker["environment"]["RADIXMESH_ANNOUNCE"] == "true"
    assert worker["ipc"] == "service:cachectl"
    assert worker["depends_on"]["cachectl"]["condition"] == "service_started"
    assert "RADIXMESH_WORKER_ADDRS" not in scheduler["environment"]
    assert "RADIXMESH_ENGINE_ID" not in scheduler["environment"]
    plain = dict(pd_services["scheduler"]["depends_on"])
    plain[f"worker-{role}"] = plain.pop("worker")
    assert scheduler["depends_on"] == plain  # its own role's workers, not the plain ones


def test_pd_engines_scale(pd_services, tmp_path):
    """The command in compose.yaml's header: each role scales on its own (no fixed name,
    no host port), and the plain engine scales to none."""
    for name in PD:
        assert "container_name" not in pd_services[name], name
        assert "ports" not in pd_services[name], name
    counts = {"worker": 0, "scheduler": 0, "worker-prefill": 1, "scheduler-prefill": 1,
              "worker-decode": 2, "scheduler-decode": 2}
    override = tmp_path / "pd-scale.yaml"
    override.write_text("services:\n" + "".join(f"  {n}:\n    scale: {c}\n"
                                                for n, c in counts.items()))
    scaled = render(override, profiles=("pd",))["services"]
    assert {name: scaled[name]["scale"] for name in counts} == counts
    header = COMPOSE_FILE.read_text().split("\nname:", 1)[0]
    command = " ".join(line.lstrip("# ").rstrip("\\ ") for line in header.splitlines())
    assert "docker compose --profile pd up " + " ".join(
        f"--scale {n}={c}" for n, c in counts.items()) in " ".join(command.split())


def test_workers_take_lora_adapters_from_the_hosts_environment(monkeypatch):
    from radixmesh.core.flags import from_environment
    from radixmesh.core.service_settings import WorkerConfig

    off = render()["services"]["worker"]["environment"]
    monkeypatch.setenv("RADIXMESH_ENABLE_LORA", "true")
    monkeypatch.setenv("RADIXMESH_LORA_PATHS", "poet=org/poet-lora")
    on = render()["services"]["worker"]["environment"]
    for env, enabled, paths in [(off, False, ()), (on, True, ("poet=org/poet-lora",))]:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        config = from_environment(WorkerConfig)
        assert (config.enable_lora, config.lora_paths, config.max_loras_per_batch) == (
            enabled, paths, 8)


def test_the_tokenizer_serves_embeddings_when_the_host_asks(monkeypatch):
    from radixmesh.core.flags import from_environment
    from radixmesh.core.service_settings import TokenizerServiceConfig

    off = render()["services"]["tokenizer"]["environment"]
    monkeypatch.setenv("RADIXMESH_IS_EMBEDDING", "true")
    on = render()["services"]["tokenizer"]["environment"]
    for env, wanted in [(off, False), (on, True)]:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert from_environment(TokenizerServiceConfig).is_embedding is wanted
