"""Triton kernels for the worker's GPU path, each beside a plain torch reference.

Installed, this folder is `radixmesh.kernels`. Run from the repository's root, Python also
finds it as `kernels`, the name of a PyPI package that transformers imports when it is
installed: imported under that name, this module hands the name over to that package, so
that `python -m pytest` and `python -c "import transformers"` work from the root.
"""

from __future__ import annotations

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # what `import kernels` returns
        _spec.loader.exec_module(_module)
