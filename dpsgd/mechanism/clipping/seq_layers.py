"""Ghost-engine rules for the layers of sequence and transformer models: LayerNorm and Embedding
(Conv1d: rules/conv.py; nn.MultiheadAttention: rules/attention.py).

  LayerNormLayer  y = x̂ ⊙ γ + β over ``normalized_shape`` (Ba et al. 2016), x̂ per position and
                  example: example i's gradients are Σ_positions x̂_i ⊙ b_i (γ) and Σ_positions b_i
                  (β), exact, [B, *normalized_shape] each (x̂ recomputed by F.layer_norm without
                  affine from the recorded input).
  EmbeddingLayer  rows of the table looked up by the input indices: example i's gradient puts
                  b_{i,t} on row idx_{i,t}; its squared norm is Σ_{t,t'} [idx_t = idx_t'] ⟨b_t, b_t'⟩
                  (ghost form, Li et al. 2022, "Large language models can be strong differentially
                  private learners", §4), its clipped sum an index_add of c_i·b_{i,t} (book-keeping).
                  The padding row gets no gradient; ``scale_grad_by_freq`` (a token's count over the
                  whole batch: examples mix) and ``sparse`` are refused in one line.

Registered by module type (``registry.py``) like the rules of ``layers.py``; K rows per example
(augmentation multiplicity) are summed per example before the norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Unsupported, _acc, _Layer, _sq, group_rows
from .registry import register_layer


@register_layer(nn.LayerNorm)
class LayerNormLayer(_Layer):
    """nn.LayerNorm with affine parameters, on input [B, *, *normalized_shape] (module doc)."""

    def check_input(self, a):
        n = len(self.module.normalized_shape)
        if a.dim() < n + 1 or tuple(a.shape[a.dim() - n :]) != tuple(self.module.normalized_shape):
            raise Unsupported(
                f"{self.label} got input of shape {list(a.shape)}; needs "
                f"[B, *, {', '.join(map(str, self.module.normalized_shape))}]"
            )

    def prepare(self, a):
        m = self.module
        return F.layer_norm(a, m.normalized_shape, None, None, m.eps)  # x̂

    def _per_example(self, a, b, K):
        positions = tuple(range(1, b.dim() - len(self.module.normalized_shape)))

        def summed(t):
            return t.sum(positions) if positions else t

        G = {}
        if "weight" in self.names:
            G["weight"] = group_rows(summed(a * b), K)
        if "bias" in self.names:
            G["bias"] = group_rows(summed(b), K)
        return G

    def sq_norms(self, a, b, keep, K=1):
        G = self._per_example(a, b, K)
        return {attr: _sq(g.flatten(1)) for attr, g in G.items()}, G

    def clipped_sum(self, a, b, state, factors, own_b=False, out=None, K=1):
        out = out or {}
        return {
            attr: _acc(torch.tensordot(factors[attr], g, dims=1), out.get(attr))
            for attr, g in state.items()
        }


@register_layer(nn.Embedding)
class EmbeddingLayer(_Layer):
    """nn.Embedding on integer input [B, *] (module doc)."""

    def __init__(self, module: nn.Embedding, names):
        super().__init__(module, names)
        if module.scale_grad_by_freq:  # a token's count over the whole batch: examples mix
            raise ValueError(
                f"Embedding {names}: scale_grad_by_freq=True scales each token's gradient by its "
                "count in the whole batch, mixing examples (as BatchNorm does); set it to False"
            )
        if module.sparse:
            raise ValueError(
                f"Embedding {names}: sparse=True gradients are not supported; set it to False"
            )

    def check_input(self, a):
        if a.dim() < 1 or a.is_floating_point():
            raise Unsupported(f"{self.label} needs integer indices [B, *]")

    def _rows(self, a, b, K):
        """(indices [B, K·T], output gradients [B, K·T, D]) per example; the padding row's
        gradients zeroed (nn.Embedding gives that row none)."""
        n = b.shape[0] // K
        idx = a.reshape(n, -1)
        g = b.reshape(n, idx.shape[1], b.shape[-1])
        pad = self.module.padding_idx
        if pad is not None:
            g = g.masked_fill((idx == pad)[:, :, None], 0.0)
        return idx, g

    def sq_norms(self, a, b, keep, K=1):
        idx, g = self._rows(a, b, K)
        same = idx[:, :, None] == idx[:, None, :]  # [B, T, T]
        gram = torch.bmm(g, g.transpose(1, 2))
        return {"weight": (gram * same).sum((1, 2))}, (idx, g)

    def clipped_sum(self, a, b, state, factors, own_b=False, out=None, K=1):
        idx, g = state
        w = self.module.weight
        acc = torch.zeros_like(w) if (out or {}).get("weight") is None else out["weight"]
        scaled = (factors["weight"][:, None, None] * g).reshape(-1, g.shape[-1]).to(w.dtype)
        return {"weight": acc.index_add_(0, idx.reshape(-1), scaled)}
