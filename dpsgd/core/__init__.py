"""What every layer may import: errors, atomic file writes, the runtime (threads, TF32, float
checks)."""
