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

One forward pass records each layer's input a and the autograd edge of its output; one
``torch.autograd.grad`` call returns only the gradients w.r.t. those outputs (autograd never forms
the weight gradients). A first call is checked once against plain autograd (engine.py).
GroupNorm has its own exact rule (layers.py). Parameter-bearing leaf modules other than
Linear/Conv2d/GroupNorm (LayerNorm, Embedding, ...) get their per-example gradients from ``vmap``
over that module alone, using the same a and b (hybrid).

Augmentation multiplicity K (De et al. 2022): x holds B·K rows, example i's K augmented copies in
rows iK .. iK+K−1, and y holds B labels. The loss is Σ_i (1/K) Σ_k ℓ(θ, x_ik), so b carries the
1/K; each layer rule sums an example's K rows before its norm (layers.py), and the clipped sum
repeats the example's factor over its rows. One forward and one backward pass over B·K rows.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

from .layers import Conv2dLayer, GenericLayer, GroupNormLayer, LinearLayer, Unsupported, _Layer
from .clip import clip_factors

DEFAULT_BUDGET_BYTES = 64 * 2**20    # per-example products kept in memory for reuse, all layers


def build_layers(model: nn.Module) -> tuple[list[_Layer], bool]:
    """Layers for every module owning trainable parameters; (layers, all Linear/Conv2d/GroupNorm).

    Raises Unsupported when a module owns parameters and also has submodules (its forward may use
    its parameters in any way), or when a parameter is shared between modules.
    """
    layers, owner = [], {}
    native = True
    for mname, m in model.named_modules():
        names = {attr: f"{mname}.{attr}" if mname else attr
                 for attr, p in m.named_parameters(recurse=False) if p.requires_grad}
        if not names:
            continue
        for attr in names:
            pid = id(getattr(m, attr))
            if pid in owner:
                raise Unsupported(f"parameter '{names[attr]}' is shared with '{owner[pid]}'")
            owner[pid] = names[attr]
        if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward:
            layers.append(LinearLayer(m, names))
        elif isinstance(m, nn.Conv2d) and type(m).forward is nn.Conv2d.forward:
            layers.append(Conv2dLayer(m, names))
        elif isinstance(m, nn.GroupNorm) and type(m).forward is nn.GroupNorm.forward:
            layers.append(GroupNormLayer(m, names))
        elif next(m.children(), None) is None:
            layers.append(GenericLayer(m, names))
            native = False
        else:
            raise Unsupported(f"module '{mname}' ({type(m).__name__}) owns parameters and has "
                              "submodules; its forward may use its parameters in any way")
    return layers, native


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


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
        self.records: dict[int, tuple] = {}

    def __enter__(self):
        self.records.clear()
        self.handles = [l.module.register_forward_hook(self._hook(i)) for i, l in enumerate(self.layers)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False

    def _hook(self, i):
        def hook(module, args, output):
            if i in self.records:
                raise Unsupported(f"module {self.layers[i].names} is called more than once per "
                                  "forward pass")
            if len(args) != 1 or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
                raise Unsupported(f"module {self.layers[i].names} must take one tensor and return one")
            a = args[0]
            if a.dim() == 0 or output.dim() == 0 or a.shape[0] != output.shape[0]:
                raise Unsupported(f"module {self.layers[i].names} does not keep the batch in dimension 0")
            layer = self.layers[i]
            edge = get_gradient_edge(output) if output.requires_grad else None
            if edge is not None:
                layer.check_input(a)
            kept = a if layer.needs_input else None
            self.records[i] = (kept, edge, a._version, a.shape[0])
        return hook


@torch.no_grad()                     # only the forward pass records a graph (enable_grad below)
def ghost_clipped_sum(model, layers, x, y, groups, max_grad_norm, verify: bool = False,
                      budget_bytes: int = DEFAULT_BUDGET_BYTES, out: dict | None = None,
                      multiplicity: int = 1):
    """Σ_i clip(g_i) by ghost norms + book-keeping. Returns (grads by name, loss_sum, norms [B, k]).

    With ``multiplicity`` K > 1, x has B·K rows (K augmented copies per example, consecutive) and
    g_i is the gradient of the mean loss over example i's copies.

    With ``out`` (a tensor per parameter name) the sums are accumulated into it in place. Every
    Unsupported is raised before the first write into ``out``, so a caller may fall back to vmap."""
    capture = Capture(layers)
    with torch.enable_grad(), capture:
        logits = model(x)
        K = multiplicity
        if K == 1:
            total = F.cross_entropy(logits, y, reduction="sum")
        else:                                    # Σ_i mean_k ℓ(θ, x_ik)
            total = F.cross_entropy(logits, y.repeat_interleave(K), reduction="sum") / K
    recs = capture.records
    order = [i for i in sorted(recs) if recs[i][1] is not None]
    for i in order:
        if recs[i][0] is not None and recs[i][0]._version != recs[i][2]:
            raise Unsupported(f"the input of {layers[i].names} was modified in place")
        if recs[i][3] != x.shape[0]:
            raise Unsupported(f"module {layers[i].names} does not keep the batch in dimension 0")
    edges = [recs[i][1] for i in order]
    bs = torch.autograd.grad(total, edges, allow_unused=True, retain_graph=verify) if edges else []

    ref = {}
    if verify:                                  # plain autograd gradient of the same graph
        params = [p for l in layers for p in (getattr(l.module, a) for a in l.names)]
        names = [n for l in layers for n in l.names.values()]
        ref_grads = torch.autograd.grad(total, params, allow_unused=True) if params else []
        ref = {n: g for n, g in zip(names, ref_grads)}

    B = x.shape[0] // K
    group_of = {n: g for g, names in enumerate(groups) for n in names}
    sq = [None] * len(groups)                    # per group: Σ over its tensors of ‖g_i‖², [B]
    work, kept = [], 0
    for i, b in zip(order, bs):
        layer = layers[i]
        if b is None:                            # output does not reach the loss: zero gradient
            continue
        p0 = getattr(layer.module, next(iter(layer.names)))
        a = None if recs[i][0] is None else layer.prepare(recs[i][0])
        if a is not None and a.is_floating_point() and a.dtype != p0.dtype:
            a = a.to(p0.dtype)
        if b.dtype != p0.dtype:
            b = b.to(p0.dtype)
        a, b, k_rows = layer.group(a, b, K)      # k_rows: rows per example the rule still sums
        need = layer.kept_bytes(a, b)
        keep = 0 < need and kept + need <= budget_bytes
        kept += need if keep else 0
        sqn, state = layer.sq_norms(a, b, keep, k_rows)
        for attr, v in sqn.items():
            k = group_of[layer.names[attr]]
            sq[k] = v if sq[k] is None else sq[k] + v
        work.append((layer, a, b, state, k_rows))
    dtype = work[0][2].dtype if work else logits.dtype
    if any(v is None for v in sq):               # a group with no gradient at all
        sq = [torch.zeros(B, dtype=dtype, device=x.device) if v is None else v for v in sq]
    if len(sq) == 1:                             # global clipping: no [B, 1] round trip
        norm = sq[0].sqrt()
        cols, norms = (clip_factors(norm, max_grad_norm),), norm.unsqueeze(1)
    else:
        norms = torch.stack(sq, 1).sqrt()
        cols = clip_factors(norms, max_grad_norm).unbind(1)

    if verify:                                   # exact-structure check against autograd
        ones = torch.ones(B, dtype=dtype, device=x.device)
        plain = {}
        for layer, a, b, state, k_rows in work:
            for attr, g in layer.clipped_sum(a, b, state, {k: ones for k in layer.names}, K=k_rows).items():
                plain[layer.names[attr]] = g
        for layer in layers:
            for attr, n in layer.names.items():
                p = getattr(layer.module, attr)
                g = plain.get(n, torch.zeros_like(p))
                r = ref[n] if ref[n] is not None else torch.zeros_like(p)
                if not torch.allclose(g, r, rtol=1e-3, atol=1e-5 * (1.0 + float(r.abs().max()))):
                    raise Unsupported(f"parameter '{n}' receives gradient from outside its module's "
                                      "forward call (e.g. weight tying or functional use)")
    grads = {}
    # memory -> how many of the a's, b's and the input x use it
    owners = Counter(_storage(t) for _, a, b, _, _ in work for t in (a, b) if t is not None)
    owners[_storage(x)] += 1
    for layer, a, b, state, k_rows in work:        # from here on: no Unsupported, writes into out
        f = {attr: cols[group_of[n]] for attr, n in layer.names.items()}
        own_b = b.is_contiguous() and owners[_storage(b)] == 1
        acc = None if out is None else {attr: out[n] for attr, n in layer.names.items()}
        for attr, g in layer.clipped_sum(a, b, state, f, own_b=own_b, out=acc, K=k_rows).items():
            grads[layer.names[attr]] = g
    for layer in layers:                         # modules not called / not reaching the loss
        for attr, n in layer.names.items():
            if n not in grads:
                grads[n] = out[n] if out is not None else torch.zeros_like(getattr(layer.module, attr))
    return grads, total.detach(), norms
