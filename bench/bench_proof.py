"""What the clipper's proofs cost (dpsgd/mechanism/clipping/proof.py): the first call of an input
signature against a call whose signature is proved.

    python -m bench.bench_proof            # writes results/bench_proof.csv

Per model, on one in-memory batch (random inputs, one thread), after a warm-up on another clipper:
``step_s`` is the median of ``--reps`` calls of ``PerExampleClipper.clipped_sum`` on a proved
signature; ``first_call_s`` the median, over ``--reps`` fresh clippers, of their first call (the
proof included); ``proof_s`` their difference. Then a batch of a new signature (another sequence
length, or a batch size equal to another dimension, which the proof cannot shrink to a sub-batch):
``new_signature_s`` its first call, ``new_step_s`` its next ones, ``new_proof_s`` the difference.

Details: docs/PERFORMANCE.md, "bench/bench_proof.py".
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from bench import write_csv
from dpsgd.core.runtime import describe_hardware
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.models.networks import MLP, CifarCNN, TanhCNN

COLUMNS = [
    "model",
    "engine",
    "batch",
    "step_s",
    "first_call_s",
    "proof_s",
    "proof_over_step",
    "new_signature",
    "new_signature_s",
    "new_step_s",
    "new_proof_s",
    "reps",
    "threads",
    "load_avg_1min",
    "hardware",
    "torch",
]
ROOT = Path(__file__).resolve().parents[1]


class LSTMClassifier(nn.Module):
    def __init__(self, vocab=1000, d=64, hidden=128, classes=10):
        super().__init__()
        self.emb, self.rnn = nn.Embedding(vocab, d), nn.LSTM(d, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, idx):
        return self.head(self.rnn(self.emb(idx))[0][:, -1])


class SmallTransformer(nn.Module):
    def __init__(self, vocab=1000, d=64, classes=10):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, 2, 128, dropout=0.0, batch_first=True)
        self.emb, self.enc = nn.Embedding(vocab, d), nn.TransformerEncoder(layer, 1)
        self.head = nn.Linear(d, classes)

    def forward(self, idx):
        return self.head(self.enc(self.emb(idx)).mean(1))


class SeqFirst(nn.Module):
    """A Linear on [T, B, d]: the ghost engine's rows are positions; T = B is proved wrong."""

    def __init__(self, d=64, classes=10):
        super().__init__()
        self.fc, self.head = nn.Linear(d, d), nn.Linear(d, classes)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x.transpose(0, 1))).mean(0))


def _images(B, shape):
    return lambda g: torch.rand((B,) + shape, generator=g)


def _tokens(B, T):
    return lambda g: torch.randint(0, 1000, (B, T), generator=g)


def _seq(B, T, d=64):
    return lambda g: torch.randn(B, T, d, generator=g)


# name: (model, batch, inputs, new signature: (what, inputs))
CASES = {
    "mnist_mlp": (
        lambda: MLP(60, (1000,), 10),
        600,
        _images(600, (60,)),
        ("B = 1000 (the hidden width)", _images(1000, (60,))),
    ),
    "cifar_cnn": (
        CifarCNN,
        256,
        _images(256, (3, 24, 24)),
        ("B = 64 (the channels)", _images(64, (3, 24, 24))),
    ),
    "tanh_cnn_groupnorm": (
        lambda: TanhCNN(norm="group"),
        256,
        _images(256, (1, 28, 28)),
        ("B = 32 (a layer width)", _images(32, (1, 28, 28))),
    ),
    "lstm": (LSTMClassifier, 50, _tokens(50, 32), ("B = 64 (the width)", _tokens(64, 32))),
    "transformer_vmap": (SmallTransformer, 50, _tokens(50, 16), ("T = 24", _tokens(50, 24))),
    "seq_first_linear": (SeqFirst, 20, _seq(20, 32), ("B = T = 32", _seq(32, 32))),
}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(name: str, reps: int) -> dict:
    build, B, inputs, (what, new_inputs) = CASES[name]
    torch.manual_seed(0)
    model = build()
    g = torch.Generator().manual_seed(1)
    x, x_new = inputs(g), new_inputs(g)
    y, y_new = (torch.randint(0, 10, (len(t),), generator=g) for t in (x, x_new))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallbacks' notes
        warm = PerExampleClipper(model, 1.0, "per_layer")
        warm.clipped_sum(x, y)
        warm.clipped_sum(x_new, y_new)
        steps = [_timed(lambda: warm.clipped_sum(x, y)) for _ in range(reps)]
        firsts, new_firsts, new_steps = [], [], []
        for _ in range(reps):
            c = PerExampleClipper(model, 1.0, "per_layer")
            firsts.append(_timed(lambda: c.clipped_sum(x, y)))
            new_firsts.append(_timed(lambda: c.clipped_sum(x_new, y_new)))
            new_steps.append(_timed(lambda: c.clipped_sum(x_new, y_new)))
    step, first = statistics.median(steps), statistics.median(firsts)
    new_first, new_step = statistics.median(new_firsts), statistics.median(new_steps)
    return {
        "model": name,
        "engine": c.mode,
        "batch": B,
        "step_s": f"{step:.4f}",
        "first_call_s": f"{first:.4f}",
        "proof_s": f"{first - step:.4f}",
        "proof_over_step": f"{(first - step) / step:.2f}",
        "new_signature": what,
        "new_signature_s": f"{new_first:.4f}",
        "new_step_s": f"{new_step:.4f}",
        "new_proof_s": f"{new_first - new_step:.4f}",
        "reps": reps,
        "threads": torch.get_num_threads(),
        "load_avg_1min": f"{os.getloadavg()[0]:.2f}",
        "hardware": describe_hardware(),
        "torch": torch.__version__,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(CASES), help="comma list of " + ", ".join(CASES))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "results" / "bench_proof.csv"))
    a = p.parse_args(argv)
    names = a.models.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown or a.reps < 1:
        p.error(f"--models: unknown {unknown}" if unknown else "--reps must be >= 1")
    torch.set_num_threads(a.threads)
    rows = []
    for n in names:
        rows.append(measure(n, a.reps))
        print(", ".join(f"{k}={rows[-1][k]}" for k in COLUMNS[:11]), flush=True)
    write_csv(rows, Path(a.out), COLUMNS)


if __name__ == "__main__":
    main()
