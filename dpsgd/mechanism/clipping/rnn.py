"""Recurrent layers (nn.RNN, nn.GRU, nn.LSTM) in both engines: the recurrence unrolled in time.

PyTorch's fused recurrent kernels return neither the gate pre-activations nor the hidden states a
per-example rule needs, and ``torch.func.vmap`` cannot batch them (a batch-of-1 call ends in a
torch-internal broadcast error). Opacus' DPLSTM/DPGRU answer is to rewrite the cell with linear
layers; here the module keeps its parameters and only its forward is replaced, while an engine runs,
by ``unrolled``: the equations of the PyTorch documentation step by step (gate order r, z, n for the
GRU; i, f, g, o for the LSTM; ``proj_size``, ``bidirectional``, ``num_layers`` with dropout between
layers, ``batch_first`` both ways, a given initial state), the same function in exact arithmetic.

Each weight is then an ordinary linear map applied at every step, so example i's gradient is a
sequence Linear's (``layers.py``): with δ the gradient of the summed loss w.r.t. its output,
    ∂ℓ_i/∂W_ih = Σ_t δgi_{i,t} x_{i,t}ᵀ,   ∂ℓ_i/∂W_hh = Σ_t δgh_{i,t} h_{i,t−1}ᵀ,   ∂ℓ_i/∂W_hr = Σ_t δh_{i,t} m_{i,t}ᵀ
(biases: Σ_t δ), exact also for the GRU, whose n gate multiplies W_hn h + b_hn by r: the rule
differentiates w.r.t. the whole hh projection, and autograd carries the r. ``RNNLayer`` records
x, the stacked h_{t−1} (and m_t = o ⊙ tanh(c_t) under projection) and the autograd edges of every
projection, and forms norms and clipped sums with the sequence Linear's ghost/explicit rule.
``unrolled_rnns`` puts the same forward under the exact per-example path (vmap).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from .layers import Unsupported, _acc, _Layer, _mv, _seq_sq_norms, _sq
from .registry import register_layer

_GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "GRU": 3, "LSTM": 4}
_FORWARDS = (nn.RNN.forward, nn.GRU.forward, nn.LSTM.forward)


def _cell(mode: str, gi, gh, h, c):
    """One step from the input and hidden projections gi, gh ([B, G·H]): (new h, new c)."""
    if mode == "RNN_TANH":
        return torch.tanh(gi + gh), None
    if mode == "RNN_RELU":
        return torch.relu(gi + gh), None
    if mode == "GRU":
        i_r, i_z, i_n = gi.chunk(3, 1)
        h_r, h_z, h_n = gh.chunk(3, 1)
        r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h, None
    i, f, g, o = (gi + gh).chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def unrolled(m: nn.RNNBase, input, hx=None, uses: list | None = None):
    """``m(input, hx)`` step by step (module doc). ``uses``: a list that receives, per linear map,
    (weight attr, bias attr or None, its input [B, T, ·], its outputs) for ``RNNLayer``."""
    if m.mode not in _GATES:
        raise Unsupported(f"{type(m).__name__} mode {m.mode!r} has no unrolled form")
    batched = input.dim() == 3  # unbatched: [T, in], whatever batch_first says
    if batched:
        x = input if m.batch_first else input.transpose(0, 1)  # [B, T, in]
    else:
        x = input.unsqueeze(0)
    B, T = x.shape[:2]
    D, L, H = (2 if m.bidirectional else 1), m.num_layers, m.hidden_size
    P = m.proj_size or H  # the size of h
    lstm = m.mode == "LSTM"
    if hx is None:
        h0 = x.new_zeros(L * D, B, P)
        c0 = x.new_zeros(L * D, B, H) if lstm else None
    else:
        h0, c0 = hx if lstm else (hx, None)
        if not batched:
            h0, c0 = h0.unsqueeze(1), None if c0 is None else c0.unsqueeze(1)
    layer_in, h_n, c_n = x, [], []
    for layer in range(L):
        outs = []
        for d in range(D):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh = getattr(m, "weight_ih" + sfx), getattr(m, "weight_hh" + sfx)
            b_ih = getattr(m, "bias_ih" + sfx) if m.bias else None
            b_hh = getattr(m, "bias_hh" + sfx) if m.bias else None
            w_hr = getattr(m, "weight_hr" + sfx) if m.proj_size else None
            gi = F.linear(layer_in, w_ih, b_ih)  # [B, T, G·H]: every step's input projection
            h, c = h0[layer * D + d], (c0[layer * D + d] if lstm else None)
            prev, ghs, mids, hs = [], [], [], []
            out_t = [None] * T
            for t in range(T - 1, -1, -1) if d else range(T):
                gh = F.linear(h, w_hh, b_hh)
                prev.append(h)
                ghs.append(gh)
                h, c = _cell(m.mode, gi[:, t], gh, h, c)
                if w_hr is not None:
                    mids.append(h)
                    h = F.linear(h, w_hr)
                    hs.append(h)
                out_t[t] = h
            if uses is not None:
                uses.append(("weight_ih" + sfx, "bias_ih" + sfx, layer_in, [gi]))
                uses.append(("weight_hh" + sfx, "bias_hh" + sfx, torch.stack(prev, 1), ghs))
                if w_hr is not None:
                    uses.append(("weight_hr" + sfx, None, torch.stack(mids, 1), hs))
            outs.append(torch.stack(out_t, 1))
            h_n.append(h)
            c_n.append(c)
        layer_in = outs[0] if D == 1 else torch.cat(outs, 2)
        if layer < L - 1 and m.dropout and m.training:
            layer_in = F.dropout(layer_in, m.dropout, True)
    h_n = torch.stack(h_n)
    c_n = torch.stack(c_n) if lstm else None
    if batched:
        out = layer_in if m.batch_first else layer_in.transpose(0, 1)
    else:
        out = layer_in.squeeze(0)
        h_n, c_n = h_n.squeeze(1), None if c_n is None else c_n.squeeze(1)
    return out, ((h_n, c_n) if lstm else h_n)


def _forward(m: nn.RNNBase, input, hx=None):
    """The module's forward under an engine: unrolled, or its own for a PackedSequence."""
    if isinstance(input, PackedSequence):
        return type(m).forward(m, input, hx)
    return unrolled(m, input, hx)


@contextmanager
def unrolled_rnns(model: nn.Module):
    """Every nn.RNN/GRU/LSTM of ``model`` runs ``unrolled`` inside (vmap can batch it), and
    torch.func's "performance drop" notes on ops without a batching rule are not repeated (the
    engine says what the exact path costs, once)."""
    swapped = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not")
        try:
            for m in model.modules():
                if type(m).forward in _FORWARDS:  # a subclass's own forward is left alone
                    swapped.append((m, m.__dict__.get("forward")))
                    m.forward = partial(_forward, m)
            yield model
        finally:
            for m, old in swapped:
                if old is None:
                    del m.forward
                else:
                    m.forward = old


@register_layer(nn.RNN, nn.GRU, nn.LSTM)
class RNNLayer(_Layer):
    """nn.RNN, nn.GRU and nn.LSTM with trainable weights (module doc): the module's forward is
    replaced by the recording ``unrolled`` while the ghost engine's forward pass runs."""

    owns_forward = True
    needs_input = True

    def forward(self, record, input, hx=None):
        m = self.module
        if isinstance(input, PackedSequence) or input.dim() != 3:
            what = "a PackedSequence" if isinstance(input, PackedSequence) else "unbatched input"
            raise Unsupported(f"{self.label} got {what}; needs [B, T, d]")
        uses = []
        out, h = unrolled(m, input, hx, uses)
        kept, outs = [], []
        for w, b, a, ys in uses:
            if w not in self.names and b not in self.names:
                continue  # frozen: neither kept nor differentiated
            kept.append((w, b, a if w in self.names else None, len(ys)))
            outs += ys
        record(input, out, kept, outs, input.shape[0 if m.batch_first else 1])
        return out, h

    def inputs(self, a, b, K: int):
        """Per linear map (weight attr, bias attr, its input [B, K·T, ·] or None, its output
        gradient [B, K·T, ·]) from the recorded maps ``a`` and the output gradients ``b``."""
        uses, it = [], iter(b)
        for w, bias, A, n_out in a:
            grads = [next(it) for _ in range(n_out)]
            Bm = grads[0] if len(grads) == 1 else torch.stack(grads, 1)
            if K > 1:
                n = Bm.shape[0] // K
                Bm = Bm.reshape(n, -1, Bm.shape[-1])
                A = None if A is None else A.reshape(n, -1, A.shape[-1])
            uses.append((w, bias, A, Bm))
        return uses, None, 1

    def kept_bytes(self, a, b, K=1):
        return sum(
            A.shape[0] * A.shape[-1] * Bm.shape[-1] * Bm.element_size()
            for w, _, A, Bm in a
            if w in self.names
        )

    def sq_norms(self, a, b, keep, K=1):
        out, state = {}, {}
        for w, bias, A, Bm in a:
            if w in self.names:
                out[w], state[w] = _seq_sq_norms(A, Bm, keep)
            if bias in self.names:
                out[bias] = _sq(Bm.sum(1))
        return out, state

    def clipped_sum(self, a, b, state, factors, own_b=False, out=None, K=1):
        out, grads = out or {}, {}
        for w, bias, A, Bm in a:
            if bias in self.names:
                grads[bias] = _mv(Bm.sum(1).t(), factors[bias], out.get(bias))
            if w not in self.names:
                continue
            if state.get(w) is not None:  # kept per-example products
                grads[w] = _acc(torch.tensordot(factors[w], state[w], dims=1), out.get(w))
            else:  # book-keeping: (c ⊙ δ)ᵀ a over every example and step
                Bc = Bm * factors[w][:, None, None]
                g = Bc.flatten(0, 1).t() @ A.flatten(0, 1)
                grads[w] = _acc(g, out.get(w))
        return grads
