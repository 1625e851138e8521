"""N primad processes on 127.0.0.1 (port 0 each), for `prima run --local-ring N`, `prima ring up`,
tests and benchmarks. Each daemon's bound port is read from its ready line, never guessed.
With `mdns=True` they advertise themselves on 127.0.0.1 only, so a coordinator on this machine
finds them by discovery.

The daemons talk mutual TLS with certificates from a CA: by default this process's throwaway one
(prima.net.credentials.local_ca; its key never leaves memory), which this process's clients then
trust, or a given cluster CA (`prima ring up` on the device that holds it). Each daemon's identity
file lives in a private temporary directory only until the daemon has read it."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from prima.engine.warmup import ensure_compiled
from prima.errors import NodeError
from prima.net import credentials
from prima.net.credentials import ClusterCA
from prima.net.discovery import INTERFACES_ENV
from prima.net.revocation import REVOKED_FILE

log = logging.getLogger("prima.coordinator")

READY_PREFIX = "PRIMAD_READY "
DEFAULT_START_TIMEOUT_S = 120.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LocalNode:
    node_id: str
    address: str
    pid: int
    metrics_port: int | None = None


class LocalRing:
    """Start daemons with `LocalRing.start(...)`; `close()` (or the context manager) stops them."""

    def __init__(self, procs: list[subprocess.Popen[str]], nodes: list[LocalNode]) -> None:
        self.procs = procs
        self.nodes = nodes

    @classmethod
    def start(
        cls,
        n: int,
        model: str | os.PathLike[str],
        *,
        threads: int | None = None,
        mem_budgets: Sequence[str] | None = None,
        models: Sequence[str | os.PathLike[str]] | None = None,
        extra_args: Sequence[str] = (),
        node_args: Sequence[Sequence[str]] | None = None,
        timeout_s: float = DEFAULT_START_TIMEOUT_S,
        log_dir: Path | None = None,
        names: Sequence[str] | None = None,
        mdns: bool = False,
        detach: bool = False,
        preexec: Sequence[Callable[[], None] | None] | None = None,
        ca: ClusterCA | None = None,
        plaintext: bool = False,
    ) -> LocalRing:
        """Start `n` daemons (named node0..node{n-1} unless `names`) and wait until each prints
        its ready line. `models` and `mem_budgets` optionally give each node its own file or
        budget; `mdns` lets them advertise on 127.0.0.1. The daemons end with this process
        (Linux), unless `detach`: then they run on in their own session until stopped.
        `node_args[i]` are daemon i's own arguments after `extra_args` (e.g. one `--backend acl`).
        `preexec[i]` runs in daemon i's process before it starts (e.g. joining a memory cgroup,
        see cluster.emulate). Each daemon gets a certificate for its name from `ca` (default:
        this process's throwaway CA); `plaintext` starts them without credentials instead."""
        if n < 1:
            raise NodeError(f"a ring needs at least one node, got {n}")
        names = list(names) if names else [f"node{i}" for i in range(n)]
        if len(names) != n:
            raise NodeError(f"{n} daemons but {len(names)} names")
        # Daemons on one machine share its cores: split them. BLAS pools stay as
        # prima.kernels.thread_env sets them (one thread): prefill threads its own tiles, and
        # BLAS workers spinning beside numba's would take the cores it computes on.
        threads = threads or max(1, (os.cpu_count() or 1) // n)
        # One compile here, not n side by side in daemons racing their start timeout; each
        # node's file, as their formats may differ.
        for path in dict.fromkeys(models or [model]):
            ensure_compiled(path)
        env = _daemon_env(threads)
        # The kernel signals a child when the *thread* that forked it ends: only the main
        # thread's lifetime is the process's.
        tie = not detach and threading.current_thread() is threading.main_thread()
        procs: list[subprocess.Popen[str]] = []
        logs: list[int] = []  # a descriptor of each daemon's stderr file
        if log_dir:
            log_dir.mkdir(parents=True, exist_ok=True)
        secrets = tempfile.TemporaryDirectory(prefix="prima-ring-")
        try:
            dirs = [] if plaintext else _issue(names, ca or credentials.local_ca(), Path(secrets.name))
            for i in range(n):
                cmd = _primad_command(
                    models[i] if models else model,
                    names[i],
                    threads,
                    [*extra_args, *(node_args[i] if node_args else ())],
                    cluster_dir=dirs[i] if dirs else None,
                    mdns=mdns,
                    mem_budget=mem_budgets[i] if mem_budgets else None,
                )
                # stderr goes to a file (a log, or an unnamed temporary one) so that a daemon that
                # exits early can be quoted; the child keeps its own copy of the descriptor.
                with open(log_dir / f"node{i}.log", "w+") if log_dir else tempfile.TemporaryFile("w+") as err:
                    procs.append(
                        _spawn(cmd, env, err, detach, _before_exec(tie, preexec[i] if preexec else None))
                    )
                    logs.append(os.dup(err.fileno()))
            nodes = [_wait_ready(p, names[i], timeout_s, logs[i]) for i, p in enumerate(procs)]
        except BaseException:
            _stop(procs)
            raise
        finally:
            secrets.cleanup()
            for fd in logs:
                os.close(fd)
        log.info("local ring up: %s", ", ".join(f"{n.node_id}@{n.address}" for n in nodes))
        return cls(procs, nodes)

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    def kill(self, index: int) -> None:
        """Kill one daemon abruptly (tests of a node vanishing mid-session)."""
        self.procs[index].kill()
        self.procs[index].wait(timeout=10)

    def pause(self, index: int) -> None:
        """Stop one daemon in its tracks (SIGSTOP): a hung peer, whose sockets stay open."""
        self.procs[index].send_signal(signal.SIGSTOP)

    def resume(self, index: int) -> None:
        """Let a paused daemon run on (SIGCONT)."""
        self.procs[index].send_signal(signal.SIGCONT)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # a paused daemon cannot act on SIGTERM
        _stop(self.procs)

    def __enter__(self) -> LocalRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _spawn(
    cmd: list[str], env: dict[str, str], err: IO[str], detach: bool, preexec: Callable[[], None] | None
) -> subprocess.Popen[str]:
    """Start one daemon, its ready line read from its stdout, its stderr into `err`."""
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env=env,
        start_new_session=detach,
        preexec_fn=preexec,
    )


def _daemon_env(threads: int) -> dict[str, str]:
    """This process's environment for a local daemon: its share of the cores, mDNS on loopback."""
    env = dict(os.environ)
    for var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS"):
        env[var] = str(threads)
    env[INTERFACES_ENV] = "127.0.0.1"
    return env


def _primad_command(
    model: str | os.PathLike[str],
    name: str,
    threads: int,
    node_args: Sequence[str],
    *,
    cluster_dir: Path | None,
    mdns: bool,
    mem_budget: str | None,
) -> list[str]:
    """The command line of one daemon on 127.0.0.1, on a free port; plaintext without
    `cluster_dir` (the directory of its identity)."""
    cmd = [sys.executable, "-m", "prima.cli.primad", "--host", "127.0.0.1", "--port", "0"]
    if cluster_dir is not None:
        # Each daemon's directory is deleted once it has read its identity; the revocation
        # list stays this device's, so `prima cluster revoke` reaches them.
        crl = credentials.cluster_dir() / REVOKED_FILE
        cmd += ["--cluster-dir", str(cluster_dir), "--revocation-list", str(crl)]
    cmd += ["--model", str(model), "--name", name, *node_args, "--threads", str(threads)]
    if not mdns:
        cmd.append("--no-mdns")
    if mem_budget:
        cmd += ["--mem-budget", mem_budget]
    return cmd


def _issue(names: Sequence[str], ca: ClusterCA, root: Path) -> list[Path]:
    """A cluster directory per daemon under `root`, holding its identity for its name. The
    daemons also trust this device's own cluster CA, so that its identity may call them."""
    own = credentials.load_identity()
    dirs = []
    for i, name in enumerate(names):
        identity = ca.issue(name)
        if own is not None:
            identity = identity.trusting(own.roots_pem)
        d = root / f"{i}-{name}"  # names may repeat (a test of duplicate ids): the index keeps them apart
        d.mkdir(mode=0o700)
        credentials.write_private(d / credentials.IDENTITY_FILE, identity.to_pem())
        dirs.append(d)
    return dirs


def _wait_ready(proc: subprocess.Popen[str], name: str, timeout_s: float, stderr_fd: int) -> LocalNode:
    """Read the daemon's stdout until its ready line, the process exits (NodeError quoting its
    stderr), or time runs out."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not sel.select(timeout=left):
                continue
            line = proc.stdout.readline()
            if not line:
                code = proc.wait(timeout=5)
                said = _tail(stderr_fd)
                raise NodeError(
                    f"primad {name} exited with code {code} before it was ready"
                    + (f": {said}" if said else "")
                )
            if line.startswith(READY_PREFIX):
                ready = json.loads(line[len(READY_PREFIX) :])
                return LocalNode(
                    ready["node_id"], ready["address"], int(ready["pid"]), ready.get("metrics_port")
                )
        raise NodeError(f"primad {name} was not ready within {timeout_s:.0f} s")
    finally:
        sel.close()


def _tail(fd: int, max_bytes: int = 4096) -> str:
    """The last error line a daemon wrote (its own `primad: error: ...` if there is one)."""
    size = os.fstat(fd).st_size
    text = os.pread(fd, max_bytes, max(0, size - max_bytes)).decode(errors="replace")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [""])[-1]


def _before_exec(tie: bool, extra: Callable[[], None] | None) -> Callable[[], None] | None:
    """What a daemon's child process runs before exec: tie it to its parent, then `extra`."""
    if not tie:
        return extra

    def run() -> None:
        _end_with_parent()
        if extra is not None:
            extra()

    return run


def _end_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies, so that a killed `prima run
    --local-ring` or `prima ring up` leaves no daemon behind, even without running its cleanup."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
        if p.stdout:
            p.stdout.close()
