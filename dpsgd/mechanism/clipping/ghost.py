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
from contextlib import nullcontext
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from dpsgd.mechanism import batches

from . import rnn, rules, seq_layers  # noqa: F401  (register the rules beyond layers.py)
from .clip import clip_factors, summed_loss
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


def shape_pattern(shape, rows: int, B: int) -> tuple:
    """A shape with every dimension as long as the batch named: ``"B"`` for the B·K rows, ``"b"``
    for B (augmentation multiplicity K > 1), the other dimensions as they are. Two batches whose
    shapes have the same pattern differ only in their batch size; a dimension that merely equals
    the batch size gets another pattern (and with it another proof, ``proof.py``)."""
    return tuple("B" if d == rows else "b" if d == B else int(d) for d in shape)


class Record(NamedTuple):
    """What the forward hook of one layer keeps."""

    input: object  # the layer's input a when its rule reads it (``needs_input``); an owned forward:
    # its payload for the rule (``RNNLayer``)
    edge: object  # autograd edge of its output; None when the output needs no gradient; an owned
    # forward: a list of (edge or None, shape, dtype, device), one per output its rule needs
    version: int | None  # a._version at the call (a later in-place change is refused)
    rows: int  # the batch size the layer saw (a.shape[0])


class Capture:
    """Forward hooks recording each layer's input and the autograd edge of its output, and the
    shapes and dtypes of every layer call (``signature``).

    Only the gradient edge of the output is kept (not the output tensor), so outputs are freed
    as in a plain forward pass, and the gradient w.r.t. the module's output is exact even when a
    later operation modifies the output in place (e.g. ReLU(inplace=True)).

    Hooks go on the layers only, i.e. on modules owning trainable parameters: a frozen module
    (all parameters requires_grad=False) is neither hooked nor recorded, and its activations are
    kept only if autograd needs them to reach a trainable layer below it. A layer whose weight is
    frozen and bias trained records its input's batch size, not the input (``needs_input``).
    A rule that ``owns_forward`` (recurrent layers, ``rnn.py``) replaces its module's forward while
    the capture is open and records what it needs itself.

    A layer called on one row that the whole batch shares (``rows`` > 1 rows in the batch, an input
    and output of one row: the position embeddings of a transformer, ``wpe(position_ids[None])``,
    broadcast onto every example) gets its input and output expanded to the batch's rows (views,
    no copy): the output's rows are then the examples' own uses of it, and its per-example
    gradients those of the rows. The proof (proof.py) checks that the expanded forward is the
    model's (the same losses, and the rules' sums against autograd of the model as it is).
    """

    def __init__(self, layers: list[_Layer], rows: int | None = None):
        self.layers = layers
        self.rows = rows  # the batch's rows (None: nothing is expanded)
        self.records: dict[int, Record] = {}
        self.calls: list[tuple] = []  # (layer, input shape, dtype, output shape, dtype), in order
        self.expanded: list[int] = []  # layers whose one shared row was expanded to the batch

    def __enter__(self):
        self.records.clear()
        self.calls.clear()
        self.expanded.clear()
        self.handles, self.swapped = [], []
        for i, l in enumerate(self.layers):
            if l.owns_forward:
                self.swapped.append((l.module, l.module.__dict__.get("forward")))
                l.module.forward = partial(l.forward, self._recorder(i))
            else:
                self.handles.append(l.module.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        for m, old in self.swapped:
            if old is None:
                del m.forward
            else:
                m.forward = old
        return False

    def signature(self, rows: int, B: int) -> tuple:
        """The layer calls of the forward pass, each as (layer, input shape pattern, dtype, output
        shape pattern, dtype) (``shape_pattern``), in call order."""
        return tuple(
            (i, shape_pattern(si, rows, B), di, shape_pattern(so, rows, B), do)
            for i, si, di, so, do in self.calls
        )

    def _once(self, i):
        if i in self.records:
            raise Unsupported(f"{self.layers[i].label} is called more than once per forward pass")

    def _hook(self, i):
        def hook(module, args, output):
            self._once(i)
            if (
                len(args) != 1
                or not isinstance(args[0], torch.Tensor)
                or not isinstance(output, torch.Tensor)
            ):
                raise Unsupported(f"{self.layers[i].label} must take one tensor and return one")
            a = args[0]
            if a.dim() == 0 or output.dim() == 0 or a.shape[0] != output.shape[0]:
                raise Unsupported(f"{self.layers[i].label} does not keep the batch in dimension 0")
            call = (i, tuple(a.shape), a.dtype, tuple(output.shape), output.dtype)
            shared = self.rows is not None and self.rows > 1 and a.shape[0] == 1
            if shared:  # one row the batch shares: expanded to the batch's rows (class doc)
                a = a.expand(self.rows, *a.shape[1:])
                output = output.expand(self.rows, *output.shape[1:])
                self.expanded.append(i)
            layer = self.layers[i]
            edge = get_gradient_edge(output) if output.requires_grad else None
            if edge is not None:
                layer.check_input(a)
            kept = a if layer.needs_input else None
            self.records[i] = Record(kept, edge, a._version, a.shape[0])
            self.calls.append(call)
            return output if shared else None

        return hook

    def _recorder(self, i):
        def record(input, output, payload, outs, rows: int):
            self._once(i)
            edges = [
                (get_gradient_edge(o) if o.requires_grad else None, o.shape, o.dtype, o.device)
                for o in outs
            ]
            self.records[i] = Record(payload, edges or None, None, rows)
            self.calls.append(
                (i, tuple(input.shape), input.dtype, tuple(output.shape), output.dtype)
            )

        return record


class Work(NamedTuple):
    """One layer whose output reaches the loss, as its rule takes it, and the rule's reusable
    state."""

    layer: _Layer
    a: object  # its input as the rule takes it (``_Layer.inputs``)
    b: object  # its output gradient as the rule takes it
    state: object
    rows: int  # rows per example the rule still sums (augmentation multiplicity)
    dtype: torch.dtype  # of its parameters: the dtype of its per-example norms


@torch.no_grad()  # only the forward pass records a graph (enable_grad in _forward)
def ghost_clipped_sum(
    model,
    layers,
    x,
    y,
    groups,
    clip_norm,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    out: dict | None = None,
    multiplicity: int = 1,
    weights: torch.Tensor | None = None,
    loss=None,
    check=None,
    autocast=None,
):
    """Σ_i clip(g_i) by ghost norms + book-keeping. Returns (grads by name, loss_sum, norms [B, k]).

    With ``multiplicity`` K > 1, x has B·K rows (K augmented copies per example, consecutive) and
    g_i is the gradient of the mean loss over example i's copies. ``y`` None: ``x`` is a batch
    (``dpsgd.mechanism.batches``: tensors with the examples in dimension 0) and ``loss`` the user's
    ``loss(model, batch)``. ``weights`` [B] (None: all ones) multiply each example's clip factor and
    loss (Σ_i w_i c_i g_i, Σ_i w_i loss_i); norms unweighted. ``check(signature)`` is called after
    the forward pass (``Capture.signature``): the engine proves a new signature there (proof.py),
    and may raise. ``autocast``: a context the forward pass runs in (mixed precision); the rules
    compute the norms and sums in the parameters' dtype.

    With ``out`` (a tensor per parameter name) the sums are accumulated into it in place. Every
    Unsupported is raised before the first write into ``out``, so a caller may fall back to vmap."""
    K = multiplicity
    n = x.shape[0] if y is not None else batches.rows(x)  # the rows the model sees
    B = n // K
    capture, total, loss_dtype, loss_sum = _forward(model, layers, x, y, K, weights, loss, autocast)
    check_records(layers, capture.records, n)
    if check is not None:
        check(capture.signature(n, B))
    order, bs = output_grads(capture.records, total)
    group_of = {n: g for g, names in enumerate(groups) for n in names}
    sq, work = _squared_norms(
        layers, capture.records, order, bs, group_of, len(groups), K, budget_bytes
    )
    dtype = work[0].dtype if work else loss_dtype
    device = batches.device_of(x)
    norms, factors = _norms_and_factors(sq, clip_norm, B, dtype, device)
    if weights is not None:  # c_i ← w_i c_i: a weight-0 row adds exactly 0
        w = weights.to(device=device, dtype=factors[0].dtype)
        factors = tuple(f * w for f in factors)
    return _clipped_sums(layers, work, factors, group_of, x, out), loss_sum, norms


def _forward(model, layers, x, y, K: int, weights=None, loss=None, autocast=None):
    """One forward pass under the layers' hooks: (the capture, Σ_i loss_i (the autograd root), the
    logits' dtype, the reported loss: Σ_i loss_i detached, or Σ_i w_i loss_i with ``weights``).
    ``loss``: a per-example loss (``loss_rows``); None: cross-entropy; ``y`` None: ``loss(model,
    x)`` on a batch (``clip.summed_loss``)."""
    capture = Capture(layers, x.shape[0] if y is not None else batches.rows(x))
    with torch.enable_grad(), capture, autocast or nullcontext():
        total, dtype, reported = summed_loss(model, x, y, K, weights, loss)
    return capture, total, dtype, reported


def check_records(layers, recs, rows: int) -> None:
    """Unsupported where a recorded layer saw another batch size, or its input was modified in
    place after the call."""
    for i in sorted(recs):
        r = recs[i]
        if r.edge is None:
            continue
        if r.version is not None and r.input is not None and r.input._version != r.version:
            raise Unsupported(f"the input of {layers[i].label} was modified in place")
        if r.rows != rows:
            raise Unsupported(f"{layers[i].label} does not keep the batch in dimension 0")


def output_grads(recs, total, retain: bool = False):
    """(indices of the recorded layers whose output needs a gradient, b = ∂total/∂output for each;
    None where the output does not reach the loss; a list for an owned forward, zeros where one of
    its outputs does not). One autograd call, no weight gradient formed."""
    order = [i for i in sorted(recs) if recs[i].edge is not None]
    flat, spans = [], []
    for i in order:
        e = recs[i].edge
        if isinstance(e, list):
            live = [k for k, o in enumerate(e) if o[0] is not None]
            spans.append((len(flat), live))
            flat += [e[k][0] for k in live]
        else:
            spans.append((len(flat), None))
            flat.append(e)
    gs = torch.autograd.grad(total, flat, allow_unused=True, retain_graph=retain) if flat else []
    bs = []
    for i, (start, live) in zip(order, spans):
        if live is None:
            bs.append(gs[start])
            continue
        got = dict(zip(live, gs[start : start + len(live)]))
        bs.append(
            [
                got[k] if got.get(k) is not None else torch.zeros(shape, dtype=dt, device=dev)
                for k, (_, shape, dt, dev) in enumerate(recs[i].edge)
            ]
        )
    return order, bs


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
        a, b, k_rows = layer.inputs(recs[i].input, b, K)
        need = layer.kept_bytes(a, b, k_rows)
        keep = 0 < need and kept + need <= budget_bytes
        kept += need if keep else 0
        sqn, state = layer.sq_norms(a, b, keep, k_rows)
        for attr, v in sqn.items():
            g = group_of[layer.names[attr]]
            sq[g] = v if sq[g] is None else sq[g] + v
        work.append(Work(layer, a, b, state, k_rows, layer.dtype))
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


def _clipped_sums(layers, work, factors, group_of: dict, x, out: dict | None) -> dict:
    """Σ_i c_i g_i by parameter name (book-keeping or kept products), added into ``out`` when given.
    No Unsupported from here on: this is the first write into ``out``."""
    grads = {}
    # memory -> how many of the a's, b's and the input x use it
    users = Counter(_storage(t) for w in work for t in (w.a, w.b) if isinstance(t, torch.Tensor))
    for t in batches.leaves(x):
        users[_storage(t)] += 1
    for w in work:
        layer = w.layer
        f = {attr: factors[group_of[n]] for attr, n in layer.names.items()}
        own_b = isinstance(w.b, torch.Tensor) and w.b.is_contiguous() and users[_storage(w.b)] == 1
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
