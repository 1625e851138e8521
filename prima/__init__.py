"""prima: run one large language model across a ring of everyday devices.

Set here, before any of prima's modules imports grpc: gRPC's fork handlers stay off
(GRPC_ENABLE_FORK_SUPPORT). prima starts its daemons and workers with fork + exec, never a
forked copy that goes on using gRPC; with the handlers on, grpcio >= 1.81 restarts its poller
in the child between fork and exec, where `subprocess` has closed the poller's descriptor, and
about one child in fifty died of SIGABRT (`epoll_wait error: Bad file descriptor`) before it
ran: a local ring that failed to start, now and then (grpc/grpc#43055). A process that imports
grpc before prima keeps whatever it had.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

__version__ = "0.1.0"
