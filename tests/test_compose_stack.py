"""The whole stack under Docker, as a user runs it where no registry is reachable: the image
built offline (docker/offline-image.sh: a debootstrap base image and a wheelhouse), then
`docker compose up` with compose.offline.yaml (NATS and a trace receiver from the project's
own image), two of every scalable service, and the host KV tier on (both engines' workers
map their segments from the one cachectl's shared memory). A chat completion through each
published tokenizer port with the openai client, requests landing on both engines and
backed up to their host tiers, one trace per request with spans from every service; then
the same stack turned into a prefill and a decode engine (`--profile pd`), a request
passing its KV between their worker containers; and `docker compose down` leaving nothing
behind.

Docker: a running daemon is used as it is; otherwise, as root, the test starts dockerd
itself (overlay2, or vfs where overlay2 does not mount), installing Debian's docker.io and
debootstrap first where they are missing, and stops it afterwards. Images and layers stay
in Docker's store, so a second run rebuilds only what changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import compose
import httpx
import pytest
from openai import OpenAI

ROOT = Path(__file__).resolve().parent.parent
BINARY = Path(compose.__file__).parent / "docker-compose"
PROJECT = "radixmesh-citest"
SCALED = ("tokenizer", "detokenizer", "scheduler", "worker")
MESH = {"tokenizer", "scheduler", "worker", "detokenizer"}


def run(*cmd: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          check=False, env={k: v for k, v in os.environ.items()
                                            if not k.startswith("COMPOSE_")})
    if check:
        assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done


HOST_TIER_ON = ROOT / ".pytest_cache" / "compose.host-tier.yaml"


# Containers that share a named volume race to copy the image's files into it when it is new
# (the daemon's race, moby/moby#43068): one of them fails with this. The same `up` again
# finds the volume filled and creates the rest.
VOLUME_RACE = "failed to mkdir /var/lib/docker/volumes/"


def compose_cmd(*args: str, timeout: float = 600, check: bool = True
                ) -> subprocess.CompletedProcess[str]:
    files = ("compose.yaml", "compose.offline.yaml", str(HOST_TIER_ON))
    cmd = (str(BINARY), "-p", PROJECT, *(a for f in files for a in ("-f", f)), *args)
    done = run(*cmd, timeout=timeout, check=False)
    if "up" in args and done.returncode and VOLUME_RACE in done.stdout + done.stderr:
        done = run(*cmd, timeout=timeout, check=False)
    if check:
        assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done


def daemon_up() -> bool:
    return shutil.which("docker") is not None and run("docker", "info", check=False,
                                                      timeout=30).returncode == 0


def start_dockerd(log: Path) -> subprocess.Popen[bytes]:
    """dockerd as this machine allows it: no iptables, no default bridge (compose makes its
    own network); overlay2, else vfs."""
    if os.geteuid() != 0:
        pytest.fail("no Docker daemon is running, and starting one needs root")
    if shutil.which("dockerd") is None or shutil.which("debootstrap") is None:
        run("apt-get", "update", "-q", timeout=600)
        run("apt-get", "install", "-y", "-q", "docker.io", "debootstrap", timeout=900)
    for driver in ("overlay2", "vfs"):
        proc = subprocess.Popen(
            ["dockerd", "--storage-driver", driver, "--iptables=false", "--ip-masq=false",
             "--bridge=none"], stdout=log.open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while proc.poll() is None and not daemon_up() and time.monotonic() < deadline:
            time.sleep(0.5)
        if daemon_up():  # a driver this kernel cannot mount stops dockerd at once
            return proc
        proc.terminate()
        proc.wait(30)
    pytest.fail(f"dockerd did not start; see {log}")


@pytest.fixture(scope="module")
def docker(tmp_path_factory) -> Iterator[None]:
    if daemon_up():
        yield
        return
    proc = start_dockerd(tmp_path_factory.mktemp("dockerd") / "dockerd.log")
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def stack(docker) -> Iterator[None]:
    HOST_TIER_ON.parent.mkdir(exist_ok=True)
    HOST_TIER_ON.write_text("services:\n  scheduler:\n    environment:\n"
                            '      RADIXMESH_ENABLE_HIERARCHICAL_CACHE: "true"\n')
    run("bash", "docker/offline-image.sh", timeout=1800)
    # An earlier run's, the pd profile's services included.
    compose_cmd("--profile", "pd", "down", "--volumes", "--remove-orphans", check=False)
    scale = [arg for name in SCALED for arg in ("--scale", f"{name}=2")]
    try:
        compose_cmd("up", "--detach", "--wait", *scale, timeout=900)
    except AssertionError:
        print(compose_cmd("logs", "--tail", "40", check=False).stdout)
        raise
    yield
    down = compose_cmd("--profile", "pd", "down", "--volumes", "--timeout", "30", timeout=300,
                       check=False)
    left = run("docker", "ps", "--all", "--quiet", "--filter",
               f"label=com.docker.compose.project={PROJECT}").stdout.split()
    assert down.returncode == 0 and not left, down.stderr


def tokenizer_urls() -> list[str]:
    urls = []
    for index in (1, 2):
        published = compose_cmd("port", "--index", str(index), "tokenizer", "30000").stdout
        urls.append(f"http://127.0.0.1:{published.strip().rpartition(':')[2]}")
    return urls


def test_the_scaled_stack_serves_traces_and_stops(stack):
    urls = tokenizer_urls()
    assert len(set(urls)) == 2

    # A chat completion through each tokenizer replica, with the openai client.
    for url in urls:
        client = OpenAI(base_url=url + "/v1", api_key="none")
        chat = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "Name a color."}],
            extra_body={"ignore_eos": True})
        assert chat.usage is not None and chat.usage.completion_tokens == 8
        assert chat.choices[0].message.content

    # Two engines (each scheduler claimed a worker of its own), both serving.
    info = httpx.get(urls[0] + "/server_info", timeout=10).json()
    assert len(info["engines"]) == 2, info["engines"]
    rids = []
    body = {"sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}
    for i in range(8):
        reply = httpx.post(urls[i % 2] + "/generate", timeout=120,
                           json={"text": f"Note {i}: {'river ' * (16 * i)}", **body}).json()
        assert reply["meta_info"]["completion_tokens"] == 4
        rids.append(reply["meta_info"]["id"])
    states = httpx.get(urls[0] + "/server_info", timeout=10).json()["internal_states"]
    assert len(states) == 2 and all(s["steps"] > 0 for s in states), states
    assert all(s["held_slots"] == 0 for s in states)
    assert all(s["host_slots"] > 0 and s["host_cached_tokens"] > 0 for s in states), states

    # One trace per request in the receiver, with spans from every mesh service.
    deadline = time.monotonic() + 60
    while True:
        listing = compose_cmd("exec", "-T", "jaeger", "radixmesh", "trace", "--file",
                              "spans.jsonl", "--last", "1000", check=False).stdout
        traced = {}
        for line in listing.splitlines():
            fields = line.split()
            traced.setdefault(fields[1], []).append(set(fields[-1].split(",")))
        if all(r in traced and traced[r][0] >= MESH for r in rids):
            break
        assert time.monotonic() < deadline, json.dumps(
            {r: sorted(traced.get(r, [set()])[0]) for r in rids})
        time.sleep(2)
    assert all(len(traced[r]) == 1 for r in rids)


def test_the_pd_profile_disaggregates_the_same_stack(stack):
    """`--profile pd` with the plain engine scaled to 0: a prefill and a decode engine, each
    scheduler claiming a worker of its own role, and a request prefilled on one and decoded
    on the other, its KV passed between the two worker containers."""
    roles = ("worker-prefill", "scheduler-prefill", "worker-decode", "scheduler-decode")
    scale = [*(arg for name in roles for arg in ("--scale", f"{name}=1")),
             *(arg for name in SCALED for arg in ("--scale", f"{name}=2"))]
    try:
        # The roles join the running mesh first, then the plain engines leave: the
        # tokenizers always know an engine, and so stay healthy throughout.
        compose_cmd("--profile", "pd", "up", "--detach", "--wait", *scale, timeout=900)
        compose_cmd("--profile", "pd", "up", "--detach", "--wait", *scale,
                    "--scale", "worker=0", "--scale", "scheduler=0", timeout=900)
    except AssertionError:
        print(compose_cmd("--profile", "pd", "logs", "--tail", "40", check=False).stdout)
        raise
    url = tokenizer_urls()[0]
    deadline = time.monotonic() + 60
    while True:  # the plain engines' heartbeats fade out, the new ones' come in
        modes = sorted(s.get("disaggregation_mode", "") for s in httpx.get(
            url + "/server_info", timeout=10).json()["internal_states"])
        if modes == ["decode", "prefill"]:
            break
        assert time.monotonic() < deadline, modes
        time.sleep(1)
    body = {"text": "Name three rivers:",
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    meta = httpx.post(url + "/generate", json=body, timeout=120).json()["meta_info"]
    assert meta["completion_tokens"] == 8
    moved = meta["disaggregation"]
    assert moved["prefill_engine"] != moved["decode_engine"] and "fallback" not in moved
    assert moved["transfer_tokens"] == meta["prompt_tokens"] > 0
