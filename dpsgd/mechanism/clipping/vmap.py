"""The exact per-example paths: torch.func ``vmap(grad(loss_i))`` over the physical batch, and a
loop of batch-of-1 passes for the models vmap cannot batch.

The reference path (Algorithm 1 read literally): materialise g(x_i) for every example, measure its
norm, scale by min(1, C/‖g_i‖) and sum. Exact for any model whose examples do not interact (the
engine proves it first: proof.py); costs memory B × (#parameters), so the batch is processed in
chunks under a memory budget. Recurrent layers run unrolled inside (``rnn.unrolled_rnns``).
``loop_clipped_sum``: one forward and backward pass per example (data-dependent shapes, in-place
tricks vmap refuses); B passes of batch 1, the slowest and most general.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from dpsgd.mechanism import batches
from dpsgd.mechanism.batches import logits_of, tree_map

from .clip import clip_factors, example_losses, loss_rows
from .rnn import unrolled_rnns

# Bytes of per-example gradients materialised at once (the batch is split into chunks to fit).
DEFAULT_CHUNK_BYTES = 256 * 2**20


def _split_params(model: nn.Module):
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    frozen.update(dict(model.named_buffers()))
    return trainable, frozen


class _Objective(nn.Module):
    """``loss(model, batch)`` as a module, so that ``functional_call`` runs the user's loss with
    the model's parameters replaced (its parameters are the model's, under ``model.``)."""

    def __init__(self, model: nn.Module, loss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, batch):
        return self.loss(self.model, batch)


def per_example_fn(model: nn.Module, multiplicity: int = 1, loss=None, batch: bool = False):
    """(detached trainable params, f(params, x, y) -> (per-example grads, per-example losses)).

    With ``multiplicity`` K > 1, x is [B, K, ...] (K augmented copies of each example) and example
    i's loss is the mean over its copies (De et al. 2022, augmentation multiplicity). ``batch``:
    x is a batch (``dpsgd.mechanism.batches``), y None, and ``loss`` the user's
    ``loss(model, batch)`` (``BatchLoss``), called on each example as a batch of one."""
    trainable, frozen = _split_params(model)
    params = {n: p.detach() for n, p in trainable.items()}

    user_loss = loss
    if batch:
        objective = _Objective(model, loss)

        def loss_b(p, b_i, _):
            one = tree_map(lambda t: t.unsqueeze(0), b_i)
            state = {f"model.{n}": v for d in (p, frozen) for n, v in d.items()}
            out = functional_call(objective, state, (one,))[0]
            return out, out.detach()

        fn = vmap(grad(loss_b, has_aux=True), in_dims=(None, 0, None), randomness="different")
        return params, fn

    def loss_i(p, x_i, y_i):
        if (
            user_loss is not None
        ):  # a user's per-example loss (``loss_rows``), mean over the K copies
            x_b = x_i.unsqueeze(0) if multiplicity == 1 else x_i
            y_b = y_i.unsqueeze(0) if multiplicity == 1 else y_i.expand(multiplicity, *y_i.shape)
            out = loss_rows(user_loss, functional_call(model, (p, frozen), (x_b,)), y_b).mean()
            return out, out.detach()
        if multiplicity == 1:
            logits = logits_of(functional_call(model, (p, frozen), (x_i.unsqueeze(0),)))
            loss = F.cross_entropy(logits, y_i.unsqueeze(0))
        else:
            logits = logits_of(functional_call(model, (p, frozen), (x_i,)))
            loss = F.cross_entropy(logits, y_i.expand(multiplicity))
        return loss, loss.detach()

    return params, vmap(grad(loss_i, has_aux=True), in_dims=(None, 0, 0), randomness="different")


def per_sample_grads(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES
):
    """Per-example gradients of the cross-entropy loss: (dict name -> [B, *p.shape], losses [B]).

    Only trainable parameters (requires_grad) appear. Dropout draws independent masks per example
    (``randomness="different"``), as it would in a batched forward pass.
    """
    params, per_example = per_example_fn(model)
    B = x.shape[0]
    n_params = sum(p.numel() for p in params.values())
    bytes_per_example = max(1, n_params * x.element_size())
    chunk = max(1, min(B, chunk_bytes // bytes_per_example)) if B else 1
    with unrolled_rnns(model):
        outs = [per_example(params, x[s : s + chunk], y[s : s + chunk]) for s in range(0, B, chunk)]
    if not outs:
        return {n: p.new_zeros((0,) + p.shape) for n, p in params.items()}, x.new_zeros(0)
    grads = {n: torch.cat([g[n] for g, _ in outs]) for n in params}
    losses = torch.cat([l for _, l in outs])
    return grads, losses


def vmap_clipped_sum(
    model: nn.Module,
    x,
    y: torch.Tensor | None,
    groups: list[list[str]],
    clip_norm: float | None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    out: dict[str, torch.Tensor] | None = None,
    multiplicity: int = 1,
    weights: torch.Tensor | None = None,
    loss=None,
    autocast=None,
):
    """Σ_i clip(g_i) per parameter, Σ_i loss_i, per-example group norms [B, k].

    Chunks are clipped and summed one at a time, so at most one chunk of per-example gradients
    is alive at once. With ``out``, the sums are added into those tensors (and returned).
    With ``multiplicity`` K > 1, x has B·K rows (example i's copies in rows iK .. iK+K−1) and
    g_i is the gradient of the mean loss over them. ``weights`` [B] (None: all ones) multiply each
    example's clip factor and loss: Σ_i w_i c_i g_i, Σ_i w_i loss_i; the norms are unweighted.
    ``y`` None: ``x`` is a batch and ``loss`` the user's ``loss(model, batch)``. ``autocast``: a
    context the per-example forward and backward passes run in (mixed precision); the gradients
    are the parameters' dtype, and the norms, factors and sums are computed in it.
    """
    params, per_example = per_example_fn(model, multiplicity, loss, batch=y is None)
    if multiplicity > 1:
        x = x.view((x.shape[0] // multiplicity, multiplicity) + tuple(x.shape[1:]))
    group_of = {n: g for g, names in enumerate(groups) for n in names}
    sums = out if out is not None else {n: torch.zeros_like(p) for n, p in params.items()}
    B = y.shape[0] if y is not None else batches.rows(x)
    device = batches.device_of(x)
    loss_sum = torch.zeros((), dtype=_norm_dtype(params), device=device)
    if B == 0:
        return sums, loss_sum, torch.zeros((0, len(groups)), dtype=loss_sum.dtype, device=device)
    n_params = sum(p.numel() for p in params.values())
    width = max(t.element_size() for t in batches.leaves(x))
    chunk = max(1, min(B, chunk_bytes // max(1, n_params * width)))
    norms_all = []
    for s in range(0, B, chunk):
        with unrolled_rnns(model), autocast or nullcontext():
            g, losses = per_example(
                params,
                batches.narrow(x, s, s + chunk),
                None if y is None else y[s : s + chunk],
            )
        sq = torch.stack([sum(g[n].flatten(1).pow(2).sum(1) for n in names) for names in groups], 1)
        norms = sq.sqrt()
        factors = clip_factors(norms, clip_norm)
        if weights is not None:
            w = weights[s : s + chunk].to(device=factors.device, dtype=factors.dtype)
            factors, losses = factors * w[:, None], losses * w.to(losses.dtype)
        for n, gn in g.items():
            sums[n] += torch.tensordot(factors[:, group_of[n]].to(gn.dtype), gn, dims=1)
        norms_all.append(norms)
        loss_sum = loss_sum + losses.sum()
    return sums, loss_sum.detach(), torch.cat(norms_all)


def loop_clipped_sum(
    model: nn.Module,
    x,
    y: torch.Tensor | None,
    groups: list[list[str]],
    clip_norm: float | None,
    out: dict[str, torch.Tensor] | None = None,
    multiplicity: int = 1,
    weights: torch.Tensor | None = None,
    loss=None,
    autocast=None,
):
    """``vmap_clipped_sum``'s results, one example at a time: example i's K rows through the model
    alone, its gradient by autograd, clipped and added (Algorithm 1 read literally)."""
    K = multiplicity
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    sums = out if out is not None else {n: torch.zeros_like(p) for n, p in named}
    group_of = {n: g for g, names in enumerate(groups) for n in names}
    dtype = _norm_dtype(dict(named))
    B = y.shape[0] if y is not None else batches.rows(x)
    device = batches.device_of(x)
    loss_sum = torch.zeros((), dtype=dtype, device=device)
    norms = torch.zeros((B, len(groups)), dtype=dtype, device=device)
    for i in range(B):
        with torch.enable_grad():
            with autocast or nullcontext():
                x_i = batches.narrow(x, i * K, (i + 1) * K)
                ell = example_losses(model, x_i, None if y is None else y[i : i + 1], K, loss)[0]
            gs = torch.autograd.grad(ell, params, allow_unused=True)
        g = {n: torch.zeros_like(p) if t is None else t for (n, p), t in zip(named, gs)}
        with torch.no_grad():
            for k, names in enumerate(groups):
                norms[i, k] = torch.sqrt(sum(g[n].pow(2).sum() for n in names))
            f = clip_factors(norms[i], clip_norm)
            w = 1.0 if weights is None else weights[i].to(dtype)
            for n, gn in g.items():
                sums[n] += (f[group_of[n]] * w).to(gn.dtype) * gn
            loss_sum = loss_sum + w * ell.detach().to(dtype)
    return sums, loss_sum, norms


def _norm_dtype(params: dict) -> torch.dtype:
    for p in params.values():
        return p.dtype
    return torch.get_default_dtype()
