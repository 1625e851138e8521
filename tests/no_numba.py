"""A Python environment in which numba and llvmlite cannot be imported, as on a device where
they do not install (Termux has no manylinux wheels): for child processes of the tests."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Imported by every interpreter that finds it on sys.path, before anything else: an import of
# either package then raises ImportError, and importlib.util.find_spec says it is absent.
_SITECUSTOMIZE = """\
import sys

for name in ("numba", "llvmlite"):
    sys.modules[name] = None
"""


def env_without_numba(directory: Path) -> dict[str, str]:
    """os.environ for a child (and its own children) that runs this checkout without numba and
    llvmlite; `directory` receives the sitecustomize module that blocks them."""
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE, encoding="utf-8")
    path = os.pathsep.join([str(directory), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}
