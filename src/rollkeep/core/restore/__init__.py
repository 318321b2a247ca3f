"""Layer 7, where a process starts from: the restore chain over a checkpoint (`chain`), the
semantic config check (`configdiff`), and the one start-up every driver runs (`start`)."""
