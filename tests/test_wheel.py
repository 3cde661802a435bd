"""What a non-editable install gets: the wheel built from the sources (as `pip install .` and
the Dockerfile build it), installed into a fresh virtual environment, holds every module of the
tree, the native kernels' and the wire contracts' sources, and the `radixmesh` command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from test_imports import MODULES, PACKAGE_DIRS, ROOT

# Imports every module it is given and prints where each came from.
IMPORT_ALL = """
import importlib, json, sys
print(json.dumps({name: importlib.import_module(name).__file__ for name in sys.argv[1:]}))
"""


def _build_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(folder, source / folder.name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(dist), str(source)], check=True)
    (wheel,) = dist.glob("radixmesh-*.whl")
    return wheel


def _fresh_env(tmp_path: Path, wheel: Path) -> tuple[Path, Path]:
    """A virtual environment with the wheel installed; the dependencies come from this
    environment's site-packages, after the wheel's own (and without its editable install)."""
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True)
    return env, site


def test_the_wheel_holds_every_module_of_the_tree(tmp_path):
    env, site = _fresh_env(tmp_path, _build_wheel(tmp_path))
    names = sorted(name for name in MODULES if not name.endswith(".__main__"))
    run = subprocess.run([str(env / "bin" / "python"), "-c", IMPORT_ALL, *names],
                         cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    files = json.loads(run.stdout.splitlines()[-1])
    assert sorted(files) == names
    outside = {name: file for name, file in files.items() if not file.startswith(str(site))}
    assert not outside, f"imported from outside the installed wheel: {outside}"
    package = site / "radixmesh"
    sources = sorted(p.name for p in (PACKAGE_DIRS["radixmesh.kernels"] / "cpu").iterdir()
                     if p.suffix in (".cpp", ".h"))
    assert sorted(p.name for p in (package / "kernels" / "cpu").iterdir()) == sources
    contracts = sorted(p.name for p in PACKAGE_DIRS["radixmesh.proto"].glob("*.proto"))
    assert sorted(p.name for p in (package / "proto").glob("*.proto")) == contracts
    command = subprocess.run([str(env / "bin" / "radixmesh"), "--help"], cwd=tmp_path,
                             capture_output=True, text=True)
    assert command.returncode == 0, command.stderr
    assert "up" in command.stdout
