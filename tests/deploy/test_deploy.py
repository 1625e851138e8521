"""Deployment files stay in step with the CLIs: every compose command parses with our parsers,
and the systemd unit passes `systemd-analyze verify` where that tool exists."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from prima.cli import primad
from prima.cli.main import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _compose() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text(encoding="utf-8"))


def test_compose_commands_parse() -> None:
    services = _compose()["services"]
    assert {"node0", "node1", "node2", "coordinator"} <= set(services)
    ports = []
    for name, svc in services.items():
        argv = svc["command"]
        if argv[0] == "primad":
            args = primad.build_parser().parse_args(argv[1:])
            assert args.name == name
            primad.parse_budget(args.mem_budget)
            ports.append(args.port)
        else:
            assert argv[0] == "prima"
            args = build_parser().parse_args(argv[1:])
            assert args.nodes.split(",") == [f"127.0.0.1:{p}" for p in ports]


def test_unit_command_parses_with_env_file() -> None:
    env = dict(
        line.split("=", 1)
        for line in (DEPLOY / "primad.env").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")
    )
    unit = (DEPLOY / "primad.service").read_text(encoding="utf-8")
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    argv = exec_start.removeprefix("ExecStart=").split()
    argv = [env.get(a[2:-1], a) if a.startswith("${") else a for a in argv]
    assert argv[0].endswith("primad")
    args = primad.build_parser().parse_args(argv[1:])
    assert args.port == int(env["PRIMAD_PORT"])


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    # Verify a copy whose ExecStart binary exists here, so only the unit's syntax is judged.
    unit = (DEPLOY / "primad.service").read_text(encoding="utf-8")
    unit = unit.replace("/usr/local/bin/primad", shutil.which("true") or "/bin/true")
    unit = unit.replace("EnvironmentFile=/etc/prima/primad.env", f"EnvironmentFile=-{DEPLOY / 'primad.env'}")
    path = tmp_path / "primad.service"
    path.write_text(unit, encoding="utf-8")
    proc = subprocess.run(
        [tool, "verify", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    errors = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if "primad.service" in line and "Documentation" not in line and "User" not in line
    ]
    if proc.returncode != 0 and not errors:
        pytest.skip(f"systemd-analyze cannot run here: {proc.stderr.strip()[:200]}")
    assert not errors, "\n".join(errors)
