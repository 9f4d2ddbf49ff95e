"""``dpsgd.make_private``: your own loop over the engine's lots, with any optimizer, a Dataset read
lazily, a loss over dict batches, and every lot charged.

The loop stops at its horizon or before the lot that would pass the target ε, each lot it stepped
charged once; a step on anything but the lot just drawn is refused; with no noise and no clipping
the update is the optimizer's own step on the mean gradient (DP-Adam is post-processing); a state
continues bit for bit from mid-epoch; the Dataset is read only where the sampler's lots are, a
physical batch at a time; frozen weights never move; bf16 keeps every clipped per-example gradient
within C to float32 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import dpsgd
from dpsgd.mechanism.batches import token_losses
from dpsgd.workbench.engine import Lot, PrivateEngine
from tolerances import EPS32, chain_rel_tol, n_params, reduction_rtol

V, T = 20, 6  # vocabulary, sequence length


class Tagger(nn.Module):
    """A small sequence model: token embeddings, a LayerNorm, a per-token classifier."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.emb, self.norm, self.out = nn.Embedding(V, 8), nn.LayerNorm(8), nn.Linear(8, classes)

    def forward(self, input_ids, attention_mask=None):
        h = self.norm(self.emb(input_ids))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return self.out(h)


class Tokens(Dataset):
    """Examples as dicts of tensors, each read when asked for (reads counted); a padding mask."""

    def __init__(self, n: int = 120, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, V, (n, T), generator=g)
        self.lengths = torch.randint(2, T + 1, (n,), generator=g)
        self.labels = torch.randint(0, 3, (n, T), generator=g)
        self.reads: list[int] = []

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        self.reads.append(int(i))
        mask = (torch.arange(T) < self.lengths[i]).long()
        labels = self.labels[i].masked_fill(mask == 0, -100)  # padding: ignore_index
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": labels}


def tag_loss(model, batch):
    logits = model(batch["input_ids"], batch["attention_mask"])
    return token_losses(logits, batch["labels"])  # each example's mean over its own tokens


def _engine(model=None, optimizer=None, data=None, **kw):
    torch.manual_seed(0)
    model = model or Tagger()
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=1e-2)
    args = dict(lot_size=20, sigma=1.0, epochs=2, loss=tag_loss, seed=0)
    return dpsgd.make_private(model, optimizer, data or Tokens(), **args | kw)


def test_a_users_loop_with_adamw_over_dicts_charges_every_lot_and_stops_before_its_target():
    e = _engine(sigma=2.0, target_epsilon=1.0, epochs=None)
    stepped = 0
    for lot in e.lots():
        out = e.step(lot)
        stepped += 1
        assert out["lot_size"] == len(lot)
    assert e.stop_reason == "target_epsilon_reached" and stepped == e.steps > 0
    assert sum(x.count for x in e.ledger.entries) == e.steps  # one charge per lot stepped
    assert e.epsilon <= 1.0 and e.accountant == "pld"  # the tightest valid accountant
    assert e.statement()["optimizer"] == "AdamW"


def test_the_horizon_is_the_epochs_and_sigma_is_calibrated_for_it():
    e = _engine(sigma=None, target_epsilon=2.0, epochs=1.5)
    n = sum(1 for lot in e.lots() if e.step(lot))
    assert n == e.steps == 9 and e.stop_reason == "epochs_completed"  # ceil(1.5 · 6 lots)
    assert e.epsilon <= 2.0


def test_a_step_on_anything_but_the_lot_just_drawn_is_refused():
    e = _engine()
    lots = e.lots()
    lot = next(lots)
    with pytest.raises(ValueError, match="did not come from engine.lots"):
        e.step(Lot(lot.indices.clone(), lot.epoch, lot.position))  # the same indices, not drawn
    with pytest.raises(ValueError, match="did not come from engine.lots"):
        e.step(next(iter(TensorDataset(torch.zeros(3, T)))))
    e.step(lot)
    with pytest.raises(ValueError, match="stepped already"):
        e.step(lot)
    assert e.steps == 1 and sum(x.count for x in e.ledger.entries) == 1


def test_a_lot_drawn_and_not_stepped_is_refused_or_comes_back_first():
    e = _engine()
    lots = e.lots()
    first = next(lots)
    with pytest.raises(RuntimeError, match="was drawn and not stepped"):
        next(lots)
    again = next(e.lots())  # a new loop: the lot not stepped comes first
    assert again is first and e.steps == 0
    e.step(again)
    assert next(e.lots()).position == 1


def test_dp_adam_without_noise_or_clipping_is_adams_own_step_on_the_mean_gradient():
    """σ = 0, no clipping (private=False), fixed-size lots of L: the engine's .grad is the lot's
    mean gradient, and the update is torch's Adam on it, bit for bit."""
    model = Tagger().double()
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    e = PrivateEngine(model, Tokens(), optimizer=opt, loss=tag_loss, private=False,
                      sampling="fixed_size", lot_size=20, seed=0)  # fmt: skip
    lot = next(e.lots())
    batch = torch.utils.data.default_collate([Tokens()[int(i)] for i in lot.indices])
    mean = torch.autograd.grad(tag_loss(twin, batch).mean(), list(twin.parameters()))
    e.step(lot)
    for g, p in zip(mean, model.parameters()):  # Σ_i g_i / L, summed per example and by autograd
        assert (p.grad - g).norm() <= reduction_rtol(n_params(model)) * (g.norm() + 1e-300)
    ref = torch.optim.Adam(twin.parameters(), lr=0.1)
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    ref.step()  # torch's own Adam on the same gradient
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_the_dataset_is_read_only_at_the_lots_examples_a_physical_batch_at_a_time():
    data, sizes = Tokens(), []

    def collate(examples):
        sizes.append(len(examples))
        return torch.utils.data.default_collate(examples)

    e = _engine(data=data, physical_batch_size=7, collate_fn=collate)
    data.reads.clear()
    drawn = []
    for lot in e.lots():
        drawn += lot.indices.tolist()
        e.step(lot)
    assert data.reads == drawn and max(sizes) <= 7  # the sampler's lots, nothing else


def test_a_state_continues_bit_for_bit_from_the_middle_of_an_epoch():
    """Shuffled lots (the permutation drawn at the epoch's start) and AdamW's moments: saved after
    3 of an epoch's 6 lots, loaded into a fresh engine, the same lots and weights follow."""
    a = _engine(sampling="shuffle", epochs=2)
    lots = a.lots()
    for _ in range(3):
        a.step(next(lots))
    state = a.state_dict()
    b = _engine(sampling="shuffle", epochs=2, seed=7)  # other seeds: the state's generators win
    b.load_state_dict(state)
    rest_a = [(lot.indices.tolist(), a.step(lot)) for lot in a.lots()]
    rest_b = [(lot.indices.tolist(), b.step(lot)) for lot in b.lots()]
    assert [i for i, _ in rest_a] == [i for i, _ in rest_b] and len(rest_a) == 9
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert a.ledger == b.ledger and a.epoch == b.epoch == 2


def test_a_state_of_another_optimizer_is_refused_and_nothing_loaded():
    a = _engine()
    a.step(next(a.lots()))
    model = Tagger()
    b = _engine(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    before = copy.deepcopy(b.state_dict())
    with pytest.raises(ValueError, match="optimizer: the state's is AdamW, this one's SGD"):
        b.load_state_dict(a.state_dict())
    assert all(torch.equal(before["model"][n], v) for n, v in b.state_dict()["model"].items())
    assert b.steps == 0


def test_an_optimizer_over_anything_but_the_trainable_parameters_is_refused():
    model = Tagger()
    model.norm.requires_grad_(False)
    with pytest.raises(ValueError, match="'out.weight' is clipped and noised but not in"):
        _engine(model=model, optimizer=torch.optim.SGD(model.emb.parameters(), lr=0.1))
    stray = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="not a trainable parameter of the model"):
        _engine(model=model, optimizer=torch.optim.SGD([*model.parameters(), stray], lr=0.1))
    with pytest.raises(ValueError, match="give a torch.optim.Optimizer"):
        _engine(model=model, optimizer="adam")


def test_frozen_parameters_are_not_clipped_noised_or_moved():
    model = Tagger()
    model.emb.requires_grad_(False)
    frozen = model.emb.weight.detach().clone()
    e = _engine(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1))
    for lot in e.lots():
        e.step(lot)
    assert torch.equal(model.emb.weight, frozen) and model.emb.weight.grad is None
    assert "emb.weight" not in e.clipper.trainable and e.steps == 12


def test_per_example_norms_are_those_of_a_batch_of_one_loop():
    model = Tagger().double()
    e = PrivateEngine(model, Tokens(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      loss=tag_loss, sigma=1.0, lot_size=20, seed=0)  # fmt: skip
    batch = torch.utils.data.default_collate([Tokens()[i] for i in range(5)])
    norms = e.per_example_norms(batch)[:, 0]
    for i in range(5):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        g = torch.autograd.grad(tag_loss(model, one)[0], list(model.parameters()))
        ref = torch.sqrt(sum(t.pow(2).sum() for t in g))
        assert abs(float(norms[i] - ref)) <= reduction_rtol(n_params(model)) * float(ref)
    assert e.steps == 0 and not e.ledger.entries  # a check, never a release


def test_a_token_loss_averages_each_example_over_its_own_tokens():
    """Padding changes no example's loss: a padded example's loss is its loss alone."""
    torch.manual_seed(0)
    logits, labels = torch.randn(2, T, 3), torch.randint(0, 3, (2, T))
    labels[0, 3:] = -100
    rows = token_losses(logits, labels)
    alone = nn.functional.cross_entropy(logits[0, :3], labels[0, :3])
    # the same log-softmax of 3 classes, 3 token losses summed and divided: a few float32 ops
    tol = chain_rel_tol(8, EPS32) * float(alone)
    assert rows.shape == (2,) and abs(float(rows[0] - alone)) <= tol


def test_bf16_keeps_every_clipped_per_example_gradient_within_c():
    """Each example's clipped gradient, as the engine sums it (one-hot example weights on the
    lot's batch), has float32 norm <= C up to the float32 rounding of computing that norm: n
    squares summed (n·eps32) and the factor C/‖g‖ applied (2 eps32)."""
    model = Tagger()
    e = _engine(model=model, precision="bf16", clip_norm=0.01)
    batch = torch.utils.data.default_collate([e.reader.dataset[i] for i in range(8)])
    C, n = 0.01, sum(p.numel() for p in model.parameters())
    for i in range(8):
        w = torch.zeros(8)
        w[i] = 1.0
        g = e.clipper.clipped_sum(batch, weights=w).grads
        assert all(t.dtype == torch.float32 for t in g.values())
        norm = float(torch.sqrt(sum(t.double().pow(2).sum() for t in g.values())))
        assert 0 < norm <= C * (1 + (n + 2) * EPS32)
    assert e.clipper.precision == "bf16" and e.statement()["precision"] == "bf16"


def test_bf16_needs_float32_weights():
    with pytest.raises(ValueError, match="precision='bf16' autocasts .* is torch.bfloat16"):
        _engine(model=Tagger().to(torch.bfloat16), precision="bf16")


@pytest.mark.slow
def test_workers_read_the_same_lots():
    a = _engine(num_workers=2)
    b = _engine()
    for e in (a, b):
        for lot in e.lots():
            e.step(lot)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    assert a.ledger == b.ledger


def test_a_loss_or_model_that_mixes_the_examples_of_a_dict_batch_is_refused_before_any_lot():
    """The clipper's proof on the first examples, generalised to dict batches: whole examples
    (every tensor's row) replaced, the other examples' losses must not move."""

    def centred(model, batch):  # each example's logits minus the batch's mean: examples mix
        logits = model(batch["input_ids"], batch["attention_mask"])
        return token_losses(logits - logits.mean(0, keepdim=True), batch["labels"])

    with pytest.raises(ValueError, match="the model mixes examples: changing"):
        _engine(loss=centred)
    with pytest.raises(ValueError, match=r"one value per example \(shape \[32\]\), got \(\)"):
        _engine(loss=lambda m, b: tag_loss(m, b).mean())
