"""primad as its own process for tests that watch what it logs: started with any command prefix
(a network namespace), its ready line awaited with a deadline, its stderr kept in a file."""

from __future__ import annotations

import json
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from prima.coordinator.local_ring import READY_PREFIX
from prima.net import discovery

START_TIMEOUT_S = 180.0  # a daemon's first start may compile its kernels


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    ready: dict[str, object]
    stderr: Path

    @property
    def address(self) -> str:
        return str(self.ready["address"])

    def stop(self) -> str:
        """Stop it (SIGTERM, then SIGKILL) and return what it wrote to stderr."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        return self.stderr.read_text(errors="replace")


def start_primad(
    host: str,
    port: int,
    model: Path,
    log_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    wrap: Callable[[list[str]], list[str]] = list,
) -> Daemon:
    """primad on host:port (port 0: any), advertising over mDNS on `host`, its command line
    passed through `wrap` (e.g. into a network namespace); returns once it printed its ready
    line (fails the test with its stderr otherwise)."""
    stderr = log_dir / f"primad-{host}-{secrets.token_hex(3)}.err"
    cmd = [sys.executable, "-m", "prima.cli.primad", "--host", host, "--port", str(port)]
    cmd += ["--model", str(model), "--threads", "1", *args]
    # As a user starts it: `prima.cli.main` run in-process by other tests quiets gRPC's log.
    inherited = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    full_env = {**inherited, discovery.INTERFACES_ENV: host, **(env or {})}
    with stderr.open("w") as err:
        proc = subprocess.Popen(wrap(cmd), env=full_env, stdout=subprocess.PIPE, stderr=err, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            break
        if line.startswith(READY_PREFIX):
            return Daemon(proc, json.loads(line[len(READY_PREFIX) :]), stderr)
    daemon = Daemon(proc, {}, stderr)
    pytest.fail(f"primad on {host} did not start: {daemon.stop()[-3000:]}")
