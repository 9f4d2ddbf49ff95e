"""nn.MultiheadAttention in the ghost engine (dpsgd/mechanism/clipping/rules/attention.py).

The rule's forward must be the module's own function (every option it supports: self-attention,
encoder-decoder and separate q/k/v inputs, kdim/vdim, masks of both kinds and shapes, is_causal,
add_zero_attn, need_weights averaged or per head, batch_first both ways), and ghost = the float64
batch-of-1 loop (tests/dp_reference.py) on models built from it, on every norm route
(``layers.ROUTE``) and both memory budgets. float64 throughout: relative error reduction_rtol(P),
P the gradient's entries (every value is reduced over at most P terms).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dp_reference import assert_close, loop_clipped_sum
from dpsgd.mechanism.clipping import PerExampleClipper, layers
from dpsgd.mechanism.clipping.layers import GenericLayer
from dpsgd.mechanism.clipping.rules.attention import MultiheadAttentionLayer
from tolerances import assert_f64_close, reduction_rtol

DT = torch.float64
C = 0.05  # every example clipped: a wrong row grouping changes the sum
E, HEADS, V, NCLS = 8, 2, 13, 3


def _replayed(mha, *args, **kw):
    """The rule's forward on ``args`` (what the ghost engine runs), recording nothing."""
    rule = MultiheadAttentionLayer(mha, {n: n for n, _ in mha.named_parameters(recurse=False)})
    return rule.forward(lambda *a: None, *args, **kw)


def _masks(B, T, S, kind):
    g = torch.Generator().manual_seed(1)
    if kind == "none":
        return {}
    if kind == "causal":
        return {"attn_mask": nn.Transformer.generate_square_subsequent_mask(T, dtype=DT),
                "is_causal": True}  # fmt: skip
    kpm = torch.rand(B, S, generator=g) < 0.3
    kpm[:, 0] = False  # every query keeps a key
    if kind == "kpm_bool":
        return {"key_padding_mask": kpm}
    if kind == "kpm_float_2d":
        return {"key_padding_mask": kpm.to(DT) * -1e4, "attn_mask": torch.randn(T, S, generator=g,
                dtype=DT)}  # fmt: skip
    if kind == "bool_3d":
        m = torch.rand(B * HEADS, T, S, generator=g) < 0.3
        m[..., 0] = False
        return {"attn_mask": m}
    raise KeyError(kind)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("inputs", ["self", "enc_dec", "separate", "kvdim"])
@pytest.mark.parametrize("masks", ["none", "causal", "kpm_bool", "kpm_float_2d", "bool_3d"])
@pytest.mark.parametrize("weights", [(False, True), (True, True), (True, False)])
def test_the_replayed_forward_is_the_modules(batch_first, inputs, masks, weights):
    need_weights, average = weights
    torch.manual_seed(0)
    kv = 5 if inputs == "kvdim" else None
    mha = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, kdim=kv, vdim=kv).to(DT)
    B, T, S = 3, 4, (4 if inputs == "self" else 6)
    q = torch.randn(B, T, E, dtype=DT)
    k = q if inputs == "self" else torch.randn(B, S, kv or E, dtype=DT)
    v = k if inputs in ("self", "enc_dec") else torch.randn(B, S, kv or E, dtype=DT)
    if not batch_first:
        q, k, v = (q.transpose(0, 1), *(t if t is q else t.transpose(0, 1) for t in (k, v)))
        k = q if inputs == "self" else k
        v = k if inputs in ("self", "enc_dec") else v
    kw = dict(_masks(B, T, S, masks if inputs == "self" or masks != "causal" else "none"))
    kw.update(need_weights=need_weights, average_attn_weights=average)
    if kw.get("is_causal") and need_weights and "key_padding_mask" not in kw:
        kw.pop("is_causal")  # PyTorch's own forward has no is_causal with need_weights
    want = mha(q, k, v, **kw)
    got = _replayed(mha, q, k, v, **kw)
    tol = reduction_rtol(sum(p.numel() for p in mha.parameters()) + q.numel() * 4)
    assert_f64_close(got[0], want[0], tol)
    assert (got[1] is None) == (want[1] is None)
    if want[1] is not None:
        assert_f64_close(got[1], want[1], tol)


def test_add_zero_attn_and_no_bias_replay_the_module():
    torch.manual_seed(0)
    for kw in ({"add_zero_attn": True}, {"bias": False}):
        mha = nn.MultiheadAttention(E, HEADS, batch_first=True, **kw).to(DT)
        x = torch.randn(3, 5, E, dtype=DT)
        kpm = torch.zeros(3, 5, dtype=torch.bool)
        kpm[1, 3:] = True
        want = mha(x, x, x, key_padding_mask=kpm)
        got = _replayed(mha, x, x, x, key_padding_mask=kpm)
        tol = reduction_rtol(sum(p.numel() for p in mha.parameters()) + x.numel() * 4)
        assert_f64_close(got[0], want[0], tol)
        assert_f64_close(got[1], want[1], tol)


class Encoder(nn.Module):
    """Embedding → nn.TransformerEncoder (batch_first) → mean → Linear, padding masked."""

    def __init__(self, norm_first=False):
        super().__init__()
        self.emb = nn.Embedding(V, E, padding_idx=0)
        layer = nn.TransformerEncoderLayer(E, HEADS, 16, dropout=0.0, batch_first=True,
                                           norm_first=norm_first)  # fmt: skip
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(E, NCLS)

    def forward(self, idx):
        return self.head(self.enc(self.emb(idx), src_key_padding_mask=idx == 0).mean(1))


class CrossAttention(nn.Module):
    """Queries from one sequence, keys and values from another of other width (kdim = vdim)."""

    def __init__(self, batch_first=True):
        super().__init__()
        self.bf = batch_first
        self.q, self.kv = nn.Embedding(V, E), nn.Embedding(V, 5)
        self.att = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, kdim=5, vdim=5)
        self.head = nn.Linear(E, NCLS)

    def forward(self, idx):
        q, kv = self.q(idx), self.kv(idx.flip(1))
        if not self.bf:
            q, kv = q.transpose(0, 1), kv.transpose(0, 1)
        out = self.att(q, kv, kv, need_weights=False)[0]
        return self.head((out if self.bf else out.transpose(0, 1)).mean(1))


@pytest.mark.parametrize("build", [Encoder, lambda: Encoder(True), CrossAttention,
                                   lambda: CrossAttention(False)])  # fmt: skip
@pytest.mark.parametrize("route", [None, "ghost", "explicit"])
@pytest.mark.parametrize("budget", [0, 2**30])
def test_ghost_equals_the_batch_of_one_loop(build, route, budget, monkeypatch):
    monkeypatch.setattr(layers, "ROUTE", route)
    torch.manual_seed(0)
    model = build().to(DT)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(1, V, (6, 5), generator=g)
    x[0, 3:] = 0  # padding
    y = torch.randint(0, NCLS, (6,), generator=g)
    for clipping in ("global", "per_layer"):
        ghost = PerExampleClipper(model, C, clipping, "ghost", memory_budget_bytes=budget)
        assert ghost.native and not any(isinstance(l, GenericLayer) for l in ghost._layers)
        got = ghost.clipped_sum(x, y)
        ref, norms = loop_clipped_sum(model, x, y, ghost.groups, C)
        assert_close(got.grads, ref)
        assert_f64_close(got.norms, norms, reduction_rtol(sum(t.numel() for t in ref.values())))


def test_frozen_projection_and_augmentation_multiplicity():
    """in_proj frozen (out_proj trained), and K = 2 rows per example: still the loop's sums."""
    torch.manual_seed(0)
    model = Encoder().to(DT)
    for layer in model.enc.layers:
        layer.self_attn.in_proj_weight.requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(1, V, (10, 5), generator=g)
    y = torch.randint(0, NCLS, (5,), generator=g)
    ghost = PerExampleClipper(model, C, "per_layer", "ghost")
    got = ghost.clipped_sum(x, y, multiplicity=2)
    ref, _ = loop_clipped_sum(model, x, y, ghost.groups, C, K=2)
    assert_close(got.grads, ref)
