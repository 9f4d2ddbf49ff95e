"""Per-example clipping engines at their limits.

Ghost norms + book-keeping must equal the torch.func vmap reference; vmap must equal a batch-of-1
loop; a single clipped example has norm C; no clipping is the plain gradient of the summed loss.
float64 throughout; two kernels computing the same norms, losses or gradients agree to
f64_rtol(model) = (parameter count)·eps64 (tests/tolerances.py), the clipped gradients of the
ghost engine to 1e-5 (its book-keeping reorders the reductions over the batch).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpsgd.mechanism.clipping import PerExampleClipper, per_sample_grads
from dpsgd.models.networks import MLP, CifarCNN
from tolerances import EPS64, assert_f64_close, f64_rtol, reduction_rtol

DT = torch.float64


def small_cnn(bias=True):
    """conv + pool + linear, shaped like the paper's CIFAR net but small."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 5, padding=2, bias=bias),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1, bias=bias),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 2 * 2, 12, bias=bias),
        nn.ReLU(),
        nn.Linear(12, 10, bias=bias),
    )


def make(name, bias, seed=0):
    torch.manual_seed(seed)
    if name == "mnist_mlp":
        model, x = MLP(60, (1000,), 10, bias=bias), torch.randn(13, 60)
    elif name == "deep_mlp":
        model, x = MLP(20, (30, 40), 10, bias=bias), torch.randn(11, 20)
    elif name == "small_cnn":
        model, x = small_cnn(bias), torch.randn(9, 3, 8, 8)
    elif name == "cifar_cnn":
        model, x = CifarCNN(bias=bias), torch.randn(5, 3, 24, 24)
    else:
        raise KeyError(name)
    model = model.to(DT)
    return model, x.to(DT), torch.randint(0, 10, (x.shape[0],))


def plain_sum_grad(model, x, y):
    loss = F.cross_entropy(model(x), y, reduction="sum")
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    return dict(zip(names, torch.autograd.grad(loss, params)))


# rtol 1e-5: the ghost engine's book-keeping sums the clipped gradients in another order
def assert_close_dict(a, b, rtol=1e-5, atol=0.0):
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].shape == b[n].shape and a[n].dtype == b[n].dtype, n
        err = (a[n] - b[n]).norm().item()
        assert err <= rtol * b[n].norm().item() + atol, (n, err, b[n].norm().item())


@pytest.mark.parametrize("name", ["mnist_mlp", "deep_mlp", "small_cnn", "cifar_cnn"])
@pytest.mark.parametrize("clipping", ["global", "per_layer"])
@pytest.mark.parametrize("bias", [False, True])
def test_ghost_equals_vmap(name, clipping, bias):
    model, x, y = make(name, bias)
    C = 0.05  # small: every example is clipped
    g = PerExampleClipper(model, C, clipping, mode="ghost")
    v = PerExampleClipper(model, C, clipping, mode="vmap")
    rg, rv = g.clipped_sum(x, y), v.clipped_sum(x, y)
    assert g.mode == "ghost" and v.mode == "vmap"
    assert_close_dict(rg.grads, rv.grads, rtol=1e-5)
    assert_f64_close(rg.norms, rv.norms, f64_rtol(model))
    assert float(rg.loss_sum) == pytest.approx(float(rv.loss_sum), rel=f64_rtol(model))
    assert rg.norms.shape == (x.shape[0], len(g.groups))


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
def test_float32_mnist_model(mode):
    torch.manual_seed(1)
    model, x, y = MLP(60, (1000,), 10), torch.randn(64, 60), torch.randint(0, 10, (64,))
    ref = PerExampleClipper(model.to(DT), 1.0, "per_layer", mode="vmap").clipped_sum(x.to(DT), y)
    res = PerExampleClipper(model.float(), 1.0, "per_layer", mode=mode).clipped_sum(x, y)
    for n, g in res.grads.items():
        assert g.dtype == torch.float32
        assert (g.to(DT) - ref.grads[n]).norm() <= 1e-5 * ref.grads[n].norm()


def test_per_sample_grads_equal_batch_of_one_loop():
    model, x, y = make("small_cnn", True)
    grads, losses = per_sample_grads(model, x, y)
    for i in range(x.shape[0]):
        ref = plain_sum_grad(model, x[i : i + 1], y[i : i + 1])
        for n, g in ref.items():
            # float64 vmap against autograd: ~1e-16 apart; 1e-6 only catches a wrong example
            torch.testing.assert_close(grads[n][i], g, rtol=0, atol=1e-6)
        assert losses[i].item() == pytest.approx(
            F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).item(), rel=f64_rtol(model)
        )


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
@pytest.mark.parametrize("name", ["mnist_mlp", "small_cnn"])
def test_single_example_clipped_to_C(mode, name):
    model, x, y = make(name, True)
    x, y, C = x[:1] * 10, y[:1], 1e-3
    res = PerExampleClipper(model, C, "global", mode=mode).clipped_sum(x, y)
    total = torch.sqrt(sum(g.pow(2).sum() for g in res.grads.values()))
    assert res.norms[0, 0] > C
    assert total.item() == pytest.approx(C, rel=f64_rtol(model))  # a norm over the parameters
    clipper = PerExampleClipper(model, C, "per_layer", mode=mode)
    res = clipper.clipped_sum(x, y)
    for k, names in enumerate(clipper.groups):
        norm = torch.sqrt(sum(res.grads[n].pow(2).sum() for n in names))
        assert res.norms[0, k] > C
        assert norm.item() == pytest.approx(C, rel=f64_rtol(model))


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
@pytest.mark.parametrize("clipping", ["global", "per_layer"])
@pytest.mark.parametrize("name", ["mnist_mlp", "small_cnn"])
def test_no_clipping_is_plain_summed_gradient(mode, clipping, name):
    model, x, y = make(name, True)
    res = PerExampleClipper(model, None, clipping, mode=mode).clipped_sum(x, y)
    assert_close_dict(res.grads, plain_sum_grad(model, x, y), rtol=f64_rtol(model))
    assert float(res.loss_sum) == pytest.approx(
        F.cross_entropy(model(x), y, reduction="sum").item(), rel=f64_rtol(model)
    )


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
def test_large_C_is_plain_gradient_and_norms_are_per_example(mode):
    model, x, y = make("small_cnn", True)
    clipper = PerExampleClipper(model, 1e6, "global", mode=mode)
    res = clipper.clipped_sum(x, y)
    assert_close_dict(res.grads, plain_sum_grad(model, x, y), rtol=f64_rtol(model))
    for i in range(3):
        g = plain_sum_grad(model, x[i : i + 1], y[i : i + 1])
        assert res.norms[i, 0].item() == pytest.approx(
            torch.sqrt(sum(t.pow(2).sum() for t in g.values())).item(), rel=f64_rtol(model)
        )


@pytest.mark.parametrize("mode", ["auto", "ghost", "vmap"])
def test_empty_batch(mode):
    model, x, y = make("small_cnn", True)
    clipper = PerExampleClipper(model, 1.0, "per_layer", mode=mode)
    res = clipper.clipped_sum(x[:0], y[:0])
    assert float(res.loss_sum) == 0.0
    assert res.norms.shape == (0, len(clipper.groups))
    for n, p in model.named_parameters():
        assert res.grads[n].shape == p.shape and res.grads[n].dtype == p.dtype
        assert torch.count_nonzero(res.grads[n]) == 0


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_example_is_one_clear_error(mode, bad):
    """Public API: an example holding NaN or ±inf (or a non-finite weight) is refused with one
    ValueError naming it, on both engines, before any gradient (the ghost engine's proof would
    fail its own check against autograd on NaN, the vmap engine return an all-NaN sum); nothing is
    added to ``out``."""
    model, x, y = make("small_cnn", True)
    clipper = PerExampleClipper(model, 1.0, "per_layer", mode=mode)
    assert clipper.mode == mode
    x = x.clone()
    x[4, 1, 2, 3] = bad
    out = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    with pytest.raises(
        ValueError,
        match=r"^clipped_sum: example 4 of x holds a non-finite value \(NaN or inf\); "
        "every example must be finite",
    ):
        clipper.clipped_sum(x, y, out=out)
    assert all(torch.count_nonzero(g) == 0 for g in out.values())
    copies = x.repeat_interleave(2, 0)  # multiplicity 2: rows 8 and 9 are example 4's copies
    copies[8] = 0.0
    with pytest.raises(
        ValueError, match=r"^clipped_sum: row 9 of x \(example 4\) holds a non-finite value"
    ):
        clipper.clipped_sum(copies, y, multiplicity=2)
    w = torch.ones(len(y), dtype=x.dtype)
    w[2] = bad
    with pytest.raises(
        ValueError, match=r"^clipped_sum: example 2's weight holds a non-finite value"
    ):
        clipper.clipped_sum(x.nan_to_num(0.0, 0.0, 0.0), y, weights=w)
    x[4] = 0.0
    assert torch.isfinite(clipper.clipped_sum(x, y).norms).all()  # finite examples: as before
    unchecked = PerExampleClipper(model, 1.0, "per_layer", mode="vmap", check_finite=False)
    x[4, 1, 2, 3] = bad
    assert not torch.isfinite(unchecked.clipped_sum(x, y).norms[4]).all()  # what the check prevents
    ghost = PerExampleClipper(model, 1.0, "per_layer", mode="ghost", check_finite=False)
    with pytest.raises(
        ValueError, match=r"^clipped_sum: the (loss|gradient of parameter '.*') is not finite"
    ):
        ghost.clipped_sum(x, y)  # its proving first call: one clear line, not atol=nan


def test_groups_structure():
    model = MLP(60, (1000,), 10, bias=True)
    g = PerExampleClipper(model, 1.0, "global")
    assert g.groups == [[n for n, _ in model.named_parameters()]]
    pl = PerExampleClipper(model, 1.0, "per_layer")
    assert pl.groups == [["net.0.weight", "net.0.bias"], ["net.2.weight", "net.2.bias"]]


def test_frozen_parameters_are_excluded():
    model, x, y = make("deep_mlp", True)
    model.net[0].weight.requires_grad_(False)
    clipper = PerExampleClipper(model, 0.1, "per_layer", mode="ghost")
    assert clipper.groups[0] == ["net.0.bias"]
    res = clipper.clipped_sum(x, y)
    assert "net.0.weight" not in res.grads
    ref = PerExampleClipper(model, 0.1, "per_layer", mode="vmap").clipped_sum(x, y)
    assert_close_dict(res.grads, ref.grads)


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
def test_param_grad_untouched(mode):
    model, x, y = make("mnist_mlp", True)
    PerExampleClipper(model, 1.0, mode=mode).clipped_sum(x, y)
    assert all(p.grad is None for p in model.parameters())


def test_batchnorm_refused():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="'1'.*BatchNorm2d"):
        PerExampleClipper(model, 1.0)


def test_auto_chooses_ghost_for_paper_models():
    for model in (MLP(60), CifarCNN()):
        clipper = PerExampleClipper(model, 1.0, mode="auto")
        assert clipper.mode == "ghost" and clipper.native


def test_bad_arguments():
    model = MLP(4, (3,), 2)
    with pytest.raises(ValueError, match="clip_norm"):
        PerExampleClipper(model, 0.0)
    with pytest.raises(ValueError, match="clipping"):
        PerExampleClipper(model, 1.0, clipping="layer")
    with pytest.raises(ValueError, match="mode"):
        PerExampleClipper(model, 1.0, mode="fast")


class SeqModel(nn.Module):
    """Embedding + LayerNorm (ghost rules) + PReLU (no ghost rule: per-module vmap) + Linear on
    sequences (ghost)."""

    def __init__(self, d=16, T=4):
        super().__init__()
        self.emb = nn.Embedding(20, d)
        self.norm = nn.LayerNorm(d)
        self.rms = nn.PReLU()
        self.proj = nn.Linear(d, 64)
        self.head = nn.Linear(64 * T, 10)

    def forward(self, tokens):
        h = torch.tanh(self.proj(self.rms(self.norm(self.emb(tokens)))))
        return self.head(h.flatten(1))


@pytest.mark.parametrize("clipping", ["global", "per_layer"])
@pytest.mark.parametrize("budget", [2**28, 0])  # keep explicit products / ghost Gram + book-keeping
def test_unsupported_layers_fall_back_exactly(clipping, budget):
    torch.manual_seed(0)
    model = SeqModel().to(DT)
    x, y = torch.randint(0, 20, (9, 4)), torch.randint(0, 10, (9,))
    auto = PerExampleClipper(model, 0.05, clipping, mode="auto", memory_budget_bytes=budget)
    assert auto.mode == "ghost" and not auto.native  # hybrid: ghost + per-module vmap
    ref = PerExampleClipper(model, 0.05, clipping, mode="vmap").clipped_sum(x, y)
    res = auto.clipped_sum(x, y)
    assert_close_dict(res.grads, ref.grads)
    torch.testing.assert_close(res.norms, ref.norms)


class OwnsParamsAndChildren(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(x * self.scale)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):  # a.weight also used outside a's forward call
        h = torch.relu(self.a(x))
        return self.b(h @ self.a.weight)


class InplaceRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 7), nn.Linear(7, 3)

    def forward(self, x):
        return self.b(torch.relu_(self.a(x)))


def test_inplace_op_on_layer_output_is_exact():
    torch.manual_seed(0)
    model = InplaceRelu().to(DT)
    x, y = torch.randn(5, 6, dtype=DT), torch.randint(0, 3, (5,))
    ref = PerExampleClipper(model, 0.1, "global", mode="vmap").clipped_sum(x, y)
    ghost = PerExampleClipper(model, 0.1, "global", mode="ghost")
    assert_close_dict(ghost.clipped_sum(x, y).grads, ref.grads)


class SharedOutputGrad(nn.Module):
    """Layers whose output gradients alias: two heads added (both receive the same gradient
    tensor from the addition), a head whose gradient is expanded (stride 0), two convs added,
    and a sequence Linear. The engine rescales output gradients in place only when it owns them."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
        self.seq = nn.Linear(4, 5)
        self.h1, self.h2 = nn.Linear(5 * 16, 6), nn.Linear(5 * 16, 6, bias=False)
        self.e = nn.Linear(5 * 16, 1)

    def forward(self, x):
        z = torch.relu(self.c1(x) + self.c2(x))  # [B, 4, 4, 4]
        s = torch.relu(self.seq(z.flatten(2).transpose(1, 2)))  # [B, 16, 5]
        f = s.flatten(1)
        return self.h1(f) + self.h2(f) + self.e(f).expand(-1, 6)


@pytest.mark.parametrize("clipping", ["global", "per_layer"])
@pytest.mark.parametrize("budget", [2**28, 0])
def test_aliased_output_gradients_are_exact(clipping, budget):
    torch.manual_seed(0)
    model = SharedOutputGrad().to(DT)
    x, y = torch.randn(7, 3, 4, 4, dtype=DT), torch.randint(0, 6, (7,))
    ref = PerExampleClipper(model, 0.05, clipping, mode="vmap").clipped_sum(x, y)
    g = PerExampleClipper(model, 0.05, clipping, mode="ghost", memory_budget_bytes=budget)
    # e's output is broadcast to all 6 logits, so its output gradient is
    # Σ_k (softmax − onehot)_k = 0 in exact arithmetic: e.weight and e.bias are rounding noise
    # (~1e-17..1e-15) in both engines, hence an absolute floor: the round-off of a clipped sum of 7
    # examples of norm <= C, f64_rtol·7·C, far below every real gradient here (norms 0.014–0.13,
    # C = 0.05)
    floor = f64_rtol(model) * 7 * 0.05
    assert max(ref.grads[n].abs().max().item() for n in ("e.weight", "e.bias")) < floor
    for _ in range(2):  # first call proves its signature, second is the fast path
        assert_close_dict(g.clipped_sum(x, y).grads, ref.grads, atol=floor)


@pytest.mark.parametrize("cls", [OwnsParamsAndChildren, Tied])
def test_structures_ghost_cannot_handle(cls):
    torch.manual_seed(0)
    model = cls().to(DT)
    n_in = 8 if cls is OwnsParamsAndChildren else 6
    x, y = torch.randn(5, n_in, dtype=DT), torch.randint(0, 3, (5,))
    ref = PerExampleClipper(model, 0.1, "global", mode="vmap").clipped_sum(x, y)
    auto = PerExampleClipper(model, 0.1, "global", mode="auto")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        res = auto.clipped_sum(x, y)
    # Tied passes the build (each module has a rule) and fails its first call's proof
    assert auto.mode == ("vmap" if cls is OwnsParamsAndChildren else "ghost+vmap")
    assert_close_dict(res.grads, ref.grads)
    with pytest.raises(ValueError, match="ghost"):
        PerExampleClipper(model, 0.1, mode="ghost").clipped_sum(x, y)


def _conv_net(conv):
    return nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.LazyLinear(5))


@pytest.mark.parametrize(
    "conv, shape",
    [
        (lambda: nn.Conv2d(16, 8, 3, stride=2, dilation=2, padding=1), (16, 11, 9)),
        (
            lambda: nn.Conv2d(16, 8, (3, 2), stride=(1, 2), padding=2, padding_mode="reflect"),
            (16, 10, 9),
        ),
        (lambda: nn.Conv2d(4, 8, 3, groups=2, padding="same"), (4, 8, 8)),
        (lambda: nn.Conv2d(32, 8, 3, padding="same", bias=False), (32, 8, 8)),
        (lambda: nn.Conv2d(3, 6, 4, stride=3, padding_mode="circular", padding=1), (3, 10, 10)),
    ],
)
@pytest.mark.parametrize("budget", [2**28, 0])
@pytest.mark.parametrize("route", [None, "ghost", "explicit"])  # layers.ROUTE: by cost, or forced
def test_conv_variants(conv, shape, budget, route, monkeypatch):
    from dpsgd.mechanism.clipping import layers

    monkeypatch.setattr(layers, "ROUTE", route)
    torch.manual_seed(0)
    model = _conv_net(conv()).to(DT)
    x, y = torch.randn((7,) + shape, dtype=DT), torch.randint(0, 5, (7,))
    model(x)  # materialise the lazy layer
    for clipping in ("global", "per_layer"):
        g = PerExampleClipper(model, 0.05, clipping, mode="ghost", memory_budget_bytes=budget)
        ref = PerExampleClipper(model, 0.05, clipping, mode="vmap").clipped_sum(x, y)
        assert_close_dict(g.clipped_sum(x, y).grads, ref.grads)


def test_conv_row_products_in_chunks_of_one_example(monkeypatch):
    """The width-unfolded input is formed a chunk of examples at a time: chunks of one are exact."""
    from dpsgd.mechanism.clipping import layers
    from dpsgd.mechanism.clipping.rules import conv

    monkeypatch.setattr(conv, "CHUNK_BYTES", 1)
    monkeypatch.setattr(layers, "ROUTE", "explicit")
    torch.manual_seed(0)
    model = _conv_net(nn.Conv2d(16, 8, (3, 2), stride=(2, 1), dilation=(1, 2), padding=1)).to(DT)
    x, y = torch.randn(5, 16, 9, 10, dtype=DT), torch.randint(0, 5, (5,))
    model(x)
    for budget in (2**28, 0):  # kept per-example products; norms only
        g = PerExampleClipper(model, 0.05, "global", mode="ghost", memory_budget_bytes=budget)
        ref = PerExampleClipper(model, 0.05, "global", mode="vmap").clipped_sum(x, y)
        res = g.clipped_sum(x, y)
        assert_close_dict(res.grads, ref.grads)
        assert_f64_close(res.norms, ref.norms, f64_rtol(model))


def test_conv_ghost_gram_in_chunks_of_one_example_with_multiplicity(monkeypatch):
    """The ghost route's unfolded input, a chunk of whole examples (K rows each) at a time: chunks
    of one are the batch-of-1 loop's sums, grouped and strided convolutions alike."""
    from dp_reference import assert_close, loop_clipped_sum
    from dpsgd.mechanism.clipping import layers
    from dpsgd.mechanism.clipping.rules import conv

    monkeypatch.setattr(conv, "CHUNK_BYTES", 1)
    monkeypatch.setattr(layers, "ROUTE", "ghost")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(4, 8, 3, stride=2, groups=2, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.Conv2d(8, 6, (2, 3), dilation=(2, 1), padding_mode="reflect", padding=1),
        nn.Flatten(),
        nn.LazyLinear(5),
    ).to(DT)
    x, y = torch.randn(8, 4, 7, 6, dtype=DT), torch.randint(0, 5, (4,))
    model(x)
    g = PerExampleClipper(model, 0.05, "per_layer", mode="ghost")
    res = g.clipped_sum(x, y, multiplicity=2)
    ref, norms = loop_clipped_sum(model, x, y, g.groups, 0.05, K=2)
    assert_close(res.grads, ref)
    assert_f64_close(res.norms, norms, f64_rtol(model))


@pytest.mark.slow  # ~15 s: a float64 resnet18, batch-of-1 loop and four engines
def test_resnet18_groupnorm_every_route_equals_the_batch_of_one_loop(monkeypatch):
    """torchvision's resnet18 with GroupNorm (the benchmark's model): ghost Gram norms on the
    small feature maps, explicit products on the first convolution, and every route forced."""
    from torchvision.models import resnet18

    from dp_reference import assert_close, loop_clipped_sum
    from dpsgd.mechanism.clipping import layers

    torch.manual_seed(0)
    model = resnet18(num_classes=5, norm_layer=lambda c: nn.GroupNorm(8, c)).to(DT)
    x, y = torch.randn(3, 3, 32, 32, dtype=DT), torch.randint(0, 5, (3,))
    ref = None
    for route, budget in ((None, 2**26), ("ghost", 0), ("explicit", 0), ("explicit", 2**30)):
        monkeypatch.setattr(layers, "ROUTE", route)
        g = PerExampleClipper(model, 0.05, "per_layer", mode="ghost", memory_budget_bytes=budget)
        assert g.native
        res = g.clipped_sum(x, y)
        if ref is None:
            ref, norms = loop_clipped_sum(model, x, y, g.groups, 0.05)
        assert_close(res.grads, ref)
        assert_f64_close(res.norms, norms, f64_rtol(model))


def test_vmap_chunking_is_exact():
    model, x, y = make("small_cnn", True)
    a = PerExampleClipper(model, 0.05, "per_layer", mode="vmap", memory_budget_bytes=1)
    b = PerExampleClipper(model, 0.05, "per_layer", mode="vmap")
    # chunks change how the per-example sum over the batch is split: reduction over the 9 examples
    assert_close_dict(
        a.clipped_sum(x, y).grads, b.clipped_sum(x, y).grads, rtol=reduction_rtol(x.shape[0])
    )


# 10.25 (float32) and 12.25, 49.0 (float64): values where reciprocal(C)·C < 1
@pytest.mark.parametrize("C", [0.1, 0.3, 1.0, 3.3, 4.0, 10.25, 12.25, 49.0])
@pytest.mark.parametrize("dtype", [torch.float32, DT])
def test_clip_factors_are_exactly_one_below_C_and_C_over_norm_above(C, dtype):
    from dpsgd.mechanism.clipping import clip_factors

    g = torch.Generator().manual_seed(0)
    below = torch.rand(50_000, generator=g, dtype=dtype) * C
    below[:2] = torch.tensor([0.0, C], dtype=dtype)  # zero gradient; exactly at the bound
    assert torch.equal(clip_factors(below, C), torch.ones_like(below))
    above = C * (1 + torch.rand(1000, generator=g, dtype=dtype) * 10)
    c = torch.tensor(C, dtype=dtype).item()  # C as the tensor's dtype holds it
    exact = torch.tensor([c / v for v in above.tolist()], dtype=DT).to(dtype)  # correctly rounded
    # exact: correctly rounded C/norm, one true division on either side
    torch.testing.assert_close(clip_factors(above, C), exact, rtol=0, atol=0)
    assert torch.equal(clip_factors(above, None), torch.ones_like(above))
    assert torch.equal(
        clip_factors(torch.tensor([float("inf")], dtype=dtype), C), torch.zeros(1, dtype=dtype)
    )


def _accumulates_exactly(model, x, y, clipping, mode, budget=2**28):
    """clipped_sum(out=acc) adds into acc in place: acc_after = acc_before + clipped_sum()."""
    ref = PerExampleClipper(model, 0.05, clipping, mode="vmap").clipped_sum(x, y)
    clipper = PerExampleClipper(model, 0.05, clipping, mode=mode, memory_budget_bytes=budget)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # first call proves its signature, second is the fast path
        before = {
            n: torch.randn(g.shape, generator=gen, dtype=g.dtype) for n, g in ref.grads.items()
        }
        acc = {n: t.clone() for n, t in before.items()}
        ptrs = {n: t.data_ptr() for n, t in acc.items()}
        res = clipper.clipped_sum(x, y, out=acc)
        assert all(res.grads[n] is acc[n] and acc[n].data_ptr() == ptrs[n] for n in acc)
        # acc ~ 1: adding into it and subtracting again costs <= 2 ulps of each entry of acc
        # (norm-wise: 2·eps64·|acc|); the engines' difference is within assert_close_dict's rtol
        assert_close_dict(
            {n: acc[n] - before[n] for n in acc},
            ref.grads,
            atol=4 * EPS64 * max(t.norm().item() for t in acc.values()),
        )
    return clipper


@pytest.mark.parametrize("clipping", ["global", "per_layer"])
@pytest.mark.parametrize("mode", ["ghost", "vmap"])
@pytest.mark.parametrize("name", ["mnist_mlp", "cifar_cnn"])
def test_clipped_sum_accumulates_into_out(name, mode, clipping):
    model, x, y = make(name, bias=True)
    for budget in (2**28, 0):  # conv: kept products / book-keeping
        _accumulates_exactly(model, x, y, clipping, mode, budget)


@pytest.mark.parametrize("budget", [2**28, 0])
def test_clipped_sum_accumulates_into_out_for_every_layer_kind(budget):
    torch.manual_seed(0)
    seq = SeqModel().to(DT)  # Embedding/LayerNorm (vmap), sequence Linear
    _accumulates_exactly(
        seq, torch.randint(0, 20, (9, 4)), torch.randint(0, 10, (9,)), "global", "ghost", budget
    )
    shared = SharedOutputGrad().to(DT)  # aliased output gradients, convs with bias
    _accumulates_exactly(
        shared,
        torch.randn(7, 3, 4, 4, dtype=DT),
        torch.randint(0, 6, (7,)),
        "per_layer",
        "ghost",
        budget,
    )


def test_fallback_to_vmap_with_out_adds_once():
    """A model ghost refuses on its first call falls back to vmap: out receives the sum once."""
    torch.manual_seed(0)
    model = Tied().to(DT)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        clipper = _accumulates_exactly(
            model, torch.randn(5, 6, dtype=DT), torch.randint(0, 3, (5,)), "global", "auto"
        )
    assert clipper.mode == "ghost+vmap"  # the signature's proof failed: it runs on vmap


@pytest.mark.parametrize("wide", [1, 10**9])  # every Linear weight sum transposed / none
@pytest.mark.parametrize("name", ["mnist_mlp", "deep_mlp"])
def test_linear_weight_sum_either_gemm_route(monkeypatch, name, wide):
    """(c ⊙ b)ᵀ a and (aᵀ (c ⊙ b))ᵀ (layers.WIDE_OUTPUT) give the vmap sums, also into out."""
    from dpsgd.mechanism.clipping import layers

    monkeypatch.setattr(layers, "WIDE_OUTPUT", wide)
    model, x, y = make(name, bias=True)
    for clipping in ("global", "per_layer"):
        got = PerExampleClipper(model, 0.05, clipping, mode="ghost").clipped_sum(x, y)
        ref = PerExampleClipper(model, 0.05, clipping, mode="vmap").clipped_sum(x, y)
        assert_close_dict(got.grads, ref.grads)
        assert all(g.is_contiguous() for g in got.grads.values())
        _accumulates_exactly(model, x, y, clipping, "ghost")
