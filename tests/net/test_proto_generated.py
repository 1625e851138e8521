"""The committed prima/net/proto/ must be exactly what protos/generate.py makes from the .proto."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_proto() -> None:
    pytest.importorskip("grpc_tools")
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "protos" / "generate.py")
    assert spec
    assert spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = module.generate()
    committed = {p.name: p.read_text(encoding="utf-8") for p in module.OUT_DIR.iterdir() if p.is_file()}
    assert set(fresh) == set(committed), "run `python protos/generate.py` and commit prima/net/proto/"
    for name, text in fresh.items():
        assert committed[name] == text, f"{name} is stale: run `python protos/generate.py` and commit it"
