"""Which adapters are resident on which replica: the record (store), and the loads, uses and evictions that keep it."""
