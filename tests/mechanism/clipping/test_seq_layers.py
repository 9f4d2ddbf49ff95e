"""LayerNorm and Embedding in the ghost engine (dpsgd/mechanism/clipping/seq_layers.py): the rules
equal the vmap reference and a batch-of-1 autograd loop, in float64, for both clippings and memory
budgets, with a padding row, repeated tokens and augmentation rows; the Embedding options that mix
examples or go sparse refused."""

import pytest
import torch
from torch import nn

from dp_reference import assert_close, loop_clipped_sum
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.mechanism.clipping.layers import GenericLayer
from dpsgd.mechanism.clipping.seq_layers import EmbeddingLayer, LayerNormLayer
from tolerances import assert_f64_close, f64_rtol

DT = torch.float64
C = 0.05  # every example clipped in some group
V, D, T = 12, 6, 5  # vocabulary, width, tokens per example


class TinyLM(nn.Module):
    """Embedding (padding row 0) → LayerNorm → Linear per token → LayerNorm over [T, D] → Linear."""

    def __init__(self, **emb):
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=0, **emb)
        self.ln = nn.LayerNorm(D)
        self.mix = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm((T, D))
        self.head = nn.Linear(T * D, 4)

    def forward(self, x):
        h = self.mix(self.ln(self.emb(x)))
        return self.head(torch.tanh(self.ln2(h)).flatten(1))


def data(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, (n, T), generator=g)  # a small vocabulary: repeated tokens, padding
    x[0, :2] = 0  # padding tokens (an all-padding example has no gradient: the loop divides by 0)
    return x, torch.randint(0, 4, (n,), generator=g)


@pytest.mark.parametrize("clipping", ["global", "per_layer"])
@pytest.mark.parametrize("budget", [0, 2**30])
def test_ghost_equals_vmap_and_loop(clipping, budget):
    torch.manual_seed(0)
    model = TinyLM().to(DT)
    x, y = data()
    ghost = PerExampleClipper(model, C, clipping, "ghost", memory_budget_bytes=budget)
    kinds = [type(l) for l in ghost._layers]
    assert kinds.count(LayerNormLayer) == 2 and kinds.count(EmbeddingLayer) == 1
    assert GenericLayer not in kinds and ghost.native
    r_g = ghost.clipped_sum(x, y)
    r_v = PerExampleClipper(model, C, clipping, "vmap").clipped_sum(x, y)
    ref, ref_norms = loop_clipped_sum(model, x, y, ghost.groups, C)
    assert_close(r_g.grads, ref)
    assert_close(r_v.grads, ref)
    assert_f64_close(r_g.norms, ref_norms, f64_rtol(model))
    assert (ref_norms > C).any()
    assert torch.count_nonzero(r_g.grads["emb.weight"][0]) == 0  # the padding row: no gradient


def test_augmentation_rows_are_summed_per_example():
    torch.manual_seed(1)
    model = TinyLM().to(DT)
    x, y = data(4, 1)
    xk = x.repeat_interleave(2, 0)  # K = 2 rows per example, B labels
    r = PerExampleClipper(model, C, "global", "ghost").clipped_sum(xk, y, multiplicity=2)
    r_v = PerExampleClipper(model, C, "global", "vmap").clipped_sum(xk, y, multiplicity=2)
    assert_close(r.grads, r_v.grads)
    assert_f64_close(r.norms, r_v.norms, f64_rtol(model))


@pytest.mark.parametrize("option", ["scale_grad_by_freq", "sparse"])
def test_embedding_options_that_mix_examples_or_go_sparse_are_refused(option):
    # scale_grad_by_freq divides by a token's count over the whole batch: examples mix
    with pytest.raises(ValueError, match=f"{option}=True"):
        PerExampleClipper(TinyLM(**{option: True}).to(DT), C, "global", "ghost")


class Conv1dNet(nn.Module):
    """Two Conv1d (strided and dilated, 'same' padding with reflect, grouped, ≥ 16 channels: both
    paths of the Conv2d rule), then a Linear."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(3, 16, 3, stride=2, padding=1)
        self.c2 = nn.Conv1d(16, 8, 3, dilation=2, padding="same", padding_mode="reflect")
        self.c3 = nn.Conv1d(8, 8, 3, groups=2, bias=False)
        self.head = nn.Linear(8 * 6, 4)

    def forward(self, x):
        h = torch.tanh(self.c2(torch.relu(self.c1(x))))
        return self.head(self.c3(h).flatten(1))


@pytest.mark.parametrize("clipping", ["global", "per_layer"])
@pytest.mark.parametrize("budget", [0, 2**30])
@pytest.mark.parametrize("route", [None, "ghost", "explicit"])  # layers.ROUTE: by cost, or forced
def test_conv1d_equals_vmap_and_loop(clipping, budget, route, monkeypatch):
    from dpsgd.mechanism.clipping import layers
    from dpsgd.mechanism.clipping.rules.conv import Conv1dLayer

    monkeypatch.setattr(layers, "ROUTE", route)
    torch.manual_seed(2)
    model = Conv1dNet().to(DT)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 3, 16, generator=g, dtype=DT), torch.randint(0, 4, (6,), generator=g)
    ghost = PerExampleClipper(model, C, clipping, "ghost", memory_budget_bytes=budget)
    assert [type(l) for l in ghost._layers].count(Conv1dLayer) == 3 and ghost.native
    r_g = ghost.clipped_sum(x, y)
    ref, ref_norms = loop_clipped_sum(model, x, y, ghost.groups, C)
    assert_close(r_g.grads, ref)
    assert_f64_close(r_g.norms, ref_norms, f64_rtol(model))
    assert (ref_norms > C).any()
