"""A prima process that speaks gRPC starts its children reliably: daemons, compile and bench
workers are started by fork + exec while gRPC's threads run (LocalRing, `prima bench`, tests).
With gRPC's fork handlers on, grpcio >= 1.81 aborted about one child in fifty between fork and
exec (grpc/grpc#43055); importing prima turns them off (prima/__init__.py)."""

from __future__ import annotations

import json

from tests.conftest import run_python

PROBE = """
import json, os, subprocess, sys, threading, time
os.environ.pop("GRPC_ENABLE_FORK_SUPPORT", None)  # as a user's shell has it
import prima
import grpc
from concurrent import futures

server = grpc.server(futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
call = channel.unary_unary("/probe/Nothing")
stop = threading.Event()

def keep_grpc_busy():
    while not stop.is_set():
        try:
            call(b"", timeout=0.05)
        except grpc.RpcError:
            pass

threading.Thread(target=keep_grpc_busy, daemon=True).start()
codes = []
deadline = time.monotonic() + 60
for _ in range(int(sys.argv[1])):
    if time.monotonic() > deadline:
        break
    # A preexec_fn makes subprocess fork (not vfork), as LocalRing's does: the fork handlers run.
    done = subprocess.run(["/bin/true"], preexec_fn=lambda: None, stderr=subprocess.PIPE, timeout=10)
    codes.append(done.returncode)
stop.set()
print(json.dumps({"setting": os.environ.get("GRPC_ENABLE_FORK_SUPPORT"), "codes": codes}))
"""


def test_children_of_a_process_serving_grpc_all_start() -> None:
    out = json.loads(run_python(PROBE, "400", timeout=120).stdout)
    assert out["setting"] == "false"
    assert len(out["codes"]) >= 100, "the probe ran out of time before a meaningful number of starts"
    crashed = [c for c in out["codes"] if c != 0]
    assert not crashed, f"{len(crashed)} of {len(out['codes'])} children died before exec: {crashed[:5]}"
