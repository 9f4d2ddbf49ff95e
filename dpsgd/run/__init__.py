"""A run of Algorithm 1: its parts, state, opening, resume guard, checkpoint, run directory lock, evaluation and report."""
