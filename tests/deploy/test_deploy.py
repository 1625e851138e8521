"""Deployment files stay in step with the CLIs: every compose command parses with our parsers,
and the systemd unit passes `systemd-analyze verify` where that tool exists."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prima.cli import primad
from prima.cli.main import build_parser
from prima.net.client import NodeClient

from .files import DEPLOY, REPO, compose, mem_limit_bytes, ready_line

# The kernel compile's peak RSS, `/usr/bin/time -v prima warmup` from an empty kernel cache on a
# 2-vCPU AMD EPYC (Zen 4, AVX-512): the limit of whatever compiles must leave room above it.
COMPILE_PEAK_BYTES = 749 << 20


def test_compose_commands_parse() -> None:
    services = compose()["services"]
    assert {"warmup", "node0", "node1", "node2", "coordinator"} <= set(services)
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
            assert args.command == {"warmup": "warmup", "coordinator": "run"}[name]
    coordinator = build_parser().parse_args(services["coordinator"]["command"][1:])
    assert coordinator.nodes == [f"127.0.0.1:{p}" for p in ports]


def test_compose_compiles_once_before_the_limited_nodes() -> None:
    """The warmup service fetches the model and compiles the kernels, alone and within a limit
    above the compile's peak; the nodes start after it has succeeded, come back when they fail,
    and find the model it fetched (the same name) instead of downloading their own."""
    services = compose()["services"]
    warmup = build_parser().parse_args(services["warmup"]["command"][1:])
    assert mem_limit_bytes(services["warmup"]["mem_limit"]) >= COMPILE_PEAK_BYTES * 5 // 4
    assert "depends_on" not in services["warmup"]
    nodes = {name: svc for name, svc in services.items() if svc["command"][0] == "primad"}
    for name, svc in nodes.items():
        assert svc["depends_on"] == {"warmup": {"condition": "service_completed_successfully"}}, name
        assert svc["restart"] == "on-failure", name
        assert primad.build_parser().parse_args(svc["command"][1:]).model == warmup.model, name
        assert svc["volumes"] == services["warmup"]["volumes"], name
    assert services["coordinator"]["depends_on"] == dict.fromkeys(nodes, {"condition": "service_healthy"})
    assert services["coordinator"]["volumes"] == services["warmup"]["volumes"]


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


def test_warmup_unit_compiles_into_the_cache_primad_reads() -> None:
    """prima-warmup.service runs `prima warmup` for primad's model, before primad.service (which
    wants it), as the same user with the same cache, under a MemoryMax above the compile's peak."""
    env = _env_file()
    warm = _unit_settings("prima-warmup.service")
    daemon = _unit_settings("primad.service")
    argv = [env.get(a[2:-1], a) if a.startswith("${") else a for a in warm["ExecStart"][0].split()]
    assert argv[0] == daemon["ExecStart"][0].split()[0].removesuffix("d")  # prima beside primad
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.model) == ("warmup", env["PRIMAD_MODEL"])
    assert warm["Type"] == ["oneshot"]
    assert mem_limit_bytes(warm["MemoryMax"][0]) >= COMPILE_PEAK_BYTES * 5 // 4
    for key in ("EnvironmentFile", "User", "Group", "CacheDirectory", "ProtectSystem", "ProtectHome"):
        assert warm[key] == daemon[key], key
    assert "XDG_CACHE_HOME=/var/cache" in warm["Environment"]
    assert "XDG_CACHE_HOME=/var/cache" in daemon["Environment"]
    order = _unit_settings("primad.service", "[Unit]")
    assert "prima-warmup.service" in order["After"][0].split()
    assert "prima-warmup.service" in order["Wants"][0].split()
    assert _unit_settings("prima-warmup.service", "[Unit]")["Before"] == ["primad.service"]


UNITS = ("primad.service", "prima-warmup.service")


def test_systemd_units_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    # Verify copies whose ExecStart binaries exist here, so only the units' syntax is judged.
    paths = []
    for name in UNITS:
        unit = (DEPLOY / name).read_text(encoding="utf-8")
        for program in ("/opt/prima/bin/primad", "/opt/prima/bin/prima"):
            unit = unit.replace(program, shutil.which("true") or "/bin/true")
        unit = unit.replace(
            "EnvironmentFile=/etc/prima/primad.env", f"EnvironmentFile=-{DEPLOY / 'primad.env'}"
        )
        path = tmp_path / name
        path.write_text(unit, encoding="utf-8")
        paths.append(str(path))
    proc = subprocess.run([tool, "verify", *paths], capture_output=True, text=True, timeout=60, check=False)
    errors = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if any(name in line for name in UNITS) and "Documentation" not in line and "User" not in line
    ]
    if proc.returncode != 0 and not errors:
        pytest.skip(f"systemd-analyze cannot run here: {proc.stderr.strip()[:200]}")
    assert not errors, "\n".join(errors)


def _unit_settings(unit: str = "primad.service", section: str = "[Service]") -> dict[str, list[str]]:
    """A unit's settings in one section, each key's values in order."""
    settings: dict[str, list[str]] = {}
    current = ""
    for line in (DEPLOY / unit).read_text(encoding="utf-8").splitlines():
        if line.startswith("["):
            current = line
        elif current == section and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def _env_file() -> dict[str, str]:
    return dict(
        line.split("=", 1)
        for line in (DEPLOY / "primad.env").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#")
    )


def _sandbox_prefix() -> list[str]:
    """unshare's arguments for a private mount namespace, or skip where there is none."""
    tool = shutil.which("unshare")
    if tool is None:
        pytest.skip("unshare is not installed")
    for prefix in (
        [tool, "--mount", "--propagation", "private"],
        [tool, "-r", "--mount", "--propagation", "private"],
    ):
        probe = subprocess.run(
            [*prefix, "sh", "-c", "mount --bind / / && mount -o remount,bind,ro / /"],
            capture_output=True,
            timeout=30,
            check=False,
        )
        if probe.returncode == 0:
            return prefix
    pytest.skip("no mount namespace here (unshare needs root or user namespaces)")


@pytest.mark.slow
def test_unit_starts_under_its_own_sandbox(smollm2_path: Path, tmp_path: Path) -> None:
    """primad as the unit runs it: the install tree and home read-only (ProtectSystem=strict,
    ProtectHome=read-only) and one writable cache directory (CacheDirectory=, XDG_CACHE_HOME)."""
    from prima import paths
    from prima.engine.warmup import ensure_compiled
    from prima.kernels import compile_cache

    service = _unit_settings()
    assert service["ProtectSystem"] == ["strict"]
    assert service["ProtectHome"] == ["read-only"]
    assert service["CacheDirectory"] == ["prima"]
    assert "XDG_CACHE_HOME=/var/cache" in service["Environment"]
    var_cache = tmp_path / "var-cache"  # stands for /var/cache
    # A warm kernel cache, so that this test does not spend minutes compiling (the quick-start
    # test covers the cold path); numba's entries are keyed on the source path, which is the same.
    ensure_compiled(smollm2_path)
    shutil.copytree(compile_cache.cache_dir(), var_cache / "prima" / "kernels" / paths.kernel_source_key())

    env = _env_file()
    exec_start = service["ExecStart"][0].split()
    argv = [env.get(a[2:-1], a) if a.startswith("${") else a for a in exec_start[1:]]
    argv += ["--host", "127.0.0.1", "--port", "0", "--no-mdns", "--model", str(smollm2_path)]
    # Read-only: the checkout and interpreter (the install tree), home, and /var/cache itself;
    # writable: only /var/cache/prima (numba's own fallback, $XDG_CACHE_HOME/numba, is not).
    writable = var_cache / service["CacheDirectory"][0]
    read_only = sorted({str(REPO), sys.prefix, sys.base_prefix, str(Path.home()), str(var_cache)})
    binds = [f"mount --bind {d} {d} && mount -o remount,bind,ro {d} {d}" for d in read_only]
    script = " && ".join([*binds, f"mount --bind {writable} {writable}"])
    child_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(Path.home()),
        "XDG_CACHE_HOME": str(var_cache),
        "PYTHONPATH": str(REPO),
    }
    cmd = [*_sandbox_prefix(), "sh", "-c", f'{script} && exec "$@"', "sh"]
    cmd += [sys.executable, "-m", "prima.cli.primad", *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env)
    try:
        ready = ready_line(proc, timeout_s=300)
        assert ready, proc.stderr.read() if proc.poll() is not None else "no ready line"
        # Without credentials a daemon serves plaintext on loopback only; this process may hold
        # a local ring's identity from an earlier test, so it asks for plaintext explicitly.
        client = NodeClient(json.loads(ready)["address"], identity="plaintext")
        assert client.info().node_id == env["PRIMAD_NAME"]
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == 0


def test_container_cache_is_the_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Dockerfile's XDG_CACHE_HOME puts prima's cache on its VOLUME, the one compose shares."""
    from prima import paths

    docker = (DEPLOY / "Dockerfile").read_text(encoding="utf-8").splitlines()
    env = dict(line.removeprefix("ENV ").split("=", 1) for line in docker if line.startswith("ENV "))
    volume = json.loads(next(line for line in docker if line.startswith("VOLUME ")).removeprefix("VOLUME "))
    monkeypatch.delenv("PRIMA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
    assert [str(paths.cache_root())] == volume
    for name, svc in compose()["services"].items():
        mounts = {m.split(":")[1]: m.split(":")[0] for m in svc["volumes"]}
        assert str(paths.cache_root()) in mounts, name
