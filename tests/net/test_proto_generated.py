"""The committed prima/net/proto/ must be exactly what protos/generate.py makes from the .proto,
and the package must ask for the protobuf and grpcio runtimes that code checks for on import."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
PROTO_OUT = ROOT / "prima" / "net" / "proto"

# The tool versions protoc and the grpc plugin stamp into their output: they change with each
# grpcio-tools release while the code made from the .proto stays the same.
_GRPC_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.M)
_PROTOBUF_COMMENT = re.compile(r"^# Protobuf Python Version: ([0-9.]+)$", re.M)
_PROTOBUF_STAMP = re.compile(
    r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),"
)


def _without_stamps(text: str) -> str:
    text = _GRPC_STAMP.sub("GRPC_GENERATED_VERSION = ...", text)
    text = _PROTOBUF_COMMENT.sub("# Protobuf Python Version: ...", text)
    return _PROTOBUF_STAMP.sub("ValidateProtobufRuntimeVersion(...,", text)


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
        assert _without_stamps(committed[name]) == _without_stamps(text), (
            f"{name} is stale: run `python protos/generate.py` and commit it"
        )


def _lower_bound(requirements: list[str], name: str) -> Version:
    for line in requirements:
        req = Requirement(line)
        if req.name == name:
            bounds = [Version(s.version) for s in req.specifier if s.operator == ">="]
            assert bounds, f"pyproject.toml gives {name} no lower bound"
            return max(bounds)
    raise AssertionError(f"pyproject.toml does not require {name}")


def test_pyproject_asks_for_the_runtimes_the_generated_code_checks() -> None:
    """The generated modules refuse to import under a protobuf or grpcio older than the tools
    that made them: pyproject.toml must not promise the package works with older ones."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    deps = project["dependencies"]
    grpc_stamp = _GRPC_STAMP.search((PROTO_OUT / "prima_pb2_grpc.py").read_text(encoding="utf-8"))
    protobuf_stamp = _PROTOBUF_STAMP.search((PROTO_OUT / "prima_pb2.py").read_text(encoding="utf-8"))
    assert grpc_stamp
    assert protobuf_stamp
    assert _lower_bound(deps, "grpcio") >= Version(grpc_stamp.group(1))
    assert _lower_bound(deps, "protobuf") >= Version(".".join(protobuf_stamp.groups()))
