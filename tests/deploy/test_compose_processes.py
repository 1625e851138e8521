"""deploy/docker-compose.yml's services run as plain processes on loopback, in the order its
depends_on gives them, so that the file cannot drift from the CLI: the warmup exits 0, the three
daemons become healthy, and the coordinator prints generated text."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from prima import paths
from prima.cli.main import build_parser
from prima.coordinator.emulate import EmulatedDevice, cgroups_writable
from prima.kernels import compile_cache
from prima.model.registry import KNOWN_MODELS
from prima.net.mdns_names import INTERFACES_ENV, SERVICE_TYPE_ENV
from prima.scheduler import profile_cache

from .files import DEPLOY, compose, mem_limit_bytes, ready_line

pytestmark = pytest.mark.slow

NODES = ("node0", "node1", "node2")
START_TIMEOUT_S = 300.0  # a daemon's start with the kernels compiled: seconds, on a busy machine
RUN_TIMEOUT_S = 300.0  # the warmup with the kernels compiled, or one run of the coordinator
EXECUTABLES = {
    "prima": [sys.executable, "-m", "prima.cli.main"],
    "primad": [sys.executable, "-m", "prima.cli.primad"],
    "python": [sys.executable],
}


def _volume(tmp_path: Path, model: Path) -> Path:
    """A directory standing for /var/cache/prima's parent, the Dockerfile's XDG_CACHE_HOME: the
    volume holds the model (a link to the test model) and a copy of this machine's compiled
    kernels, as the warmup leaves them."""
    docker = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    assert "ENV XDG_CACHE_HOME=/var/cache\n" in docker
    var_cache = tmp_path / "var-cache"
    volume = var_cache / "prima"
    (volume / "models").mkdir(parents=True)
    _model_file(var_cache).symlink_to(model)
    shutil.copytree(compile_cache.cache_dir(), volume / "kernels" / paths.kernel_source_key())
    return var_cache


def _model_file(var_cache: Path) -> Path:
    """Where the warmup service's model lies in the volume."""
    warmup = build_parser().parse_args(compose()["services"]["warmup"]["command"][1:])
    return var_cache / "prima" / "models" / KNOWN_MODELS[warmup.model].filename


@contextlib.contextmanager
def _memory_limits(services: dict[str, Any]) -> Iterator[dict[str, Callable[[], None]]]:
    """For each service with a mem_limit, a preexec_fn that puts its process in a memory cgroup
    of that size; none where cgroups cannot be made here."""
    if cgroups_writable():
        yield {}
        return
    devices = {
        name: EmulatedDevice(f"test-compose-{name}-{os.getpid()}", mem_limit_bytes(svc["mem_limit"]))
        for name, svc in services.items()
        if "mem_limit" in svc
    }
    try:
        yield {name: d.preexec() for name, d in devices.items()}
    finally:
        for device in devices.values():
            device.remove()


def _rewrite_ports(argv: list[str], ports: dict[int, int]) -> list[str]:
    """argv with each compose port (7601, ...) replaced by the port that node really got."""
    out = []
    for arg in argv:
        for fixed, real in ports.items():
            arg = arg.replace(f"127.0.0.1:{fixed}", f"127.0.0.1:{real}").replace(
                f"'127.0.0.1', {fixed})", f"'127.0.0.1', {real})"
            )
        out.append(arg)
    return out


def _starts(service: dict[str, Any]) -> int:
    """How often docker starts a service that keeps failing: once, or with `restart:
    on-failure:N` 1 + N times (plain `on-failure` retries forever; 3 here)."""
    policy = str(service.get("restart", "no"))
    if not policy.startswith("on-failure"):
        return 1
    _, _, retries = policy.partition(":")
    return 1 + (int(retries) if retries else 2)


def _command(argv: list[str]) -> list[str]:
    return [*EXECUTABLES[argv[0]], *argv[1:]]


def test_compose_services_run_as_plain_processes(smollm2_path: Path, tmp_path: Path) -> None:
    """The same commands and environment as the containers, with four differences docker would
    make: the volume is a directory under tmp_path, already holding the model (nothing is
    downloaded: pip gets no index) and the compiled kernels (the warmup then checks and exits in
    seconds; tests/engine/test_warmup.py compiles from empty); each node listens on a free port
    (--port 0) instead of its fixed one, and the health checks and the coordinator's --nodes are
    rewritten to it; mDNS stays on 127.0.0.1 under a private service type; and the memory
    limits hold only where memory cgroups can be made here (cgroup v1, root), each process in a
    cgroup of its service's mem_limit, else there are none (docker alone would apply them)."""
    from prima.engine.warmup import ensure_compiled

    ensure_compiled(smollm2_path)  # this machine's kernels, compiled once for the whole test run
    services = compose()["services"]
    var_cache = _volume(tmp_path, smollm2_path)
    base_env = {
        k: v
        for k, v in os.environ.items()
        if k not in (paths.CACHE_ENV, compile_cache.CACHE_DIR_ENV, profile_cache.CACHE_ENV)
    }
    base_env.update(
        {
            "XDG_CACHE_HOME": str(var_cache),
            "PIP_NO_INDEX": "1",  # a node that tried to download the model would fail, not fetch
            INTERFACES_ENV: "127.0.0.1",
            SERVICE_TYPE_ENV: f"_pr{secrets.token_hex(4)}._tcp.local.",
        }
    )

    def env(name: str) -> dict[str, str]:
        return {**base_env, **{k: str(v) for k, v in services[name].get("environment", {}).items()}}

    logs = tmp_path / "logs"
    logs.mkdir()
    nodes: dict[str, subprocess.Popen[str]] = {}
    with _memory_limits(services) as preexec:
        try:
            # warmup: runs to completion first (the nodes' service_completed_successfully)
            warm = subprocess.run(
                _command(services["warmup"]["command"]),
                env=env("warmup"),
                preexec_fn=preexec.get("warmup"),
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT_S,
                check=False,
            )
            assert warm.returncode == 0, warm.stderr[-3000:]
            assert warm.stdout.strip() == str(_model_file(var_cache))

            # the nodes: each becomes healthy (the coordinator's service_healthy)
            ports: dict[int, int] = {}
            for name in NODES:
                argv = services[name]["command"]
                fixed = int(argv[argv.index("--port") + 1])
                argv = [*argv[: argv.index("--port") + 1], "0", *argv[argv.index("--port") + 2 :]]
                with open(logs / f"{name}.log", "w") as err:
                    nodes[name] = subprocess.Popen(
                        _command(argv),
                        env=env(name),
                        preexec_fn=preexec.get(name),
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                    )
                ready = ready_line(nodes[name], timeout_s=START_TIMEOUT_S)
                assert ready, f"{name} did not start:\n{(logs / f'{name}.log').read_text()[-3000:]}"
                ports[fixed] = int(json.loads(ready)["address"].rsplit(":", 1)[1])
                health = services[name]["healthcheck"]["test"]
                assert health[0] == "CMD"
                check = subprocess.run(
                    _command(_rewrite_ports(health[1:], ports)), capture_output=True, timeout=60, check=False
                )
                assert check.returncode == 0, check.stderr

            # the coordinator: generates on the ring (started again on failure, as its policy says)
            for _ in range(_starts(services["coordinator"])):
                run = subprocess.run(
                    _command(_rewrite_ports(services["coordinator"]["command"], ports)),
                    env=env("coordinator"),
                    capture_output=True,
                    text=True,
                    timeout=RUN_TIMEOUT_S,
                    check=False,
                )
                if run.returncode == 0:
                    break
            assert run.returncode == 0, run.stderr[-3000:]
            assert "Paris" in run.stdout, (run.stdout, run.stderr[-3000:])
            for name, proc in nodes.items():
                assert proc.poll() is None, f"{name} exited:\n{(logs / f'{name}.log').read_text()[-3000:]}"
        finally:
            for proc in nodes.values():
                proc.terminate()
            for proc in nodes.values():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                if proc.stdout:
                    proc.stdout.close()
    for name in NODES:
        log = (logs / f"{name}.log").read_text()
        assert "compiling kernels" not in log, f"{name} compiled inside its limit:\n{log[-3000:]}"
