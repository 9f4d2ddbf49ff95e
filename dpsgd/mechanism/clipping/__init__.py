"""Per-example clipping engines (vmap reference and ghost norms + book-keeping), the clipping-group
rule they share with σ calibration and the ledger (``groups``), and the table of ghost layer rules
by module type (``registry``)."""

from .clip import clip_factors
from .engine import ClipResult, PerExampleClipper
from .groups import clipping_groups
from .registry import register_layer
from .vmap import per_sample_grads

__all__ = [
    "ClipResult",
    "PerExampleClipper",
    "clip_factors",
    "clipping_groups",
    "per_sample_grads",
    "register_layer",
]
