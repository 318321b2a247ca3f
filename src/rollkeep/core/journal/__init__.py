"""Layer 6, what a run keeps between checkpoints: the journal's segment files (`segments`), its
records read back as a tail (`durable`), replaying a tail onto a ledger (`replay`), and the
group commit that makes journal and row log durable together (`groupcommit`)."""
