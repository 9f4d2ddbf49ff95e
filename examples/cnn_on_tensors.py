"""DP-SGD on your own CNN and data: CIFAR-shaped tensors (generated here; use your own), trained to
a target ε with dpsgd.PrivateTrainer. Run: python examples/cnn_on_tensors.py [--epochs E] [--n N]"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import dpsgd


class SmallCNN(nn.Module):
    """Conv2d, GroupNorm (not BatchNorm: it mixes examples), Linear."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Linear(32 * 8 * 8, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="training examples")
    ap.add_argument("--epochs", type=float, default=3)
    ap.add_argument("--epsilon", type=float, default=4.0)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(args.n, 3, 32, 32, generator=g)  # your images: N × 3 × 32 × 32
    y = (X[:, 0].mean((1, 2)) > 0).long() + 2 * (X[:, 1].mean((1, 2)) > 0).long()  # 4 classes
    torch.manual_seed(0)
    trainer = dpsgd.PrivateTrainer(
        SmallCNN(),
        torch.utils.data.TensorDataset(X, y),
        lot_size=max(1, args.n // 20),
        clip_norm=1.0,
        target_epsilon=args.epsilon,
        epochs=args.epochs,
        lr=0.1,
        momentum=0.5,
        seed=0,
    )
    stop = trainer.fit()
    s = trainer.statement()
    print(
        f"{stop}: {trainer.steps} lots, σ = {s['sigma']:.3f}, ε = {s['epsilon']:.3f} at δ = "
        f"{s['delta']:g} ({s['accountant']}), last lot loss {trainer.last_loss:.3f}"
    )
    return s


if __name__ == "__main__":
    main()
