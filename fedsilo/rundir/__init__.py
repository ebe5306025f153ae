"""A run directory's files: layout and checkpoints, the one-writer lock, records read back, the start's data check."""
