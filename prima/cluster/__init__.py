"""cluster: the coordinator's ring (connect, plan, engines), the daemon's node runtime, and local rings of primad processes."""
