"""The operator's side: the admin API, status page, adapter operations and rollouts."""
