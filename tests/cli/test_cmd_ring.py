"""`prima ring`: bad settings refused before any daemon starts, a daemon's own error quoted, no
daemon outliving a terminated command, and a detached ring that `ring down` stops."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from prima.cli.main import main
from prima.coordinator.local_ring import LocalRing
from prima.coordinator.ring import Ring
from prima.errors import NodeError
from prima.kernels import compile_cache

WAIT_S = 60.0


def _gone(pid: int, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_ring_up_refuses_a_bad_budget_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ring", "up", "-n", "1", "--mem-budget", "lots"]) == 1
    assert "cannot read 'lots' as bytes" in capsys.readouterr().err


@pytest.mark.slow
def test_a_daemon_that_exits_early_is_quoted(smollm2_path: Path) -> None:
    with pytest.raises(NodeError, match="cannot read 'lots' as bytes"):
        LocalRing.start(1, smollm2_path, mem_budgets=["lots"])


def _prima(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "prima.cli.main", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.mark.slow
def test_sigterm_to_ring_up_stops_its_daemons(smollm2_path: Path) -> None:
    proc = _prima("ring", "up", "-n", "1", "-m", str(smollm2_path), "--json")
    try:
        line = proc.stdout.readline()  # the nodes, once they are ready
        assert line, proc.stderr.read()
        pid = json.loads(line)[0]["pid"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 128 + signal.SIGTERM
        assert _gone(pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=WAIT_S)


@pytest.mark.slow
def test_detached_ring_runs_until_ring_down(smollm2_path: Path, tmp_path: Path) -> None:
    # Its own state file (PRIMA_CACHE), the kernels this session already compiled.
    env = {**os.environ, "PRIMA_CACHE": str(tmp_path), "NUMBA_CACHE_DIR": str(compile_cache.cache_dir())}
    up = subprocess.run(
        [
            sys.executable,
            "-m",
            "prima.cli.main",
            "ring",
            "up",
            "-n",
            "1",
            "-m",
            str(smollm2_path),
            "--detach",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert up.returncode == 0, up.stderr
    pid = json.loads(up.stdout.splitlines()[0])[0]["pid"]
    try:
        assert psutil.Process(pid).is_running()
        assert (tmp_path / "ring.json").is_file()
        down = subprocess.run(
            [sys.executable, "-m", "prima.cli.main", "ring", "down"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert down.returncode == 0, down.stderr
        assert "stopped 1 daemon" in down.stdout
        assert _gone(pid)
        assert not (tmp_path / "ring.json").exists()
    finally:
        if not _gone(pid, 0):
            os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_ring_status_lists_the_ring_in_order_head_first_and_reports_a_silent_node(
    smollm2_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Given the nodes in any order and one address where nothing listens: the three daemons in
    ring order, the head first and marked, and the silent one reported, not a stop at it."""
    dead = f"127.0.0.1:{_free_port()}"
    with LocalRing.start(3, smollm2_path, log_dir=tmp_path) as local:
        ring = Ring.connect(local.addresses, window_sizes=[10, 10, 10])
        try:
            given = [local.addresses[2], dead, local.addresses[0], local.addresses[1]]
            code = main(["ring", "status", "--nodes", ",".join(given)])
            out = capsys.readouterr().out.splitlines()
            assert main(["ring", "status", "--json", "--nodes", ",".join(given)]) == 1
            rows = json.loads(capsys.readouterr().out)
        finally:
            ring.close()
    assert code == 1  # a named node did not answer
    # Ring order: the head (the last layers), then from layer 0 on.
    assert [line.split()[0] for line in out[:3]] == ["node0", "node1", "node2"]
    assert out[0].startswith(f"node0 @ {local.addresses[0]} (head): ready")
    assert "(head)" not in out[1] + out[2]
    assert "windows [0,10)" in out[1]
    assert "windows [10,20)" in out[2]
    assert out[3].startswith(f"{dead}: not answering: ")
    assert [r.get("node_id") for r in rows] == ["node0", "node1", "node2", None]
    assert [r.get("head") for r in rows[:3]] == [True, False, False]
    assert rows[3]["address"] == dead
    assert "error" in rows[3]
