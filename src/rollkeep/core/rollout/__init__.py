"""Layer 3, what the ledger's groups are made of: datasets, the epoch permutation and the
prompt source, generation requests and completions, rows and their store, partial-generation
prefixes, batches, advantages, the samplers' limits and the take/drop decisions."""
