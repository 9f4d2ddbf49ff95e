"""Ghost norms and book-keeping: clipped gradient sums without per-example gradients.

For a layer with input activations a and output gradients b = ∂(Σ_i loss_i)/∂out, example i's
weight gradient is g_i = b_iᵀ a_i (a_i, b_i: [T, d], [T, p]; T = 1 for a Linear on 2-D input,
T = sequence length, or the number of output pixels of a Conv2d after unfolding its input).

- Norms (Goodfellow 2015, "Efficient per-example gradient computations"; Li et al. 2022 ghost
  clipping; Bu et al. 2023 mixed ghost clipping):
    T = 1:   ‖g_i‖² = ‖a_i‖² ‖b_i‖²                                  (no d×p product at all)
    T > 1:   ‖g_i‖² = ⟨a_i a_iᵀ, b_i b_iᵀ⟩  (ghost, T²(d+p) flops)  or  ‖b_iᵀ a_i‖²  (explicit, Tdp)
- Book-keeping (Bu et al. 2023): with clip factors c_i = min(1, C/‖g_i‖), the clipped sum
  Σ_i c_i g_i = (c ⊙ b)ᵀ a is one ordinary weight-gradient product on the stored a and rescaled b,
  so there is no second backward pass. Where explicit per-example products were formed for the
  norms and fit the memory budget, they are reused instead: Σ_i c_i g_i as one weighted sum.

Details: docs/PERFORMANCE.md, "dpsgd/mechanism/clipping/ghost.py".
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

from . import seq_layers  # noqa: F401  (registers the LayerNorm, Embedding and Conv1d rules)
from .clip import clip_factors, loss_rows
from .groups import owners
from .layers import GenericLayer, Unsupported, _Layer
from .registry import registered_rule

DEFAULT_BUDGET_BYTES = 64 * 2**20  # per-example products kept in memory for reuse, all layers


def build_layers(model: nn.Module) -> tuple[list[_Layer], bool]:
    """A layer rule for every module owning trainable parameters (``groups.owners``), from the table
    of ``registry.py``; (layers, native), native: every such module has a registered rule.

    A leaf module without a registered rule gets the generic per-module vmap rule (not native).
    Raises Unsupported when a parameter is shared between modules (the norm of its per-example
    gradient needs the cross term of its uses, see groups.py), or when a module without a rule
    owns parameters and also has submodules (its forward may use its parameters in any way).
    """
    layers, native = [], True
    for o in owners(model):
        if o.aliases:
            attr, first = next(iter(o.aliases.items()))
            raise Unsupported(
                f"parameter '{f'{o.name}.{attr}' if o.name else attr}' is shared with '{first}'"
            )
        rule = registered_rule(o.module)
        if rule is None and next(o.module.children(), None) is not None:
            kind = type(o.module).__name__
            raise Unsupported(
                f"module '{o.name}' ({kind}) owns parameters and has submodules; its forward "
                f"may use its parameters in any way (no layer rule is registered for {kind}: "
                "see dpsgd/mechanism/clipping/registry.py:register_layer)"
            )
        if rule is None:
            rule, native = GenericLayer, False
        layers.append(rule(o.module, o.params))
    return layers, native


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Record(NamedTuple):
    """What the forward hook of one layer keeps."""

    input: torch.Tensor | None  # the layer's input a, when its rule reads it (``needs_input``)
    edge: object  # autograd edge of its output; None when the output needs no gradient
    version: int  # a._version at the call (a later in-place change is refused)
    rows: int  # a.shape[0]


class Capture:
    """Forward hooks recording each layer's input and the autograd edge of its output.

    Only the gradient edge of the output is kept (not the output tensor), so outputs are freed
    as in a plain forward pass, and the gradient w.r.t. the module's output is exact even when a
    later operation modifies the output in place (e.g. ReLU(inplace=True)).

    Hooks go on the layers only, i.e. on modules owning trainable parameters: a frozen module
    (all parameters requires_grad=False) is neither hooked nor recorded, and its activations are
    kept only if autograd needs them to reach a trainable layer below it. A layer whose weight is
    frozen and bias trained records its input's batch size, not the input (``needs_input``).
    """

    def __init__(self, layers: list[_Layer]):
        self.layers = layers
        self.records: dict[int, Record] = {}

    def __enter__(self):
        self.records.clear()
        self.handles = [
            l.module.register_forward_hook(self._hook(i)) for i, l in enumerate(self.layers)
        ]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False

    def _hook(self, i):
        def hook(module, args, output):
            if i in self.records:
                raise Unsupported(
                    f"module {self.layers[i].names} is called more than once per forward pass"
                )
            if (
                len(args) != 1
                or not isinstance(args[0], torch.Tensor)
                or not isinstance(output, torch.Tensor)
            ):
                raise Unsupported(
                    f"module {self.layers[i].names} must take one tensor and return one"
                )
            a = args[0]
            if a.dim() == 0 or output.dim() == 0 or a.shape[0] != output.shape[0]:
                raise Unsupported(
                    f"module {self.layers[i].names} does not keep the batch in dimension 0"
                )
            layer = self.layers[i]
            edge = get_gradient_edge(output) if output.requires_grad else None
            if edge is not None:
                layer.check_input(a)
            kept = a if layer.needs_input else None
            self.records[i] = Record(kept, edge, a._version, a.shape[0])

        return hook


class Work(NamedTuple):
    """One layer whose output reaches the loss, as its rule takes it, and the rule's reusable
    state."""

    layer: _Layer
    a: torch.Tensor | None
    b: torch.Tensor
    state: object
    rows: int  # rows per example the rule still sums (augmentation multiplicity)


@torch.no_grad()  # only the forward pass records a graph (enable_grad in _forward)
def ghost_clipped_sum(
    model,
    layers,
    x,
    y,
    groups,
    clip_norm,
    verify: bool = False,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    out: dict | None = None,
    multiplicity: int = 1,
    weights: torch.Tensor | None = None,
    loss=None,
):
    """Σ_i clip(g_i) by ghost norms + book-keeping. Returns (grads by name, loss_sum, norms [B, k]).

    With ``multiplicity`` K > 1, x has B·K rows (K augmented copies per example, consecutive) and
    g_i is the gradient of the mean loss over example i's copies. ``weights`` [B] (None: all ones)
    multiply each example's clip factor and loss (Σ_i w_i c_i g_i, Σ_i w_i loss_i); norms
    unweighted.

    With ``out`` (a tensor per parameter name) the sums are accumulated into it in place. Every
    Unsupported is raised before the first write into ``out``, so a caller may fall back to vmap."""
    K = multiplicity
    B = x.shape[0] // K
    recs, total, loss_dtype, loss_sum = _forward(model, layers, x, y, K, weights, loss)
    order, bs = _output_grads(layers, recs, x.shape[0], total, retain=verify)
    ref = _autograd_grads(layers, total) if verify else {}
    group_of = {n: g for g, names in enumerate(groups) for n in names}
    sq, work = _squared_norms(layers, recs, order, bs, group_of, len(groups), K, budget_bytes)
    dtype = work[0].b.dtype if work else loss_dtype
    norms, factors = _norms_and_factors(sq, clip_norm, B, dtype, x.device)
    if verify:
        _check_against_autograd(layers, work, ref, B, dtype, x.device)
    if weights is not None:  # c_i ← w_i c_i: a weight-0 row adds exactly 0
        w = weights.to(device=x.device, dtype=factors[0].dtype)
        factors = tuple(f * w for f in factors)
    return _clipped_sums(layers, work, factors, group_of, x, out), loss_sum, norms


def _forward(model, layers, x, y, K: int, weights=None, loss=None):
    """One forward pass under the layers' hooks: (records, Σ_i loss_i (the autograd root), the
    logits' dtype, the reported loss: Σ_i loss_i detached, or Σ_i w_i loss_i with ``weights``).
    ``loss``: a per-example loss (``loss_rows``); None: cross-entropy."""
    capture = Capture(layers)
    with torch.enable_grad(), capture:
        logits = model(x)
        if loss is not None:  # a user's per-example loss, mean over the K copies
            rows = loss_rows(loss, logits, y if K == 1 else y.repeat_interleave(K, dim=0))
            total = rows.sum() if K == 1 else rows.sum() / K
            per_example = rows.detach() if K == 1 else rows.detach().view(-1, K).sum(1) / K
            if weights is not None:
                per_example = per_example * weights.to(per_example)
            return capture.records, total, logits.dtype, per_example.sum()
        if weights is not None:  # per-example losses, mean over the K copies
            rows = F.cross_entropy(
                logits, y if K == 1 else y.repeat_interleave(K), reduction="none"
            )
            total = rows.sum() if K == 1 else rows.sum() / K
            per_example = rows.detach() if K == 1 else rows.detach().view(-1, K).sum(1) / K
            return (
                capture.records,
                total,
                logits.dtype,
                (per_example * weights.to(per_example)).sum(),
            )
        if K == 1:
            total = F.cross_entropy(logits, y, reduction="sum")
        else:  # Σ_i mean_k ℓ(θ, x_ik)
            total = F.cross_entropy(logits, y.repeat_interleave(K), reduction="sum") / K
    return capture.records, total, logits.dtype, total.detach()


def _output_grads(layers, recs, rows: int, total, retain: bool):
    """(indices of the recorded layers whose output needs a gradient, b = ∂total/∂output for each;
    None where the output does not reach the loss). One autograd call, no weight gradient formed."""
    order = [i for i in sorted(recs) if recs[i].edge is not None]
    for i in order:
        if recs[i].input is not None and recs[i].input._version != recs[i].version:
            raise Unsupported(f"the input of {layers[i].names} was modified in place")
        if recs[i].rows != rows:
            raise Unsupported(f"module {layers[i].names} does not keep the batch in dimension 0")
    edges = [recs[i].edge for i in order]
    bs = torch.autograd.grad(total, edges, allow_unused=True, retain_graph=retain) if edges else []
    return order, bs


def _autograd_grads(layers, total) -> dict:
    """Plain autograd gradient of the same graph, by parameter name (None: no gradient)."""
    params = [p for l in layers for p in (getattr(l.module, a) for a in l.names)]
    names = [n for l in layers for n in l.names.values()]
    ref_grads = torch.autograd.grad(total, params, allow_unused=True) if params else []
    return {n: g for n, g in zip(names, ref_grads)}


def _rule_inputs(layer: _Layer, a, b, K: int):
    """(a, b, rows per example still to sum) as the layer's rule takes them: the input prepared,
    both in the dtype of the layer's parameters."""
    p0 = getattr(layer.module, next(iter(layer.names)))
    a = None if a is None else layer.prepare(a)
    if a is not None and a.is_floating_point() and a.dtype != p0.dtype:
        a = a.to(p0.dtype)
    if b.dtype != p0.dtype:
        b = b.to(p0.dtype)
    return layer.group(a, b, K)


def _squared_norms(layers, recs, order, bs, group_of: dict, k: int, K: int, budget_bytes: int):
    """Per group Σ over its tensors of ‖g_i‖² ([B]; None for a group with no gradient), and the
    layers' work for the clipped sums. Explicit per-example products are kept for reuse while
    they fit ``budget_bytes``, in layer order."""
    sq = [None] * k
    work, kept = [], 0
    for i, b in zip(order, bs):
        if b is None:  # output does not reach the loss: zero gradient
            continue
        layer = layers[i]
        a, b, k_rows = _rule_inputs(layer, recs[i].input, b, K)
        need = layer.kept_bytes(a, b)
        keep = 0 < need and kept + need <= budget_bytes
        kept += need if keep else 0
        sqn, state = layer.sq_norms(a, b, keep, k_rows)
        for attr, v in sqn.items():
            g = group_of[layer.names[attr]]
            sq[g] = v if sq[g] is None else sq[g] + v
        work.append(Work(layer, a, b, state, k_rows))
    return sq, work


def _norms_and_factors(sq, clip_norm, B: int, dtype, device):
    """(norms [B, k], per group the clip factors [B]) from the groups' squared norms."""
    if any(v is None for v in sq):  # a group with no gradient at all
        sq = [torch.zeros(B, dtype=dtype, device=device) if v is None else v for v in sq]
    if len(sq) == 1:  # global clipping: no [B, 1] round trip
        norm = sq[0].sqrt()
        return norm.unsqueeze(1), (clip_factors(norm, clip_norm),)
    norms = torch.stack(sq, 1).sqrt()
    return norms, clip_factors(norms, clip_norm).unbind(1)


def _check_against_autograd(layers, work, ref: dict, B: int, dtype, device) -> None:
    """Unclipped sums of the rules = the autograd gradient, else Unsupported: the exact-structure
    check of a first call (a parameter used outside its module's forward call shows up here)."""
    ones = torch.ones(B, dtype=dtype, device=device)
    plain = {}
    for w in work:
        for attr, g in w.layer.clipped_sum(
            w.a, w.b, w.state, {k: ones for k in w.layer.names}, K=w.rows
        ).items():
            plain[w.layer.names[attr]] = g
    for layer in layers:
        for attr, n in layer.names.items():
            p = getattr(layer.module, attr)
            g = plain.get(n, torch.zeros_like(p))
            r = ref[n] if ref[n] is not None else torch.zeros_like(p)
            if not (bool(torch.isfinite(r).all()) and bool(torch.isfinite(g).all())):
                raise ValueError(
                    f"clipped_sum: the gradient of parameter '{n}' is not finite (NaN or inf) on "
                    "this lot: an example holds a non-finite value or the loss overflowed "
                    "(check_finite=False skips the check that names the example)"
                )
            if not torch.allclose(g, r, rtol=1e-3, atol=1e-5 * (1.0 + float(r.abs().max()))):
                raise Unsupported(
                    f"parameter '{n}' receives gradient from outside its module's "
                    "forward call (e.g. weight tying or functional use)"
                )


def _clipped_sums(layers, work, factors, group_of: dict, x, out: dict | None) -> dict:
    """Σ_i c_i g_i by parameter name (book-keeping or kept products), added into ``out`` when given.
    No Unsupported from here on: this is the first write into ``out``."""
    grads = {}
    # memory -> how many of the a's, b's and the input x use it
    users = Counter(_storage(t) for w in work for t in (w.a, w.b) if t is not None)
    users[_storage(x)] += 1
    for w in work:
        layer = w.layer
        f = {attr: factors[group_of[n]] for attr, n in layer.names.items()}
        own_b = w.b.is_contiguous() and users[_storage(w.b)] == 1
        acc = None if out is None else {attr: out[n] for attr, n in layer.names.items()}
        for attr, g in layer.clipped_sum(
            w.a, w.b, w.state, f, own_b=own_b, out=acc, K=w.rows
        ).items():
            grads[layer.names[attr]] = g
    for layer in layers:  # modules not called / not reaching the loss
        for attr, n in layer.names.items():
            if n not in grads:
                grads[n] = (
                    out[n] if out is not None else torch.zeros_like(getattr(layer.module, attr))
                )
    return grads
