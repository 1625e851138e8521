"""The coordinator's side of a ring: where a command runs its model (`session`, from frozen
options), find and check the daemons (`members`, `ring`), plan with Halda over their profiles
(`planner`), and rings of primad processes started on this machine (`local_ring`, `emulate` for
memory- and disk-limited test devices)."""
