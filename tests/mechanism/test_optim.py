"""The DP-SGD step (dpsgd.mechanism.optim.DPSGD, Algorithm 1) at its limits."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.models.networks import MLP
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.optim import DPSGD
from dpsgd.mechanism.plan import Plan


def _setup(seed=0, n=32, d=10, classes=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP(d, (16,), classes, bias=True)
    return model, x, y


def _sgd_reference(model, x, y, lr, L):
    """Plain SGD on Σ_i loss_i / L with ordinary autograd."""
    ref = copy.deepcopy(model)
    loss = F.cross_entropy(ref(x), y, reduction="sum") / L
    grads = torch.autograd.grad(loss, list(ref.parameters()))
    with torch.no_grad():
        for p, g in zip(ref.parameters(), grads):
            p.sub_(lr * g)
    return ref


@pytest.mark.parametrize("mode", ["vmap", "ghost"])
def test_no_clip_no_noise_equals_plain_sgd(mode):
    model, x, y = _setup()
    ref = _sgd_reference(model, x, y, lr=0.1, L=len(x))
    dp = DPSGD(
        model,
        PerExampleClipper(model, None, mode=mode),
        GaussianNoise(seed=0),
        Plan.by_hand(0.0, 1.0, len(x)),
        lr=0.1,
    )
    dp.step(x, y, physical_batch_size=len(x))
    for p, q in zip(model.parameters(), ref.parameters()):
        # float32: the DP step and autograd reduce the lot in other orders (~n·eps32 at parameter
        # scale)
        assert torch.allclose(p, q, atol=1e-6)


def test_divides_by_expected_not_realised_lot_size():
    model, x, y = _setup()
    L = 100.0  # expected lot size ≠ realised 32
    ref = _sgd_reference(model, x, y, lr=0.5, L=L)
    dp = DPSGD(
        model,
        PerExampleClipper(model, None, mode="vmap"),
        GaussianNoise(seed=0),
        Plan.by_hand(0.0, 1.0, L),
        lr=0.5,
    )
    out = dp.step(x, y, physical_batch_size=7)  # physical batches smaller than the lot
    assert out["lot_size"] == 32
    for p, q in zip(model.parameters(), ref.parameters()):
        # float32: the DP step and autograd reduce the lot in other orders (~n·eps32 at parameter
        # scale)
        assert torch.allclose(p, q, atol=1e-6)


def test_physical_batches_do_not_change_the_step():
    model, x, y = _setup()
    m2 = copy.deepcopy(model)
    for m, pbs in [(model, 32), (m2, 5)]:
        DPSGD(
            m,
            PerExampleClipper(m, 0.5, clipping="per_layer", mode="vmap"),
            GaussianNoise(seed=1),
            Plan.by_hand(1.0, 0.5, 30),
            lr=0.1,
        ).step(x, y, pbs)
    for p, q in zip(model.parameters(), m2.parameters()):
        # float32: the DP step and autograd reduce the lot in other orders (~n·eps32 at parameter
        # scale)
        assert torch.allclose(p, q, atol=1e-6)


def test_empty_lot_is_noise_only_with_std_sigma_C_per_group():
    torch.manual_seed(0)
    model = MLP(100, (100,), 100, bias=False)  # two 100×100 groups (per layer)
    before = [p.detach().clone() for p in model.parameters()]
    sigma, C, L, lr = 1.5, 4.0, 50.0, 0.2
    clipper = PerExampleClipper(model, C, clipping="per_layer", mode="vmap")
    assert len(clipper.groups) == 2
    dp = DPSGD(model, clipper, GaussianNoise(seed=3), Plan.by_hand(sigma, C, L), lr=lr)
    out = dp.step(torch.zeros(0, 100), torch.zeros(0, dtype=torch.int64), physical_batch_size=16)
    assert out["lot_size"] == 0 and float(out["loss_sum"]) == 0.0
    for p, b in zip(model.parameters(), before):
        z = (b - p.detach()) * L / lr  # the noise that was added to this group's sum
        n = z.numel()
        # sample std of n = 10 000 normals: relative standard error ≈ 1/sqrt(2n) = 0.7 %; allow 5 %
        assert z.std().item() == pytest.approx(sigma * C, rel=0.05)
        assert abs(z.mean().item()) < 5 * sigma * C / math.sqrt(n)


def test_noise_seed_reproducible_and_clipped_update_bounded():
    model, x, y = _setup()
    m2 = copy.deepcopy(model)
    for m in (model, m2):
        DPSGD(
            m,
            PerExampleClipper(m, 1.0, mode="ghost"),
            GaussianNoise(seed=9),
            Plan.by_hand(2.0, 1.0, 32),
            lr=0.1,
        ).step(x, y, 32)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), m2.parameters()))
    # without noise, Σ clip(g_i)/L has norm <= |lot| C / L = C
    m3, x3, y3 = _setup()
    before = torch.cat([p.detach().flatten().clone() for p in m3.parameters()])
    DPSGD(
        m3,
        PerExampleClipper(m3, 1.0, mode="vmap"),
        GaussianNoise(seed=0),
        Plan.by_hand(0.0, 1.0, 32),
        lr=1.0,
    ).step(x3, y3, 32)
    after = torch.cat([p.detach().flatten() for p in m3.parameters()])
    assert (before - after).norm().item() <= 1.0 + 1e-5
