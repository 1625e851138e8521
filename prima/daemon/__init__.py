"""primad's side of the ring, in parts: `runtime` (the plan and the admission of activations,
behind the gRPC servicer), `install` (a plan checked and its windows readied), `sessions` (KV
caches within the daemon's bounds), `authorization` (who may call), `worker` (the compute
thread and routing to the next hop), `head` (generation on the ring, on the plan's node 0) and
`profile` (the device measured for the scheduler)."""
