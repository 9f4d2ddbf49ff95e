"""The same code on CUDA: clipping engines (every layer rule against the batch-of-1 loop), the DP
step, noise, fixed-shape padded lots, a short training run and a bit-identical seeded resume.

Skipped where no GPU is present (CI has none); run on a GPU machine with
``python -m pytest tests/e2e/test_cuda.py``. Each test compares the CUDA result with the CPU result
or with the reference engine on the GPU, so a device-specific bug shows up as a mismatch.
"""

import copy
import csv

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.models.networks import MLP, CifarCNN
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.optim import DPSGD
from dpsgd.mechanism.plan import Plan
from tolerances import assert_f64_close, f64_rtol

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DT = torch.float64


def _model(name):
    torch.manual_seed(0)
    if name == "mnist_mlp":
        return MLP(60, (1000,), 10, bias=False), torch.randn(37, 60)
    if name == "cifar_cnn":
        return CifarCNN(10), torch.randn(6, 3, 24, 24)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )
    return net, torch.randn(9, 3, 8, 8)


def _close(a: dict, b: dict, rtol):
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].device.type == "cuda" and a[n].shape == b[n].shape, n
        err = (a[n].double().cpu() - b[n].double().cpu()).norm().item()
        assert err <= rtol * b[n].double().cpu().norm().item(), (n, err)


@pytest.mark.parametrize("name", ["mnist_mlp", "small_cnn", "cifar_cnn"])
@pytest.mark.parametrize("clipping", ["global", "per_layer"])
@pytest.mark.parametrize("budget", [2**28, 0])
def test_ghost_on_cuda_equals_vmap_on_cuda_and_cpu(name, clipping, budget):
    model, x = _model(name)
    model, x = model.to(DT), x.to(DT)
    y = torch.randint(0, 10, (x.shape[0],))
    cpu = PerExampleClipper(model, 0.05, clipping, mode="vmap").clipped_sum(x, y)
    gm = copy.deepcopy(model).cuda()
    xg, yg = x.cuda(), y.cuda()
    ghost = PerExampleClipper(gm, 0.05, clipping, mode="ghost", memory_budget_bytes=budget)
    vmap = PerExampleClipper(gm, 0.05, clipping, mode="vmap")
    for _ in range(2):  # the proving first call, then the fast path
        rg = ghost.clipped_sum(xg, yg)
    rv = vmap.clipped_sum(xg, yg)
    assert ghost.mode == "ghost"
    _close(rg.grads, rv.grads, 1e-5)
    _close(rg.grads, cpu.grads, 1e-5)
    # float64 on both devices, different kernels (cuBLAS/cuDNN vs CPU): tests/tolerances.py
    assert_f64_close(rg.norms.cpu(), cpu.norms, f64_rtol(model))
    assert float(rg.loss_sum) == pytest.approx(float(cpu.loss_sum), rel=f64_rtol(model))


def test_float32_ghost_on_cuda_matches_float64_cpu():
    model, x = _model("mnist_mlp")
    y = torch.randint(0, 10, (x.shape[0],))
    ref = PerExampleClipper(copy.deepcopy(model).to(DT), 4.0, "per_layer", mode="vmap").clipped_sum(
        x.to(DT), y
    )
    gm = copy.deepcopy(model).cuda()
    res = PerExampleClipper(gm, 4.0, "per_layer", mode="ghost").clipped_sum(x.cuda(), y.cuda())
    _close(res.grads, ref.grads, 1e-4)


def test_clipped_example_has_norm_C_on_cuda():
    model, x = _model("mnist_mlp")
    gm = model.cuda().to(DT)
    x1, y1 = x[:1].cuda().to(DT) * 50, torch.tensor([3], device="cuda")
    for clipping in ("global", "per_layer"):
        g = PerExampleClipper(gm, 0.7, clipping, mode="ghost").clipped_sum(x1, y1).grads
        if clipping == "global":
            total = torch.sqrt(sum(v.pow(2).sum() for v in g.values()))
            assert float(total) == pytest.approx(
                0.7, rel=f64_rtol(gm)
            )  # a norm over the parameters
        else:
            for v in g.values():
                assert float(v.norm()) == pytest.approx(0.7, rel=f64_rtol(gm))


def test_dp_step_without_clip_or_noise_is_plain_sgd_on_cuda():
    model, x = _model("mnist_mlp")
    model, x = model.cuda(), x.cuda()
    y = torch.randint(0, 10, (x.shape[0],), device="cuda")
    ref = copy.deepcopy(model)
    loss = F.cross_entropy(ref(x), y, reduction="sum") / 50.0
    with torch.no_grad():
        for p, g in zip(ref.parameters(), torch.autograd.grad(loss, list(ref.parameters()))):
            p.sub_(0.1 * g)
    dp = DPSGD(
        model,
        PerExampleClipper(model, None, mode="ghost"),
        GaussianNoise(seed=0, device="cuda"),
        Plan.by_hand(0.0, 1.0, 50),
        lr=0.1,
    )
    out = dp.step(x, y, physical_batch_size=16)
    assert out["loss_sum"].device.type == "cuda"
    for p, q in zip(model.parameters(), ref.parameters()):
        # float32 on the GPU, two reduction orders (DP step vs autograd): ~n·eps32 of the summed
        # loss
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_noise_on_cuda_std_reproducibility_and_resume():
    sigma_C = 3.0
    a, b = GaussianNoise(seed=4, device="cuda"), GaussianNoise(seed=4, device="cuda")
    t, u = torch.zeros(400_000, device="cuda"), torch.zeros(400_000, device="cuda")
    a.add_(t, sigma_C), b.add_(u, sigma_C)
    assert torch.equal(t, u) and t.device.type == "cuda"
    assert float(t.std()) == pytest.approx(sigma_C, rel=0.01)  # SE ≈ 0.0011 relative
    assert abs(float(t.mean())) < 6 * sigma_C / 400_000**0.5
    c = GaussianNoise(seed=0, device="cuda")
    c.load_state_dict(a.state_dict())
    assert torch.equal(a.sample((100,), 1.0), c.sample((100,), 1.0))
    s = GaussianNoise(secure=True, device="cuda").sample((200_000,), 2.0)
    # statistical: the SE of a std of 200 000 draws is 0.16 %
    assert s.device.type == "cuda" and float(s.std()) == pytest.approx(2.0, rel=0.01)


def test_empty_lot_on_cuda_is_noise_only():
    model, _ = _model("mnist_mlp")
    model = model.cuda()
    before = [p.detach().clone() for p in model.parameters()]
    dp = DPSGD(
        model,
        PerExampleClipper(model, 4.0, "per_layer"),
        GaussianNoise(seed=1, device="cuda"),
        Plan.by_hand(4.0, 4.0, 600),
        lr=0.1,
    )
    out = dp.step(
        torch.zeros(0, 60, device="cuda"), torch.zeros(0, dtype=torch.long, device="cuda")
    )
    assert out["lot_size"] == 0 and float(out["loss_sum"]) == 0.0
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    # statistical: the SE of a std of ~10^4 parameters is < 1 %
    assert float(moved.std()) == pytest.approx(0.1 * 4.0 * 4.0 / 600, rel=0.02)


def test_short_mnist_run_on_cuda(tmp_path):
    from dpsgd.config.schema import validate
    from dpsgd.launch.main import compose
    from dpsgd.train import train

    c = validate(
        compose(
            [
                "dataset.subset=5000",
                "privacy.lot_size=250",
                "privacy.sigma=1.0",
                "privacy.sigma_p=4",
                "training.epochs=10",
                "device=cuda",
            ]
        )
    )
    train(c, tmp_path / "run")
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert int(rows[-1]["steps"]) == 200
    assert float(rows[-1]["test_accuracy"]) > 0.75


@pytest.mark.parametrize("tf32", [False, True])
def test_float32_cnn_ghost_on_cuda_whatever_the_tf32_setting(tf32):
    # The first call's proof runs on a float64 copy of the model (proof.py), so TF32 (cuDNN's
    # default) cannot make the engine mistake rounding for a structural problem and fall back.
    from dpsgd.core.runtime import set_tf32

    before = set_tf32(tf32)
    try:
        model, x = _model("cifar_cnn")
        y = torch.randint(0, 10, (x.shape[0],))
        ref = PerExampleClipper(
            copy.deepcopy(model).to(DT), 1.0, "global", mode="vmap"
        ).clipped_sum(x.to(DT), y)
        gm = copy.deepcopy(model).cuda()
        g = PerExampleClipper(gm, 1.0, "global", mode="ghost")
        for _ in range(2):
            res = g.clipped_sum(x.cuda(), y.cuda())
        assert g.mode == "ghost"
        if tf32:  # TF32 rounding (10-bit mantissa): per-example norms (no cancellation) to 1 %
            torch.testing.assert_close(res.norms.double().cpu(), ref.norms, rtol=1e-2, atol=0.0)
        else:
            _close(res.grads, ref.grads, 1e-4)
    finally:
        set_tf32(before)


# ------------------------------------------------------------------- what make gpu-check's step (a)
# also asks of the device: every layer rule against Algorithm 1 read literally (one example at a
# time), fixed-shape padded lots, and a seeded resume. DEV is the device under test.
DEV = "cuda"


def _every_rule_net():
    """One module of each ghost rule (Conv2d, GroupNorm, Linear, LayerNorm, RMSNorm) and one without
    a rule (PReLU: the engine's per-module vmap fallback)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(4, 8),
        nn.Tanh(),
        nn.Conv2d(8, 16, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 3 * 3, 12),
        nn.LayerNorm(12),
        nn.RMSNorm(12),
        nn.PReLU(),
        nn.Tanh(),
        nn.Linear(12, 10),
    )


@pytest.mark.parametrize("clipping", ["global", "per_layer"])
@pytest.mark.parametrize("budget", [2**28, 0])  # kept per-example products / book-keeping
def test_every_layer_rule_on_cuda_equals_the_batch_of_1_loop(clipping, budget):
    from dp_reference import assert_close, loop_clipped_sum

    torch.manual_seed(0)
    model = _every_rule_net().to(DT).to(DEV)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 7, 7, generator=g, dtype=DT).to(DEV)
    y = torch.randint(0, 10, (7,), generator=g).to(DEV)
    C = 0.05  # small: every example is clipped in some group
    ghost = PerExampleClipper(model, C, clipping, mode="ghost", memory_budget_bytes=budget)
    for _ in range(2):  # the proving first call, then the fast path
        r_g = ghost.clipped_sum(x, y)
    r_v = PerExampleClipper(model, C, clipping, mode="vmap").clipped_sum(x, y)
    ref, ref_norms = loop_clipped_sum(model, x, y, ghost.groups, C)  # on the device too
    assert ghost.mode == "ghost" and next(iter(r_g.grads.values())).device.type == DEV
    assert_close(r_g.grads, ref)
    assert_close(r_v.grads, ref)
    # float64 on both sides, other kernels: tests/tolerances.py
    assert_f64_close(r_g.norms, ref_norms, f64_rtol(model))
    assert_f64_close(r_v.norms, ref_norms, f64_rtol(model))
    assert (ref_norms > C).any()


@pytest.mark.parametrize("mode", ["ghost", "vmap"])
def test_padded_lot_on_cuda_adds_exactly_zero(mode):
    """Fixed-shape lots: weight-0 rows add an exact 0 on the device, whatever they hold, and the
    padded lot's sum is the unpadded lot's to the engines' round-off
    (tests/mechanism/clipping/test_example_weights.py)."""
    torch.manual_seed(0)
    model = MLP(20, (30, 40), 10, bias=True).to(DT).to(DEV)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 20, generator=g, dtype=DT)
    y = torch.randint(0, 10, (11,), generator=g)
    clipper = PerExampleClipper(model, 0.5, "per_layer", mode=mode)
    ref = clipper.clipped_sum(x.to(DEV), y.to(DEV))
    got = []
    for seed in (1, 2):  # the same lot, two paddings of other content
        gp = torch.Generator().manual_seed(seed)
        xp = torch.cat([x, torch.randn(4, 20, generator=gp, dtype=DT)]).to(DEV)
        yp = torch.cat([y, torch.randint(0, 10, (4,), generator=gp)]).to(DEV)
        w = torch.cat([torch.ones(11), torch.zeros(4)]).to(DEV)
        got.append(clipper.clipped_sum(xp, yp, weights=w))
    for n in ref.grads:
        assert torch.equal(got[0].grads[n], got[1].grads[n]), n  # exact: 0 · finite = 0, same shape
        err = (got[0].grads[n] - ref.grads[n]).norm().item()
        # vmap: float64 kernels, f64_rtol; ghost: its book-keeping reorders the sums, 1e-5
        # (test_clipping.py)
        assert err <= (f64_rtol(model) if mode == "vmap" else 1e-5) * ref.grads[n].norm().item(), (
            n,
            err,
        )
    assert torch.equal(got[0].loss_sum, got[1].loss_sum)  # exact: 0 · loss


def test_seeded_resume_on_cuda_is_bit_identical(tmp_path):
    """A run stopped after 2 epochs and resumed to 4 equals the 4-epoch run on the device, bit for
    bit: the same lots, noise draws, parameters, ledger and metrics."""
    from dpsgd.config.schema import validate
    from dpsgd.run.checkpoint import load_checkpoint
    from dpsgd.launch.main import compose
    from dpsgd.launch.prepare import prepare_resume
    from dpsgd.train import train

    args = [
        "dataset.subset=3000",
        "privacy.lot_size=100",
        "model.hidden=[100]",
        "privacy.sigma=2",
        f"device={DEV}",
        "seed=3",
        "training.eval_batch_size=3000",
    ]
    for name, epochs in (("straight", 4), ("resumed", 2)):
        run = args + [f"training.epochs={epochs}"]
        train(validate(compose(run)), tmp_path / name, run)  # the overrides a resume starts from
    c, run_dir, rest = prepare_resume([f"resume={tmp_path / 'resumed'}", "training.epochs=4"])
    train(c, run_dir, rest)
    a, b = load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "resumed")
    assert a["steps"] == b["steps"] > 0 and a["ledger"] == b["ledger"]
    assert torch.equal(a["sampler"]["generator"], b["sampler"]["generator"])  # bit-identical
    assert torch.equal(a["noise"]["state"], b["noise"]["state"])  # bit-identical
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k  # bit-identical
    with (
        open(tmp_path / "straight" / "metrics.csv") as f,
        open(tmp_path / "resumed" / "metrics.csv") as g,
    ):
        ra, rb = list(csv.DictReader(f)), list(csv.DictReader(g))
    for col in ("epoch", "steps", "lot_loss", "test_accuracy", "epsilon"):
        assert [r[col] for r in ra] == [r[col] for r in rb], col
