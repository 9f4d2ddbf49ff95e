"""Frozen layers (requires_grad=False) in the clipping engines and the DP optimiser.

The paper's CIFAR-10 experiment (Abadi et al. 2016, §5.3) pretrains the convolutions of its network
on CIFAR-100, freezes them and trains only the fully connected layers with DP-SGD (per-layer
clipping, C = 3, σ = 6). Frozen parameters must be neither clipped, nor noised, nor counted among
the k clipping groups the accountant charges; the ghost engine must do no per-example work for
them, and must not make autograd run through (or keep activations of) a frozen stack that no
trainable layer lies below. float64, tolerances as in test_clipping.py.
"""

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dpsgd.mechanism.clipping import PerExampleClipper, ghost
from dpsgd.models.networks import CifarCNN
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.optim import DPSGD
from dpsgd.mechanism.plan import Plan
from test_clipping import DT, assert_close_dict, plain_sum_grad
from tolerances import assert_f64_close, f64_rtol

C, SIGMA = 3.0, 6.0  # the paper's CIFAR-10 clipping bound and noise (§5.3)
DENSE = ["classifier.1", "classifier.3", "classifier.5"]
FROZEN = {  # what is frozen -> parameter names with requires_grad=False
    "convs": ["features.0.weight", "features.0.bias", "features.3.weight", "features.3.bias"],
    "middle_fc1": ["classifier.1.weight", "classifier.1.bias"],
    "conv_weights_only": ["features.0.weight", "features.3.weight"],
}


def cifar(frozen, B=6, seed=0):
    """CifarCNN in float64 with the named parameters frozen, and a batch of B examples."""
    torch.manual_seed(seed)
    model = CifarCNN().to(DT)
    for n in FROZEN[frozen] if frozen else ():
        model.get_parameter(n).requires_grad_(False)
    x = torch.rand(B, 3, 24, 24, dtype=DT) * 2 - 1
    return model, x, torch.randint(0, 10, (B,))


class OpLog(TorchDispatchMode):
    """Counts the aten operators run (forward, backward and the engine's own products)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_frozen_convs_are_no_groups_and_k_counts_trained_modules():
    model, x, y = cifar("convs")
    pl = PerExampleClipper(model, C, "per_layer")
    assert pl.groups == [[f"{m}.weight", f"{m}.bias"] for m in DENSE]  # k = 3
    gl = PerExampleClipper(model, C, "global")
    assert gl.groups == [[n for m in DENSE for n in (f"{m}.weight", f"{m}.bias")]]  # k = 1
    for clipper, k in ((pl, 3), (gl, 1)):
        res = clipper.clipped_sum(x, y)
        assert res.norms.shape == (x.shape[0], k)
        assert set(res.grads) == set(clipper.trainable) and not set(res.grads) & set(
            FROZEN["convs"]
        )


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
@pytest.mark.parametrize("frozen", list(FROZEN))
def test_dpsgd_step_leaves_frozen_parameters_bit_identical(mode, frozen):
    model, x, y = cifar(frozen)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = DPSGD(
        model,
        PerExampleClipper(model, C, "per_layer", mode=mode),
        GaussianNoise(seed=1),
        Plan.by_hand(SIGMA, C, len(x)),
        lr=0.1,
    )
    opt.step(x, y)
    for n, p in model.named_parameters():
        if n in FROZEN[frozen]:
            assert torch.equal(p, before[n]) and p.grad is None, n  # not clipped, noised, moved
        else:
            assert not torch.equal(p, before[n]), n  # noise σC = 18 moves it


@pytest.fixture
def captures(monkeypatch):
    """Every ``ghost.Capture`` the engine opens, in order."""
    opened = []

    class Recording(ghost.Capture):
        def __enter__(self):
            opened.append(self)
            return super().__enter__()

    monkeypatch.setattr(ghost, "Capture", Recording)
    return opened


def test_ghost_does_no_work_for_a_frozen_conv_stack(captures):
    """Frozen convolutions below every trainable layer: not hooked, not recorded, no activation of
    theirs saved for backward, no convolution or pooling backward run."""
    ops, saved = {}, {}
    for frozen in ("convs", None):
        model, x, y = cifar(frozen)
        clipper = PerExampleClipper(model, C, "per_layer", mode="ghost")
        clipper.clipped_sum(x, y)  # the first call also proves its signature (proof.py)
        shapes = []
        with (
            OpLog() as log,
            torch.autograd.graph.saved_tensors_hooks(
                lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t
            ),
        ):
            clipper.clipped_sum(x, y)
        ops[frozen], saved[frozen] = log.ops, shapes
        if frozen:
            assert [type(l.module) for l in clipper._layers] == [nn.Linear] * 3
            assert [l.module for l in clipper._layers] == [model.get_submodule(m) for m in DENSE]
            recorded = captures[-1].records.values()
            assert len(recorded) == 3 and all(a.dim() == 2 for a, *_ in recorded)
    assert ops["convs"]["convolution"] == 2  # the frozen forward pass only
    for op in ("convolution_backward", "max_pool2d_with_indices_backward", "bmm"):
        assert ops["convs"][op] == 0 and ops[None][op] > 0, op  # the counters do see them
    assert not [s for s in saved["convs"] if len(s) == 4]  # no [B, C, H, W] tensor kept
    assert [s for s in saved[None] if len(s) == 4]


def test_bias_only_layers_keep_no_input(captures):
    """Conv weights frozen, biases trained: the bias gradient is Σ_t b_i(t), so the conv inputs
    (the [B, 64, 12, 12] pooled map that nothing else keeps) are not recorded."""
    model, x, y = cifar("conv_weights_only")
    clipper = PerExampleClipper(model, C, "per_layer", mode="ghost")
    clipper.clipped_sum(x, y)
    recs = captures[-1].records
    kinds = [(type(l.module), recs[i][0] is None) for i, l in enumerate(clipper._layers)]
    assert kinds == [(nn.Conv2d, True)] * 2 + [(nn.Linear, False)] * 3


@pytest.mark.parametrize("frozen", list(FROZEN))
@pytest.mark.parametrize("clipping", ["global", "per_layer"])
@pytest.mark.parametrize("max_norm", [0.05, C])  # every example clipped / the paper's C
def test_ghost_equals_vmap_with_frozen_layers(frozen, clipping, max_norm):
    """Also fc1 frozen between trainable convolutions and fc2: the gradient reaches the convs
    through the frozen layer."""
    model, x, y = cifar(frozen)
    g = PerExampleClipper(model, max_norm, clipping, mode="ghost")
    v = PerExampleClipper(model, max_norm, clipping, mode="vmap")
    rg, rv = g.clipped_sum(x, y), v.clipped_sum(x, y)
    assert g.mode == "ghost" and v.mode == "vmap" and g.groups == v.groups
    assert set(rg.grads) == set(g.trainable) and not set(rg.grads) & set(FROZEN[frozen])
    assert_close_dict(rg.grads, rv.grads, rtol=1e-5)
    assert_f64_close(rg.norms, rv.norms, f64_rtol(model))  # two kernels, float64 (tolerances.py)
    assert float(rg.loss_sum) == pytest.approx(float(rv.loss_sum), rel=f64_rtol(model))
    assert bool((rg.norms > 0).all())  # every group gets gradient


@pytest.mark.parametrize("frozen", list(FROZEN))
def test_ghost_without_clipping_is_plain_gradient_with_frozen_layers(frozen):
    model, x, y = cifar(frozen)
    res = PerExampleClipper(model, None, "per_layer", mode="ghost").clipped_sum(x, y)
    assert_close_dict(res.grads, plain_sum_grad(model, x, y), rtol=f64_rtol(model))


@pytest.mark.parametrize("frozen", list(FROZEN))
def test_auto_picks_ghost_with_frozen_layers(frozen):
    model, x, y = cifar(frozen)
    clipper = PerExampleClipper(model, C, "per_layer", mode="auto")
    assert clipper.mode == "ghost" and clipper.native
    clipper.clipped_sum(x, y)  # the autograd check passes
    assert clipper.mode == "ghost"


@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_requires_grad_change_after_build_is_refused(change):
    model, x, y = cifar("convs")
    clipper = PerExampleClipper(model, C, "per_layer")
    p = model.get_parameter("features.0.weight" if change == "unfreeze" else "classifier.1.bias")
    p.requires_grad_(change == "unfreeze")
    with pytest.raises(
        ValueError,
        match=r"^requires_grad changed for "
        + ("features.0.weight" if change == "unfreeze" else "classifier.1.bias"),
    ):
        clipper.clipped_sum(x, y)


def test_bench_frozen_runs_end_to_end(tmp_path):
    """The benchmark's protocol on tiny lots (timings are never asserted)."""
    import csv

    from bench import bench_frozen

    out = tmp_path / "frozen.csv"
    bench_frozen.main(["--lots", "4", "--reps", "2", "--warmup", "0", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert all(r.keys() == set(bench_frozen.COLUMNS) for r in rows)
    assert [(r["method"], r["groups"]) for r in rows] == [
        ("nonprivate", "0"),
        ("dpsgd_ghost_frozen", "3"),
        ("dpsgd_ghost_all", "5"),
    ]
    assert rows[0]["ratio_to_nonprivate"] == "1.000" and rows[0]["lots_per_epoch"] == "12500"
    for r in rows:
        assert float(r["step_s_min"]) <= float(r["step_s"]) <= float(r["step_s_max"])
        # N / L lots × the median step, both as printed (step to 1e-4 s, epoch to 0.1 s)
        assert float(r["epoch_s"]) == pytest.approx(
            12500 * float(r["step_s"]), abs=12500 * 5e-5 + 0.05
        )
