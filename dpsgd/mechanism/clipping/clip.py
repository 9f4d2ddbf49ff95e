"""The clipping rule of Algorithm 1 (Abadi et al. 2016): ḡ(x_i) = g(x_i) / max(1, ‖g(x_i)‖₂ / C),
as per-example factors shared by both engines (vmap reference and ghost norms)."""

from __future__ import annotations

import torch

from dpsgd.mechanism.batches import logits_of

CLIPPINGS = (
    "global",
    "per_layer",
)  # privacy.clipping: one norm over all parameters, or one per layer
MODES = ("auto", "vmap", "ghost")  # privacy.grad_sample_mode: the engine computing the clipped sum
PRECISIONS = ("fp32", "bf16")  # training.precision: the forward pass in float32, or autocast bf16


def clip_factors(norms: torch.Tensor, clip_norm: float | None) -> torch.Tensor:
    """min(1, C / ‖g_i‖) = C / max(‖g_i‖, C); ones when clipping is disabled.

    Exactly 1 for every unclipped example and for zero gradients (C / C), and C / ‖g_i‖ correctly
    rounded above the bound: one true division. (``C / norms`` would not do: a tensor's reflected
    division is reciprocal-then-multiply, which gives 1 − 2⁻⁵³ for C = ‖g_i‖ = 49 in float64.)"""
    if clip_norm is None:
        return torch.ones_like(norms)
    return torch.div(clip_norm, norms.clamp_min(clip_norm))


def loss_rows(loss, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A user's per-example loss on one batch: ``loss(output, target)`` must give one value per
    example (shape [B], like ``F.cross_entropy(..., reduction="none")``); a mean or a sum over the
    batch would mix examples, and clipping each example's gradient would then bound nothing."""
    rows = loss(output, target)
    n = output.shape[0] if isinstance(output, torch.Tensor) else target.shape[0]
    if not isinstance(rows, torch.Tensor) or rows.shape != (n,):
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(
            f"loss must return one value per example (shape [{n}], e.g. "
            f"reduction='none'), got {shape}"
        )
    return rows


def summed_loss(model, x, y: torch.Tensor | None, K: int = 1, weights=None, loss=None):
    """One forward pass and the loss a step differentiates: (Σ_i ℓ_i, the dtype it was computed
    in, the loss reported: Σ_i ℓ_i detached, or Σ_i w_i ℓ_i with ``weights`` [B]). ℓ_i is ``loss``
    (``loss_rows``; None: cross-entropy) averaged over example i's K consecutive rows (augmentation
    multiplicity); ``y`` None: ``x`` is a batch (``dpsgd.mechanism.batches``) and ``loss`` the
    user's ``loss(model, batch) -> [B]`` (a ``BatchLoss``). The weights enter only the reported
    loss: an engine applies them to each example's clipped gradient (the ghost engine and the
    plain step of ``dpsgd/mechanism/optim.py`` alike)."""
    if y is None:  # a batch and the user's loss(model, batch) -> [B]
        rows = loss(model, x)
        per_example = rows.detach()
        if weights is not None:
            per_example = per_example * weights.to(per_example)
        return rows.sum(), rows.dtype, per_example.sum()
    out = model(x)
    if loss is None and weights is None:  # the model's own reduction: one fused sum
        out = logits_of(out)
        if K == 1:
            total = torch.nn.functional.cross_entropy(out, y, reduction="sum")
        else:  # Σ_i mean_k ℓ(θ, x_ik)
            total = torch.nn.functional.cross_entropy(out, y.repeat_interleave(K), reduction="sum")
            total = total / K
        return total, out.dtype, total.detach()
    target = y if K == 1 else y.repeat_interleave(K, dim=0)
    if loss is None:
        out = logits_of(out)
        rows = torch.nn.functional.cross_entropy(out, target, reduction="none")
        dtype = out.dtype
    else:
        rows = loss_rows(loss, out, target)
        dtype = rows.dtype
    total = rows.sum() if K == 1 else rows.sum() / K
    per_example = rows.detach() if K == 1 else rows.detach().view(-1, K).sum(1) / K
    if weights is not None:
        per_example = per_example * weights.to(per_example)
    return total, dtype, per_example.sum()


def example_losses(model, x, y: torch.Tensor | None, K: int = 1, loss=None) -> torch.Tensor:
    """Each example's loss in one batched forward pass ([B]): ``loss`` (``loss_rows``; None:
    cross-entropy) per row, the mean over each example's K consecutive rows (augmentation
    multiplicity). ``y`` None: ``x`` is a batch (``dpsgd.mechanism.batches``) and ``loss`` the
    user's ``loss(model, batch) -> [B]`` (a ``BatchLoss``). The function the proofs (``proof.py``)
    and the per-example loop differentiate."""
    if y is None:
        return loss(model, x)
    return example_rows(model(x), y, K, loss)


def example_rows(out: torch.Tensor, y: torch.Tensor, K: int = 1, loss=None) -> torch.Tensor:
    """Each example's loss ([B]) from the model's output on its B·K rows: ``loss`` (``loss_rows``;
    None: cross-entropy) per row, the mean over each example's K consecutive rows."""
    target = y if K == 1 else y.repeat_interleave(K, dim=0)
    if loss is None:
        rows = torch.nn.functional.cross_entropy(logits_of(out), target, reduction="none")
    else:
        rows = loss_rows(loss, out, target)
    return rows if K == 1 else rows.view(-1, K).mean(1)
