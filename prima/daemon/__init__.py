"""primad's side of the ring, in parts wired together by `runtime` (the NodeHandler behind the
gRPC servicer): `plan_holder` (the plan it runs, fetched first by `fetching` when the file lacks
its windows), `install` (a plan checked and its windows readied), `sessions` (KV caches within
the daemon's bounds), `authorization` (who may call), `arrivals` (activations from peers checked
and handed on), `worker` (the compute thread and routing to the next hop), `head` (generation on
the ring, on the plan's node 0), `node_info` (what Info answers) and `node_profile` (the device
measured for the scheduler)."""
