"""Layer 5, checkpoints: the atomic cut and what a checkpoint holds (`cut`), its row index and
row codec, the manifest (opening and checking a checkpoint), the store and its publication
protocol (one atomic rename)."""
