"""The ghost engine's rule for nn.MultiheadAttention: its projections as sequence Linear layers.

Attention mixes the positions of one example, never two examples: with the input projection
[q k v] = x W_inᵀ + b_in (per position) and the output projection y = o W_outᵀ + b_out, example i's
gradients are those of sequence Linear layers (``layers.py``), exactly:
    ∂ℓ_i/∂W_in = Σ_t δ_{i,t}ᵀ x_{i,t},   ∂ℓ_i/∂b_in = Σ_t δ_{i,t}     (δ = ∂(Σ_j ℓ_j)/∂[q k v])
and the same for W_out with the attention's output o. PyTorch's own forward
(``F.multi_head_attention_forward``) applies both projections inside one function, out of reach of
a hook, so while the ghost engine's forward pass runs the module's forward is replaced by ``forward``
below: the same function, step by step as the PyTorch source computes it (packed self-attention
projection, or separate q / kv / k, v projections on row blocks of W_in; key-padding and attention
masks merged the same way; ``is_causal``, ``add_zero_attn``, dropout on the attention weights,
``need_weights`` with per-head or averaged weights; ``batch_first`` either way), written batch
first, with the output projection called as the module ``out_proj`` (an nn.Linear: its own rule
records it). ``MultiheadAttentionLayer`` records each projection's input and the autograd edge of its
output, and forms norms and clipped sums with the sequence Linear's routes (ghost Gram form,
explicit, or kept: ``layers.norm_route``), one row block of W_in and b_in per projection.

Refused in one line (Unsupported: the exact path runs the model instead): ``add_bias_kv`` (its
bias_k and bias_v are extra key and value positions: no rule here), unbatched input.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import Layer, Unsupported, keep_pays, matmul_into, matvec_into, seq_sq_norms, sq_rows
from ..registry import register_layer


@register_layer(nn.MultiheadAttention)
class MultiheadAttentionLayer(Layer):
    """nn.MultiheadAttention's input projection (in_proj_weight and in_proj_bias, or q/k/v_proj_weight);
    its out_proj is an nn.Linear with its own rule (module doc)."""

    owns_forward = True
    needs_input = True

    def __init__(self, module: nn.MultiheadAttention, names):
        super().__init__(module, names)
        if module.bias_k is not None or module.bias_v is not None:
            raise Unsupported(
                f"{self.label}: add_bias_kv=True (bias_k and bias_v are extra key and value "
                "positions; no ghost rule for them)"
            )

    # -- the forward pass, recording the projections --------------------------------------------
    def _projections(self, q, k, v):
        """(q, k, v) projected ([B, ·, E] each) and the uses, one per linear map: (weight attr, its
        row block or None for all, bias attr, its row block or None, input, output)."""
        m, E = self.module, self.module.embed_dim
        b = m.in_proj_bias
        bias = lambda r: None if b is None else (b if r is None else b[r])
        blocks = [slice(0, E), slice(E, 2 * E), slice(2 * E, 3 * E)]
        if m._qkv_same_embed_dim:
            W = m.in_proj_weight
            if q is k and k is v:  # self-attention: one packed projection
                proj = F.linear(q, W, b)
                return proj.chunk(3, -1), [("in_proj_weight", None, "in_proj_bias", None, q, proj)]
            if k is v:  # encoder-decoder: q, then k and v packed
                kv = slice(E, 3 * E)
                qp, kvp = F.linear(q, W[:E], bias(blocks[0])), F.linear(k, W[kv], bias(kv))
                uses = [("in_proj_weight", blocks[0], "in_proj_bias", blocks[0], q, qp)]
                uses.append(("in_proj_weight", kv, "in_proj_bias", kv, k, kvp))
                return (qp, *kvp.chunk(2, -1)), uses
            maps = [("in_proj_weight", W[r], r) for r in blocks]
        else:
            maps = [(f"{n}_proj_weight", getattr(m, f"{n}_proj_weight"), None) for n in "qkv"]
        outs, uses = [], []
        for (attr, w, rows), x, block in zip(maps, (q, k, v), blocks):
            y = F.linear(x, w, bias(block))
            outs.append(y)
            uses.append((attr, rows, "in_proj_bias", block, x, y))
        return outs, uses

    def forward(
        self,
        record,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        m = self.module
        if query.dim() != 3:
            raise Unsupported(f"{self.label} got unbatched input; needs [B, T, E] or [T, B, E]")
        if m.batch_first:
            q_in, k_in, v_in = query, key, value
        else:  # [T, B, E] → [B, T, E], keeping which of them are the same tensor
            q_in = query.transpose(0, 1)
            k_in = q_in if key is query else key.transpose(0, 1)
            v_in = k_in if value is key else (q_in if value is query else value.transpose(0, 1))
        (q, k, v), uses = self._projections(q_in, k_in, v_in)
        out, weights = _attend(m, q, k, v, key_padding_mask, need_weights, attn_mask,
                               average_attn_weights, is_causal)  # fmt: skip
        y = m.out_proj(out)  # the nn.Linear's own rule records it
        kept, outs = [], []
        for w, w_rows, bias, b_rows, x, proj in uses:
            w_on, b_on = w in self.names, bias in self.names
            if not (w_on or b_on):
                continue  # frozen: neither kept nor differentiated
            kept.append((w if w_on else None, w_rows, bias if b_on else None, b_rows,
                         x if w_on else None))  # fmt: skip
            outs.append(proj)
        record(query, y, kept, outs, q_in.shape[0])
        return (y if m.batch_first else y.transpose(0, 1)), weights

    # -- the rule ------------------------------------------------------------------------------
    def inputs(self, a, b, K: int):
        """Per projection (weight attr or None, its row block, bias attr or None, its row block,
        its input [B, K·T, d] or None, its output gradient [B, K·T, p])."""
        uses = []
        for (w, w_rows, bias, b_rows, A), Bm in zip(a, b):
            n = Bm.shape[0] // K
            Bm = Bm.reshape(n, -1, Bm.shape[-1]).to(self.dtype)
            A = None if A is None else A.reshape(n, -1, A.shape[-1]).to(self.dtype)
            uses.append((w, w_rows, bias, b_rows, A, Bm))
        return uses, None, 1

    def _kept(self, A, Bm) -> bool:
        return A is not None and keep_pays(A.shape[1], A.shape[2], Bm.shape[2])

    def kept_bytes(self, a, b, K=1):
        return sum(
            A.shape[0] * A.shape[-1] * Bm.shape[-1] * Bm.element_size()
            for _, _, _, _, A, Bm in a
            if self._kept(A, Bm)
        )

    def sq_norms(self, a, b, keep, K=1):
        out, state = {}, []
        for w, _, bias, _, A, Bm in a:
            sq, G = (None, None) if w is None else seq_sq_norms(A, Bm, keep and self._kept(A, Bm))
            state.append(G)
            for attr, v in ((w, sq), (bias, None if bias is None else sq_rows(Bm.sum(1)))):
                if attr is not None:
                    out[attr] = v if attr not in out else out[attr] + v
        return out, state

    def clipped_sum(self, a, b, state, factors, own_b=False, out=None, K=1):
        out, grads = out or {}, {}
        for (w, w_rows, bias, b_rows, A, Bm), G in zip(a, state):
            for attr in (w, bias):
                if attr is not None and attr not in grads:
                    p = getattr(self.module, attr)
                    grads[attr] = out[attr] if attr in out else torch.zeros_like(p)
            if bias is not None:
                matvec_into(Bm.sum(1).t(), factors[bias], _block(grads[bias], b_rows))
            if w is None:
                continue
            acc = _block(grads[w], w_rows)
            if G is not None:  # kept per-example products
                acc.add_(torch.tensordot(factors[w], G, dims=1))
            else:  # book-keeping: (c ⊙ δ)ᵀ x over every example and position
                Bc = Bm * factors[w][:, None, None]
                matmul_into(Bc.flatten(0, 1).t(), A.flatten(0, 1), acc)
        return grads


def _block(t: torch.Tensor, rows: slice | None) -> torch.Tensor:
    return t if rows is None or (rows.start == 0 and rows.stop == t.shape[0]) else t[rows]


def _attend(m, q, k, v, key_padding_mask, need_weights, attn_mask, average_attn_weights,
            is_causal):  # fmt: skip
    """Attention of the projected q [B, T, E], k, v [B, S, E], batch first: what
    ``F.multi_head_attention_forward`` computes after its input projection (module doc). Returns
    (the heads' output [B, T, E] before out_proj, the attention weights or None)."""
    B, T, E = q.shape
    H = m.num_heads
    hd = E // H
    q = q.reshape(B, T, H, hd).transpose(1, 2)
    k = k.reshape(B, -1, H, hd).transpose(1, 2)
    v = v.reshape(B, -1, H, hd).transpose(1, 2)
    if m.add_zero_attn:  # a zero key and value appended to every example
        k = torch.cat([k, k.new_zeros(B, H, 1, hd)], dim=2)
        v = torch.cat([v, v.new_zeros(B, H, 1, hd)], dim=2)
    attn_mask, is_causal = _merged_mask(m, q, k.shape[2], key_padding_mask, need_weights,
                                        attn_mask, is_causal)  # fmt: skip
    dropout_p = m.dropout if m.training else 0.0
    if not need_weights:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        return o.transpose(1, 2).reshape(B, T, E), None
    if is_causal and attn_mask is None:
        raise AssertionError("FIXME: is_causal not implemented for need_weights")
    scores = (q * math.sqrt(1.0 / float(hd))) @ k.transpose(-2, -1)
    if attn_mask is not None:
        scores = scores + attn_mask
    w = F.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        w = F.dropout(w, p=dropout_p)
    o = (w @ v).transpose(1, 2).reshape(B, T, E)
    return o, (w.mean(dim=1) if average_attn_weights else w)


def _merged_mask(m, q, S: int, key_padding_mask, need_weights, attn_mask, is_causal):
    """(the attention mask as [B, H, T, S] or [1, 1, T, S] or None, is_causal): the key-padding
    and attention masks canonicalised and merged as ``F.multi_head_attention_forward`` merges them
    (S counts the zero key of ``add_zero_attn``, for which both masks get a column)."""
    B, H, T = q.shape[0], q.shape[1], q.shape[2]
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=q.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
            "method `generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask,
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=q.dtype,
            check_other=False,
        )
        if key_padding_mask is not None:
            is_causal = False
    S0 = S - 1 if m.add_zero_attn else S  # the keys before the zero one
    if attn_mask is not None:  # [1, T, S] or [B·H, T, S]
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (T, S0):
                raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but "
                                   f"should be {(T, S0)}.")  # fmt: skip
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            if tuple(attn_mask.shape) != (B * H, T, S0):
                raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but "
                                   f"should be {(B * H, T, S0)}.")  # fmt: skip
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
        if m.add_zero_attn:
            attn_mask = F.pad(attn_mask, (0, 1))
    if key_padding_mask is not None:
        if m.add_zero_attn:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))
        if tuple(key_padding_mask.shape) != (B, S):
            raise RuntimeError(f"expecting key_padding_mask shape of {(B, S)}, but got "
                               f"{tuple(key_padding_mask.shape)}")  # fmt: skip
        kpm = key_padding_mask.view(B, 1, 1, S).expand(-1, H, -1, -1).reshape(B * H, 1, S)
        attn_mask = kpm if attn_mask is None else attn_mask + kpm
    if attn_mask is not None:  # as [B, H, T, S] (or broadcast [1, 1, T, S])
        attn_mask = (
            attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 else attn_mask.view(B, H, -1, S)
        )
    return attn_mask, is_causal
