"""A run: its state, checkpoint, run directory and locks, report, the command lines (Hydra, torchrun) and launchers."""
