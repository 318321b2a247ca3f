"""Layer 2, who holds every prompt: keys, the ledger's events and records, the transition
table, the ledger itself, its audit and its codec, and the schema of the run's trace."""
