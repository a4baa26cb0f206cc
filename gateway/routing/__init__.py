"""Pure routing decisions over a snapshot of a pool: no I/O, so it is tested with plain data."""
