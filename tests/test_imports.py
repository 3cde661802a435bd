"""The import rules that keep the engine library and the services apart, read from every
module's source.

- The engine package (`radixmesh.engine`) imports the shared core, the kernels and itself:
  no service, no transport, no protobuf, no front door. The one exception is the storage
  backends' module, a client of the stores it names (the NATS object store among them).
- A service imports the engine package, the shared core, the shared infrastructure (mesh
  helpers, tracing, protobuf, kernels) and its own folder: never another service, the
  in-process engine, the launcher or the CLI.
- Nothing under radixmesh/ imports a service: the in-process Engine and the scheduler
  service drive the same engine package.
- The shared core imports only itself: no transport, no service.
- Protobuf is imported by transport modules only: the ones listed here, each a gRPC or
  NATS edge that converts messages to the engine's and the core's types and back.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each installed package's sources live (pyproject.toml's package-dir).
PACKAGE_DIRS = {
    "radixmesh": ROOT / "radixmesh",
    "radixmesh.proto": ROOT / "proto",
    "radixmesh.kernels": ROOT / "kernels",
    "radixmesh.services": ROOT / "services",
}
ENGINE = "radixmesh.engine"
SHARED = ("radixmesh.core", "radixmesh.mesh", "radixmesh.tracing", "radixmesh.proto",
          "radixmesh.kernels", ENGINE)
TRANSPORT = ("grpc", "nats", "aiohttp", "google.protobuf", "radixmesh.proto", "radixmesh.mesh")
# Every module that may import generated protobuf code: the transport edges.
PROTOBUF_MODULES = {
    "radixmesh.proto.convert",
    "radixmesh.services.scheduler.mesh_io",
    "radixmesh.services.scheduler.server",
    "radixmesh.services.scheduler.handoffs",
    "radixmesh.services.scheduler.worker_link",
    "radixmesh.services.scheduler.publisher",
    "radixmesh.services.scheduler.cachectl_client",
    "radixmesh.services.worker.server",
    "radixmesh.services.worker.kv_stream",
    "radixmesh.services.detokenizer.server",
    "radixmesh.services.detokenizer.metrics",
    "radixmesh.services.detokenizer.step_trace",
    "radixmesh.services.cachectl.server",
    "radixmesh.services.tokenizer.client",
    "radixmesh.services.tokenizer.assembler",
    "radixmesh.services.tokenizer.flights",
    "radixmesh.services.tokenizer.membership",
    "radixmesh.services.tokenizer.grpc_api",
    "radixmesh.lang.backends",  # the frontend language's gRPC backend is a client
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            # radixmesh/ holds no proto, kernels or services folder of its own.
            if name not in found:
                found[name] = path
    return found


MODULES = _modules()


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, at any depth of its code."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


# Read at collection, before any test starts a thread: CPython 3.11's AST constructor keeps
# its recursion counter per interpreter, so a parse racing another thread's parse can fail.
IMPORTS = {module: imports_of(path) for module, path in MODULES.items()}


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_walk_sees_every_service_and_the_core():
    services = {n.split(".")[2] for n in MODULES if n.startswith("radixmesh.services.")}
    assert {"tokenizer", "scheduler", "worker", "detokenizer", "cachectl"} <= services
    assert "radixmesh.core.step" in MODULES
    assert "radixmesh.engine.loop" in MODULES
    assert "radixmesh.engine.model.runner" in MODULES


@pytest.mark.parametrize(
    "module", sorted(n for n in MODULES if n.startswith("radixmesh.services."))
)
def test_a_service_imports_only_the_shared_code_and_its_own_folder(module):
    own = ".".join(module.split(".")[:3])
    bad = sorted(
        name for name in IMPORTS[module]
        if name.startswith("radixmesh") and not _under(name, (*SHARED, own))
    )
    assert not bad, f"{module} imports {bad}"


# What an engine module may import beyond the core, the kernels and itself.
STORE_CLIENTS = {"radixmesh.engine.stores.storage": ("nats",)}


@pytest.mark.parametrize("module", sorted(n for n in MODULES if _under(n, (ENGINE,))))
def test_the_engine_imports_only_the_core_the_kernels_and_itself(module):
    allowed = STORE_CLIENTS.get(module, ())
    bad = sorted(
        name for name in IMPORTS[module]
        if (_under(name, TRANSPORT) and not _under(name, allowed)) or (
            name.startswith("radixmesh")
            and not _under(name, ("radixmesh.core", "radixmesh.kernels", ENGINE))
        )
    )
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize(
    "module", sorted(n for n in MODULES if not n.startswith("radixmesh.services"))
)
def test_nothing_outside_the_services_imports_a_service(module):
    bad = sorted(name for name in IMPORTS[module] if name.startswith("radixmesh.services"))
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", sorted(n for n in MODULES if n.startswith("radixmesh.core")))
def test_the_core_imports_no_transport_and_no_service(module):
    bad = sorted(
        name for name in IMPORTS[module]
        if _under(name, TRANSPORT) or (name.startswith("radixmesh") and
                                       not _under(name, ("radixmesh.core",)))
    )
    assert not bad, f"{module} imports {bad}"


def test_only_transport_modules_import_protobuf():
    importers = {
        module for module, names in IMPORTS.items()
        if any(name.endswith(("_pb2", "_pb2_grpc")) or "_pb2." in name
               for name in names if name.startswith("radixmesh.proto"))
    }
    assert importers == PROTOBUF_MODULES


@pytest.mark.parametrize("module", [
    "radixmesh.engine.scheduler",
    "radixmesh.engine.radix_cache",
    "radixmesh.engine.kv_allocator",
    "radixmesh.engine.eviction",
    "radixmesh.engine.schedule_policy",
    "radixmesh.engine.request",
    "radixmesh.engine.loop",
    "radixmesh.engine.model.runner",
    "radixmesh.engine.model.sampling",
    "radixmesh.engine.stores.host_pool",
])
def test_domain_logic_imports_no_transport(module):
    bad = sorted(name for name in IMPORTS[module] if _under(name, TRANSPORT))
    assert not bad, f"{module} imports {bad}"


def test_the_kernels_folder_does_not_shadow_pypi_kernels_from_the_root():
    """Started in the repository's root, Python finds the kernels folder as `kernels`, the
    name of a PyPI package transformers imports: its model classes must still load, and
    the folder stays importable as radixmesh.kernels."""
    import subprocess
    import sys

    script = (
        "import transformers, radixmesh.kernels as ours; "
        "from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeForCausalLM; "
        "import kernels; "
        "print(ours.__name__, kernels.__file__ != ours.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["radixmesh.kernels", "True"]


MAX_LINES = 500


def test_every_module_is_small_enough_to_read_at_once():
    """A hand-written module holds one concept in at most MAX_LINES lines (the generated
    protobuf modules and the kernels aside)."""
    too_long = {}
    for name, path in _modules().items():
        if name.startswith("radixmesh.kernels"):
            continue
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            too_long[name] = lines
    assert not too_long, too_long
