"""The clipping rule of Algorithm 1 (Abadi et al. 2016): ḡ(x_i) = g(x_i) / max(1, ‖g(x_i)‖₂ / C),
as per-example factors shared by both engines (vmap reference and ghost norms)."""

from __future__ import annotations

import torch

CLIPPINGS = (
    "global",
    "per_layer",
)  # privacy.clipping: one norm over all parameters, or one per layer
MODES = ("auto", "vmap", "ghost")  # privacy.grad_sample_mode: the engine computing the clipped sum


def clip_factors(norms: torch.Tensor, clip_norm: float | None) -> torch.Tensor:
    """min(1, C / ‖g_i‖) = C / max(‖g_i‖, C); ones when clipping is disabled.

    Exactly 1 for every unclipped example and for zero gradients (C / C), and C / ‖g_i‖ correctly
    rounded above the bound: one true division. (``C / norms`` would not do: a tensor's reflected
    division is reciprocal-then-multiply, which gives 1 − 2⁻⁵³ for C = ‖g_i‖ = 49 in float64.)"""
    if clip_norm is None:
        return torch.ones_like(norms)
    return torch.div(clip_norm, norms.clamp_min(clip_norm))
