"""Today's models, each method as a ratio to a plain PyTorch step, from one interleaved run.

    python -m bench.bench_models              # writes results/bench_models.csv
    python -m bench.bench_models --quick      # smoke run (tiny shapes, short blocks)
    python -m bench.bench_models --models resnet18_gn --methods plain,dpsgd

Models (one lot in memory, random data of the real shape, 10 classes):

  resnet18_gn       torchvision resnet18, every BatchNorm a GroupNorm(32, C), 3×32×32 input, lot 32
  text_transformer  Embedding(10 000, 128) → 2 × nn.TransformerEncoderLayer(d_model 128, 4 heads,
                    feed-forward 512, dropout 0.1, batch_first) → mean over the sequence → Linear;
                    sequences of 64 tokens, lot 128
  paper_mlp         the paper's MNIST network: PCA-60 input → 1000 ReLU → 10, no biases, lot 600

Methods: ``plain`` is the plain PyTorch step every ratio is against (forward, mean cross-entropy,
one backward, ``torch.optim.SGD``); ``nonprivate`` and ``dpsgd`` are ``dpsgd.PrivateTrainer``
(``private=False``; and DP-SGD with global clipping, C = 1, σ = 1, ``grad_sample_mode=auto``), one
lot through ``trainer.lots.run`` as ``fit`` runs it (the ledger's charge included); ``dpsgd`` draws
the next lot's noise on the second core meanwhile (``dpsgd/mechanism/noise.py``, the default where
two cores are usable), ``dpsgd_1core`` draws it in the step (one core in all); ``opacus_hooks``
and ``opacus_ghost`` are Opacus (``make bench`` installs 1.6.0) through
``PrivacyEngine.make_private``, the model first through ``ModuleValidator.fix`` where Opacus needs
it (nn.MultiheadAttention → its DPMultiheadAttention) and its ReLUs out of place (Opacus' backward
hooks refuse resnet's in-place ReLU and residual addition). Details: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench import write_csv
from dpsgd.core.runtime import describe_hardware, tune_allocator

COLUMNS = ["model", "method", "lot", "threads", "step_ms", "ratio", "ratio_min", "ratio_max",
           "cpu_ratio", "reps", "steps_per_rep", "loadavg_1min", "torch", "opacus",
           "hardware"]  # fmt: skip
METHODS = ["plain", "nonprivate", "dpsgd", "dpsgd_1core", "opacus_hooks", "opacus_ghost"]
OUT = Path(__file__).resolve().parents[1] / "results" / "bench_models.csv"
LR = 0.05


class TextTransformer(nn.Module):
    """Embedding → nn.TransformerEncoder (batch_first) → mean over positions → Linear."""

    def __init__(self, vocab=10_000, d=128, heads=4, ff=512, layers=2, classes=10, dropout=0.1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=dropout, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, idx):
        return self.head(self.enc(self.emb(idx)).mean(1))


def resnet18_gn():
    from torchvision.models import resnet18

    return resnet18(num_classes=10, norm_layer=lambda c: nn.GroupNorm(32, c))


def paper_mlp():
    from dpsgd.models.networks import MLP

    return MLP(60, (1000,), 10, bias=False)


def models(quick: bool) -> dict:
    """name -> (factory, inputs(lot, generator), lot)."""
    T, vocab = (8, 100) if quick else (64, 10_000)

    def images(n, g):
        return torch.randn(n, 3, 32, 32, generator=g)

    def tokens(n, g):
        return torch.randint(0, vocab, (n, T), generator=g)

    def features(n, g):
        return torch.randn(n, 60, generator=g)

    return {
        "resnet18_gn": (resnet18_gn, images, 4 if quick else 32),
        "text_transformer": (
            lambda: TextTransformer(vocab=vocab, d=16 if quick else 128, ff=32 if quick else 512),
            tokens,
            8 if quick else 128,
        ),
        "paper_mlp": (paper_mlp, features, 16 if quick else 600),
    }


# ----------------------------------------------------------------------------- the steps
def _plain(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _trainer(private: bool, ahead: bool = True):
    def build(model, x, y):
        from dpsgd.workbench.trainer import PrivateTrainer

        t = PrivateTrainer(model, (x, y), lot_size=len(x), clip_norm=1.0, sigma=1.0, seed=0,
                           lr=LR, clipping="global", private=private, threads=False)  # fmt: skip
        t.dp.noise.ahead_enabled &= ahead  # dpsgd_1core: every noise value drawn in the step
        return lambda: t.lots.run(0, x, y)

    return build


def _opacus(mode: str):
    def build(model, x, y):
        from opacus.validators import ModuleValidator

        from bench.bench_step import make_opacus

        if not ModuleValidator.is_valid(model):
            model = ModuleValidator.fix(model)
        _out_of_place(model)
        step = make_opacus(model, len(x), mode)
        return lambda: step(x, y)

    return build


def _out_of_place(model) -> None:
    """Opacus' backward hooks refuse an in-place op on a hooked layer's output: resnet's in-place
    ReLU and residual ``out += identity`` run out of place (the same function)."""
    from torchvision.models.resnet import BasicBlock

    for m in model.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False
        if isinstance(m, BasicBlock):
            m.forward = partial(_basic_block, m)


def _basic_block(b, x):
    identity = x if b.downsample is None else b.downsample(x)
    out = b.bn2(b.conv2(b.relu(b.bn1(b.conv1(x)))))
    return b.relu(out + identity)


BUILDERS = {
    "plain": _plain,
    "nonprivate": _trainer(False),
    "dpsgd": _trainer(True),
    "dpsgd_1core": _trainer(True, ahead=False),
    "opacus_hooks": _opacus("hooks"),
    "opacus_ghost": _opacus("ghost"),
}


def _opacus_version(methods) -> str:
    """Opacus' version where an Opacus method is asked for ("n/a" otherwise, or not installed)."""
    if not any(m.startswith("opacus") for m in methods):
        return "n/a"
    try:
        import opacus
    except ImportError:
        return "n/a"
    return opacus.__version__


# ----------------------------------------------------------------------------- measurement
def _block(step, n: int) -> tuple[float, float]:
    """(wall, CPU) seconds per step over n consecutive steps."""
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        step()
    return (time.perf_counter() - w0) / n, (time.process_time() - c0) / n


def measure(name, factory, inputs, lot, methods, reps, block_s, log) -> list[dict]:
    """One model: every method built on a copy of one initialisation, warmed up, then ``reps`` + 1
    interleaved repetitions (one block of each method in turn, the first dropped); a ratio is the
    median over repetitions of (method's block ÷ the plain block of the same repetition)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    base = factory()
    x, y = inputs(lot, g), torch.randint(0, 10, (lot,), generator=g)
    steps = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in methods:
            try:
                steps[m] = BUILDERS[m](copy.deepcopy(base), x, y)
                steps[m]()  # first call: library set-up, the proof of the signature
            except Exception as e:  # noqa: BLE001 - e.g. Opacus missing or refusing the model
                log(f"  {m}: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
                steps.pop(m, None)
        counts = {m: max(1, round(block_s / max(1e-6, _block(s, 1)[0]))) for m, s in steps.items()}
        wall = {m: [] for m in steps}
        cpu = {m: [] for m in steps}
        for r in range(reps + 1):
            for m, step in steps.items():
                w, c = _block(step, counts[m])
                if r:
                    wall[m].append(w)
                    cpu[m].append(c)
            if r:
                log(f"  rep {r}/{reps}: " + ", ".join(f"{m} {1e3 * wall[m][-1]:.1f}" for m in wall))
    rows = []
    ref_w, ref_c = wall.get("plain"), cpu.get("plain")
    for m in wall:
        ratios = [t / b for t, b in zip(wall[m], ref_w)] if ref_w else [float("nan")]
        cratios = [t / b for t, b in zip(cpu[m], ref_c)] if ref_c else [float("nan")]
        rows.append({
            "model": name, "method": m, "lot": lot, "threads": torch.get_num_threads(),
            "step_ms": round(1e3 * statistics.median(wall[m]), 2),
            "ratio": round(statistics.median(ratios), 3), "ratio_min": round(min(ratios), 3),
            "ratio_max": round(max(ratios), 3), "cpu_ratio": round(statistics.median(cratios), 3),
            "reps": len(ratios), "steps_per_rep": counts[m],
        })  # fmt: skip
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_models", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--models", default="all", help="comma list, or all")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--block-s", type=float, default=1.0, help="seconds per block of steps")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, every method alike")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 repetitions")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    chosen = models(a.quick)
    names = list(chosen) if a.models == "all" else [m for m in a.models.split(",") if m]
    methods = [m for m in a.methods.split(",") if m]
    if set(names) - set(chosen) or set(methods) - set(METHODS) or "plain" not in methods:
        ap.exit(2, f"{ap.prog}: error: --models from {list(chosen)}, --methods from {METHODS} "
                   "(plain among them: every ratio is against it)\n")  # fmt: skip
    if a.reps < 1 or not a.block_s > 0 or a.threads < 1:
        ap.exit(2, f"{ap.prog}: error: --reps and --threads must be >= 1, --block-s > 0\n")
    if a.quick:
        a.reps, a.block_s = min(a.reps, 2), min(a.block_s, 0.05)
    torch.set_num_threads(a.threads)
    tune_allocator()  # as training runs (every method alike)
    opacus = _opacus_version(methods)
    if opacus == "n/a" and any(m.startswith("opacus") for m in methods):
        methods = [m for m in methods if not m.startswith("opacus")]
        print("opacus not installed (make bench installs 1.6.0): its rows are left out")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    import os

    rows = []
    for name in names:
        factory, inputs, lot = chosen[name]
        load = os.getloadavg()[0]
        log(f"{name} (lot {lot}), load average {load:.2f}")
        for r in measure(name, factory, inputs, lot, methods, a.reps, a.block_s, log):
            r.update(loadavg_1min=round(load, 2), torch=torch.__version__,
                     opacus=opacus, hardware=describe_hardware())  # fmt: skip
            rows.append(r)
            print(f"{name:18s} {r['method']:14s} {r['step_ms']:9.2f} ms  × {r['ratio']:.3f} "
                  f"[{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]  cpu × {r['cpu_ratio']:.3f}")  # fmt: skip
        write_csv(rows, a.out, COLUMNS)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
