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


# -- the plain (non-private) step -------------------------------------------------------------------
class _Counting(PerExampleClipper):
    """A clipper that fails the test if the plain step calls it."""

    def clipped_sum(self, *a, **k):
        raise AssertionError("the plain step ran the per-example engine")

    def prove(self, *a, **k):
        raise AssertionError("the plain step proved something")


def _plain(model, L, lr, **kw):
    return DPSGD(
        model,
        _Counting(model, None, **{k: kw.pop(k) for k in ("loss",) if k in kw}),
        GaussianNoise(seed=0),
        Plan.by_hand(0.0, 1.0, L),
        lr=lr,
        plain=True,
        **kw,
    )


def test_plain_step_is_one_backward_of_the_summed_loss_divided_by_L():
    """θ ← θ − (η/L) Σ_i ∇ℓ_i, bit for bit the autograd of cross_entropy(reduction="sum") and the
    same update, for any physical batch size (the sums then add in another order: float32 round-off
    of the lot's sum, n·eps32 at parameter scale); no clipper call, no proof, no noise drawn."""
    model, x, y = _setup()
    L, lr = 50.0, 0.3
    ref = copy.deepcopy(model)
    grads = torch.autograd.grad(F.cross_entropy(ref(x), y, reduction="sum"), list(ref.parameters()))
    with torch.no_grad():
        for p, g in zip(ref.parameters(), grads):
            p.add_(g, alpha=-lr / L)
    dp = _plain(model, L, lr)
    state = dp.noise.generator.get_state()
    dp.prove(x, y)
    out = dp.step(x, y)
    assert dp.engine == "plain" and out["lot_size"] == len(x)
    assert torch.equal(dp.noise.generator.get_state(), state)  # no noise drawn
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    m2, _, _ = _setup()
    _plain(m2, L, lr).step(x, y, physical_batch_size=7)
    for p, q in zip(m2.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=32 * 2**-23)


def test_plain_step_weights_multiplicity_and_a_users_loss():
    """Σ_i w_i ℓ_i (a weight-0 row adds nothing), K copies averaged per example, and a given
    per-example loss: the same update as autograd on that objective."""
    model, x, y = _setup()
    w = torch.ones(len(x))
    w[5:9] = 0
    ref = copy.deepcopy(model)
    loss = lambda out, t: F.cross_entropy(out, t, reduction="none") * 2.0  # noqa: E731
    rows = loss(ref(x), y)
    grads = torch.autograd.grad((rows * w).sum(), list(ref.parameters()))
    dp = _plain(model, 40.0, 0.5, loss=loss)
    out = dp.step(x, y, weights=w)
    assert out["lot_size"] == len(x) - 4
    assert float(out["loss_sum"]) == pytest.approx(float((rows * w).sum().detach()), rel=1e-6)
    for p, q, g in zip(model.parameters(), ref.parameters(), grads):
        # float32: the same gradient; the update rounds once (add_ with alpha) here, twice there
        assert torch.allclose(p, q - 0.5 / 40.0 * g, rtol=0, atol=1e-6)
    m2, _, _ = _setup()
    ref2 = copy.deepcopy(m2)
    xk = x.repeat_interleave(3, 0)
    g2 = torch.autograd.grad(
        F.cross_entropy(ref2(xk), y.repeat_interleave(3), reduction="sum") / 3,
        list(ref2.parameters()),
    )
    _plain(m2, 32.0, 0.1, augment_multiplicity=3).step(x, y)
    for p, q, g in zip(m2.parameters(), ref2.parameters(), g2):
        # float32: as above (the same objective, the update rounded once here, twice there)
        assert torch.allclose(p, q - 0.1 / 32.0 * g, rtol=0, atol=1e-6)


def test_plain_step_refuses_a_charged_plan():
    model, _, _ = _setup()
    with pytest.raises(ValueError, match="plain=True"):
        DPSGD(
            model,
            PerExampleClipper(model, None),
            GaussianNoise(seed=0),
            Plan.by_hand(1.0, 1.0, 10),
            lr=0.1,
            plain=True,
        )
