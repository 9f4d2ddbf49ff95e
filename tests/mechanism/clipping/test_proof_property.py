"""Property test of the proofs: random small sequence models, random B and T (often equal), and
``mode="auto"`` equals the float64 batch-of-1 loop (tests/dp_reference.py, relative error
reduction_rtol(P): every value is reduced over at most P terms) or, for a model that mixes examples,
refuses it in one line. Plain random generation from a fixed list of seeds (reproducible: a
failing seed is named in the test id); more seeds under ``-m slow``."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch import nn

from dp_reference import assert_close, loop_clipped_sum
from dpsgd.core.errors import NotPerExample
from dpsgd.mechanism.clipping import PerExampleClipper

DT = torch.float64
C = 0.05
NCLS, V = 3, 9

BLOCKS = ("linear", "layernorm", "conv1d", "rnn", "wpe", "reorder", "outside", "mix")


class RandomNet(nn.Module):
    """Blocks on h [B, T, d], each in the layout the spec says (seq-first: [T, B, d])."""

    def __init__(self, spec: dict):
        super().__init__()
        self.spec, d = spec, spec["d"]
        self.inp = nn.Embedding(V, d) if spec["tokens"] else nn.Linear(spec["d_in"], d)
        self.blocks = nn.ModuleList()
        for kind, seq_first in spec["blocks"]:
            if kind == "linear":
                self.blocks.append(nn.Linear(d, d))
            elif kind == "layernorm":
                self.blocks.append(nn.LayerNorm(d))
            elif kind == "conv1d":
                self.blocks.append(nn.Conv1d(d, d, 3, padding=1))
            elif kind == "rnn":
                cell = random.Random(spec["seed"]).choice(["RNN", "GRU", "LSTM"])
                self.blocks.append(getattr(nn, cell)(d, d, batch_first=not seq_first))
            elif kind == "wpe":
                self.blocks.append(nn.Embedding(spec["T"], d))
            elif kind == "outside":  # a Linear whose weight is also used outside its call
                self.blocks.append(nn.Linear(d, d))
            else:  # reorder, mix: no parameters
                self.blocks.append(nn.Identity())
        self.head = nn.Linear(d, NCLS)

    def forward(self, x):
        h = self.inp(x)  # [B, T, d]
        for (kind, seq_first), m in zip(self.spec["blocks"], self.blocks):
            if seq_first:
                h = h.transpose(0, 1)  # [T, B, d]: position first
            b_dim = 1 if seq_first else 0
            if kind in ("linear", "layernorm"):
                h = torch.tanh(m(h))
            elif kind == "conv1d":  # over time, batch first whatever the block's layout
                g = h.transpose(0, 1) if seq_first else h
                g = torch.tanh(m(g.transpose(1, 2))).transpose(1, 2)
                h = g.transpose(0, 1) if seq_first else g
            elif kind == "rnn":
                h = m(h)[0]
            elif kind == "wpe":
                pos = m(torch.arange(h.shape[1 - b_dim], device=h.device))  # [T, d]
                h = h + (pos[:, None] if seq_first else pos[None])
            elif kind == "reorder":  # sort the batch by a feature, a layer, then restore it
                order = h.select(1 - b_dim, 0)[..., 0].argsort()
                g = h.index_select(b_dim, order)
                g = torch.tanh(self.head.weight.new_ones(()) * g)  # no parameter: a relayout
                h = g.index_select(b_dim, order.argsort())
            elif kind == "outside":
                h = torch.tanh(m(h)) + 1e-3 * (h @ m.weight)
            elif kind == "mix":
                h = h - h.mean(b_dim, keepdim=True)
            if seq_first:
                h = h.transpose(0, 1)
        return self.head(h.mean(1))


def draw(seed: int):
    """(model spec, x, y): 1-3 blocks, B and T in 2..7 (equal half the time), d in 3..5."""
    r = random.Random(seed)
    B = r.randint(2, 7)
    T = B if r.random() < 0.5 else r.randint(2, 7)
    d = r.randint(3, 5)
    kinds = [r.choice(BLOCKS[:-1]) for _ in range(r.randint(1, 3))]
    if r.random() < 0.15:
        kinds.insert(r.randrange(len(kinds) + 1), "mix")
    spec = {
        "seed": seed,
        "d": d,
        "d_in": r.randint(2, 6),
        "T": T,
        "tokens": r.random() < 0.3,
        "blocks": [(k, r.random() < 0.4) for k in kinds],
    }
    g = torch.Generator().manual_seed(seed)
    if spec["tokens"]:
        x = torch.randint(0, V, (B, T), generator=g)
    else:
        x = torch.randn(B, T, spec["d_in"], generator=g, dtype=DT)
    return spec, x, torch.randint(0, NCLS, (B,), generator=g)


def check(seed: int) -> None:
    spec, x, y = draw(seed)
    torch.manual_seed(seed)
    model = RandomNet(spec).to(DT)
    mixes = any(k == "mix" for k, _ in spec["blocks"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallbacks' notes (test_proof_zoo.py checks them)
        clipper = PerExampleClipper(model, C, "per_layer")
        if mixes:
            with pytest.raises(NotPerExample, match=r"^the model mixes examples") as e:
                clipper.clipped_sum(x, y)
            assert "\n" not in str(e.value)
            return
        res = clipper.clipped_sum(x, y)
    ref, _ = loop_clipped_sum(model, x, y, clipper.groups, C)
    assert_close(res.grads, ref)


@pytest.mark.parametrize("seed", range(40))
def test_auto_is_the_batch_of_one_loop_or_refuses(seed):
    check(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40, 400))
def test_auto_is_the_batch_of_one_loop_or_refuses_more_seeds(seed):
    check(seed)


def test_the_draws_cover_every_block_and_equal_sizes():
    """The fast seeds draw every block kind, both layouts, B = T and B ≠ T (the property is not
    vacuous)."""
    specs = [draw(s) for s in range(40)]
    kinds = {k for spec, _, _ in specs for k, _ in spec["blocks"]}
    layouts = {s for spec, _, _ in specs for _, s in spec["blocks"]}
    sizes = {x.shape[0] == x.shape[1] for _, x, _ in specs}
    assert kinds == set(BLOCKS) and layouts == {True, False} and sizes == {True, False}
