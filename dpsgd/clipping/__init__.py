"""Per-example clipping engines (vmap reference and ghost norms + book-keeping)."""
from .clip import clip_factors
from .engine import ClipResult, PerExampleClipper
from .vmap import per_sample_grads

__all__ = ["PerExampleClipper", "ClipResult", "per_sample_grads", "clip_factors"]
