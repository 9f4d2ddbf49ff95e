"""Per-example clipping engines (vmap reference and ghost norms + book-keeping)."""
from .engine import ClipResult, PerExampleClipper
from .vmap import clip_factors, per_sample_grads

__all__ = ["PerExampleClipper", "ClipResult", "per_sample_grads", "clip_factors"]
