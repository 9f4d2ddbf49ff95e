"""Per-example weights and fixed-shape lots: the truncated Poisson sampler's lots padded to B rows
with weight 0.

A weight-0 row multiplies its clip factor (and its loss) by 0, so it adds an exact 0 to every sum:
at the same shape, the padding's content cannot change a single bit of Σ_i w_i clip(g_i) or of the
loss (bit-identical), and a lot of padding alone sums to exactly 0. Against the unpadded lot
(another shape, so another reduction order) the sums agree to the engines' round-off:
f64_rtol(model) for vmap, 1e-5 for ghost (tests/mechanism/clipping/test_clipping.py: its
book-keeping reorders the reductions).
"""

import copy

import pytest
import torch

from conftest import TINY_RUN
from dpsgd.audit.onerun.canaries import GradientCanaries
from dpsgd.audit.onerun.placement import place
from dpsgd.config.schema import validate
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.optim import DPSGD
from dpsgd.mechanism.plan import Plan
from dpsgd.launch.main import compose
from dpsgd.train import train
from test_clipping import assert_close_dict, make
from tolerances import EPS32, assert_f64_close, f64_rtol, reduction_rtol

PAD = 4


def _rtol(mode, model):
    return f64_rtol(model) if mode == "vmap" else 1e-5  # ghost: the module docstring's 1e-5


def _padded(x, y, K=1, seed=1):
    """(x, y) followed by PAD rows of random content (K copies each), weights 1 then 0."""
    g = torch.Generator().manual_seed(seed)
    xp = torch.randn((PAD * K,) + tuple(x.shape[1:]), generator=g, dtype=x.dtype)
    yp = torch.randint(0, 10, (PAD,), generator=g)
    w = torch.cat([torch.ones(len(y)), torch.zeros(PAD)])
    return torch.cat([x, xp]), torch.cat([y, yp]), w


@pytest.mark.parametrize("mode", ["vmap", "ghost"])
@pytest.mark.parametrize("name,clipping", [("deep_mlp", "global"), ("small_cnn", "per_layer")])
@pytest.mark.parametrize("K", [1, 2])
def test_zero_weight_rows_add_exactly_zero(mode, name, clipping, K):
    model, x, y = make(name, True)
    if K > 1:  # K augmented copies per example (here: perturbed)
        x = x.repeat_interleave(K, 0) + 0.1 * torch.randn(
            (len(x) * K,) + tuple(x.shape[1:]), dtype=x.dtype
        )
    clipper = PerExampleClipper(model, 0.5, clipping, mode=mode)
    ref = clipper.clipped_sum(x, y, multiplicity=K)
    xa, ya, w = _padded(x, y, K, seed=1)
    xb, yb, _ = _padded(x, y, K, seed=2)  # the same lot, other padding content
    a = clipper.clipped_sum(xa, ya, multiplicity=K, weights=w)
    b = clipper.clipped_sum(xb, yb, multiplicity=K, weights=w)
    for n in a.grads:
        assert torch.equal(a.grads[n], b.grads[n]), n  # exact: the padding adds 0 · finite = 0
    assert torch.equal(a.loss_sum, b.loss_sum)  # exact: 0 · loss
    assert_close_dict(a.grads, ref.grads, rtol=_rtol(mode, model))
    assert_f64_close(a.loss_sum, ref.loss_sum, reduction_rtol(len(y) + PAD))
    assert_f64_close(
        a.norms[: len(y)], ref.norms, f64_rtol(model)
    )  # norms: unweighted, per example
    assert a.norms.shape == (len(y) + PAD, len(clipper.groups))
    pad_only = clipper.clipped_sum(xa[len(x) :], ya[len(y) :], multiplicity=K, weights=w[len(y) :])
    for g in pad_only.grads.values():
        assert not bool(g.any())  # exact: a lot of padding alone is 0
    assert float(pad_only.loss_sum) == 0.0  # exact: 0 · loss


@pytest.mark.parametrize("mode", ["vmap", "ghost"])
def test_weight_two_is_the_example_twice(mode):
    """A weight w_i ≥ 0 multiplies example i's clipped gradient and loss: weight 2 = the row
    twice."""
    model, x, y = make("deep_mlp", True)
    clipper = PerExampleClipper(model, 0.5, "per_layer", mode=mode)
    w = torch.ones(len(y))
    w[3] = 2.0
    got = clipper.clipped_sum(x, y, weights=w)
    want = clipper.clipped_sum(torch.cat([x, x[3:4]]), torch.cat([y, y[3:4]]))
    assert_close_dict(got.grads, want.grads, rtol=_rtol(mode, model))
    assert_f64_close(got.loss_sum, want.loss_sum, reduction_rtol(len(y) + 1))


def test_weights_must_be_one_per_example():
    model, x, y = make("deep_mlp", True)
    clipper = PerExampleClipper(model, 0.5, mode="vmap")
    with pytest.raises(ValueError, match="weights"):
        clipper.clipped_sum(x, y, weights=torch.ones(len(y) + 1))


@pytest.mark.parametrize("mode", ["vmap", "ghost"])
def test_padded_step_is_the_unpadded_step(mode):
    """DPSGD.step on the padded lot (physical batches slicing the weights like x and y): the same
    update as on the real rows, the same noise draw; lot_size counts the real rows; divisor L."""
    torch.manual_seed(0)
    model, x, y = make("deep_mlp", True)
    m2 = copy.deepcopy(model)
    xp, yp, w = _padded(x, y)
    outs = []
    for m, args, kw in [(model, (x, y), {}), (m2, (xp, yp), {"weights": w})]:
        dp = DPSGD(
            m,
            PerExampleClipper(m, 0.5, "per_layer", mode=mode),
            GaussianNoise(seed=3),
            Plan.by_hand(1.0, 0.5, 20),
            lr=0.1,
        )
        outs.append(dp.step(*args, physical_batch_size=4, **kw))
    assert outs[0]["lot_size"] == outs[1]["lot_size"] == len(y)  # integer count of rows
    assert_f64_close(outs[1]["loss_sum"], outs[0]["loss_sum"], reduction_rtol(len(yp)))
    for p, q in zip(m2.parameters(), model.parameters()):
        assert_f64_close(p, q, _rtol(mode, model))


def test_canaries_skip_padding_rows():
    """The audit's wrapper: ordinary rows weighted by the engine, a zero-weight canary row adds
    nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8, bias=False), torch.nn.ReLU(), torch.nn.Linear(8, 3, bias=False)
    )
    inner = PerExampleClipper(model, clip_norm=1.5, clipping="per_layer")
    placed = place(inner, 4, 0, "dirac")
    wrapped = GradientCanaries(
        inner, placed["coords"], torch.tensor([True, True, True, True]), a=15.0
    )
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1])
    xs, ys = (
        torch.cat([x, torch.zeros(2, 6)]),
        torch.cat([y, torch.tensor([-1, -4])]),
    )  # canaries 0, 3
    want = wrapped.clipped_sum(xs[[0, 1, 2, 5]], ys[[0, 1, 2, 5]])  # rows 3, 4, 6 out
    w = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    got = wrapped.clipped_sum(xs, ys, weights=w)
    # float32 sums of ≤ 5 clipped terms of size ≤ 1.5 in another order
    assert_close_dict(got.grads, want.grads, rtol=reduction_rtol(8, EPS32))
    assert_f64_close(got.loss_sum, want.loss_sum, reduction_rtol(8, EPS32))


def test_truncated_poisson_run_steps_at_fixed_shape(tmp_path, monkeypatch):
    """A short truncated_poisson run: every lot reaches dp.step as exactly B rows, the padding
    weighted 0."""
    seen = []
    inner = DPSGD.step

    def step(self, x, y, physical_batch_size=None, weights=None):
        seen.append((len(x), len(y), None if weights is None else weights.clone()))
        return inner(self, x, y, physical_batch_size=physical_batch_size, weights=weights)

    monkeypatch.setattr(DPSGD, "step", step)
    B = 70
    c = validate(
        compose(
            TINY_RUN
            + [
                "privacy.sampling=truncated_poisson",
                f"privacy.max_lot_size={B}",
                "accountant.name=pld",
                "training.epochs=2",
                "privacy.sigma=2",
            ]
        )
    )
    st = train(c, tmp_path / "run")
    assert st["status"] == "complete"
    assert len(seen) == 20  # 2 epochs × N/L = 10 lots
    for n_x, n_y, w in seen:
        assert n_x == n_y == B and w is not None and len(w) == B
        real = int(w.sum())
        assert torch.equal(w, torch.cat([torch.ones(real), torch.zeros(B - real)]))  # exact: 0/1
    assert len({int(w.sum()) for _, _, w in seen}) > 1  # the real lot sizes vary (Poisson)
