"""The deployment files as the tests read them, and how they follow a primad they start."""

from __future__ import annotations

import selectors
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from prima.cli import primad

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
# docker's byte units (mem_limit: 512m): binary multiples
_UNITS = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def compose() -> dict[str, Any]:
    """deploy/docker-compose.yml, parsed (its anchors and merge keys resolved)."""
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text(encoding="utf-8"))


def mem_limit_bytes(text: str | int) -> int:
    """A compose mem_limit (`1g`, `384m`, or bytes) in bytes."""
    value = str(text).strip().lower()
    if value[-1:] in _UNITS:
        return int(value[:-1]) * _UNITS[value[-1]]
    return int(value)


def ready_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """primad's ready line (its JSON), or "" if it exited or time ran out first."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not sel.select(timeout=left):
                continue
            line = proc.stdout.readline()
            if not line:
                return ""
            if line.startswith(primad.READY_PREFIX):
                return line[len(primad.READY_PREFIX) :]
    return ""
