"""The wheel's packages, found in the tree: every folder under the four source roots (the
native kernels' sources included), installed under `radixmesh`. A new package needs no list
to be written."""

from setuptools import find_namespace_packages, setup

# Where each installed root's sources live.
ROOTS = {
    "radixmesh": "radixmesh",
    "radixmesh.proto": "proto",
    "radixmesh.kernels": "kernels",
    "radixmesh.services": "services",
}


def packages() -> list[str]:
    found = []
    for root, folder in ROOTS.items():
        found.append(root)
        subs = find_namespace_packages(folder, exclude=["__pycache__", "*.__pycache__"])
        found.extend(f"{root}.{sub}" for sub in subs)
    return found


setup(package_dir=ROOTS, packages=packages())
