"""Ghost-engine rules for the layers of sequence and transformer models: LayerNorm, RMSNorm and
Embedding (Conv1d: rules/conv.py; nn.MultiheadAttention: rules/attention.py).

  LayerNormLayer  y = x̂ ⊙ γ + β over ``normalized_shape`` (Ba et al. 2016), x̂ per position and
                  example: example i's gradients are Σ_positions x̂_i ⊙ b_i (γ) and Σ_positions b_i
                  (β), exact, [B, *normalized_shape] each (x̂ recomputed by F.layer_norm without
                  affine from the recorded input).
  RMSNormLayer    nn.RMSNorm (Zhang & Sennrich 2019): y = x̂ ⊙ γ, x̂ = x / √(mean(x²) + ε) over
                  ``normalized_shape``; example i's gradient Σ_positions x̂_i ⊙ b_i, exact (x̂ by
                  F.rms_norm without weight).
  ScaledNormLayer the RMSNorm classes of Hugging Face models (one per family: ``LlamaRMSNorm``
                  y = w ⊙ x̂, ``GemmaRMSNorm`` y = (1 + w) ⊙ x̂, each with its own casts), matched
                  by structure (``registry.register_structural``): a leaf named *RMSNorm owning one
                  1-D ``weight``. Its rule assumes y is affine in w feature by feature, so that
                  ∂y/∂w = y(w = 1) − y(w = 0) (the module's own forward twice, its casts included:
                  exact in floating point for both forms above), and example i's gradient is
                  Σ_positions (∂y/∂w)_i ⊙ b_i; the proof (proof.py) checks that assumption against
                  autograd on the first call of each input signature, before the rule runs.
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
from torch.func import functional_call

from .layers import Unsupported, _acc, _Layer, _sq, group_rows
from .registry import register_layer, register_structural


@register_layer(nn.LayerNorm)
class LayerNormLayer(_Layer):
    """nn.LayerNorm with affine parameters, on input [B, *, *normalized_shape] (module doc)."""

    @property
    def shape(self) -> tuple:
        """The trailing dimensions normalised (and the shape of the weight)."""
        return tuple(self.module.normalized_shape)

    def check_input(self, a):
        n = len(self.shape)
        if a.dim() < n + 1 or tuple(a.shape[a.dim() - n :]) != self.shape:
            raise Unsupported(
                f"{self.label} got input of shape {list(a.shape)}; needs "
                f"[B, *, {', '.join(map(str, self.shape))}]"
            )

    def prepare(self, a):
        m = self.module
        return F.layer_norm(a, m.normalized_shape, None, None, m.eps)  # x̂

    def _per_example(self, a, b, K):
        positions = tuple(range(1, b.dim() - len(self.shape)))

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


@register_layer(nn.RMSNorm)
class RMSNormLayer(LayerNormLayer):
    """nn.RMSNorm with a weight, on input [B, *, *normalized_shape] (module doc)."""

    def prepare(self, a):
        m = self.module
        return F.rms_norm(a, m.normalized_shape, None, m.eps)  # x̂ (eps None: finfo(a).eps)


def hf_rms_norm(module: nn.Module) -> bool:
    """A Hugging Face RMSNorm (``LlamaRMSNorm``, ``GemmaRMSNorm``, ...): a leaf module whose class
    name ends in RMSNorm and whose only trainable parameter is a 1-D ``weight``."""
    params = dict(module.named_parameters(recurse=False))
    return (
        type(module).__name__.endswith("RMSNorm")
        and next(module.children(), None) is None
        and list(params) == ["weight"]
        and params["weight"].dim() == 1
    )


@register_structural(hf_rms_norm)
class ScaledNormLayer(LayerNormLayer):
    """A Hugging Face RMSNorm on input [B, *, D] (module doc): ∂y/∂w from its own forward."""

    @property
    def shape(self) -> tuple:
        return tuple(self.module.weight.shape)

    def prepare(self, a):
        m, w = self.module, self.module.weight
        with torch.no_grad():  # y(w = 1) − y(w = 0): x̂ (Llama) or (Gemma's 2x̂) − x̂, exactly
            one = functional_call(m, {"weight": torch.ones_like(w)}, (a,))
            return one - functional_call(m, {"weight": torch.zeros_like(w)}, (a,))


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
