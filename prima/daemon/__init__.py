"""primad's side of the ring, in parts: `runtime` (the plan and the sessions, behind the gRPC
servicer), `worker` (the compute thread and routing to the next hop), `head` (generation on the
ring, on the plan's node 0) and `profile` (the device measured for the scheduler)."""
