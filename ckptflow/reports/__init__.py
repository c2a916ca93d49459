"""Numbers about a store, read-only: inventory, storage stats, costs, recovery metrics."""
