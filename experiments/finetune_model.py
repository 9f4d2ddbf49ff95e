"""The fine-tuning experiment's network and its public pretraining (``experiments.finetune``).

A small vision transformer (Dosovitskiy et al. 2021) for 28 × 28 images, built only from layers the
ghost engine has exact rules for, so every run clips on ghost norms (no per-example gradient
materialised, nothing on the vmap fallback):

  patches   the image cut into 16 patches of 7 × 7 (a reshape), each embedded by one Linear(49, d)
  position  an nn.Embedding(16, d) looked up at positions 0..15 (expanded to the batch: each
            example's gradient of the table is its own)
  blocks    pre-norm transformer blocks: LayerNorm → multi-head self-attention whose q, k, v and
            output projections are Linear layers (the attention itself,
            F.scaled_dot_product_attention, has no parameters) → LayerNorm → MLP (Linear, GELU,
            Linear), each with its residual
  head      mean over the 16 tokens → LayerNorm → Linear(d, 10)

No dropout, no BatchNorm, no class token (mean pooling). ``pretrain`` trains it non-privately on
Fashion-MNIST, the public data of the experiment (never charged): AdamW, cosine schedule, a fixed
seed; the weights go to one ``.pt`` file whose SHA-256 the experiment's rows record.
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

PATCH, SIDE = 7, 28
TOKENS = (SIDE // PATCH) ** 2  # 16
# the experiment's size: d = 64, 4 blocks of 4 heads, MLP width 128 (≈ 139 k parameters)
DIM, DEPTH, HEADS, MLP_DIM, CLASSES = 64, 4, 4, 128, 10


class Attention(nn.Module):
    """Multi-head self-attention from two Linear layers: qkv (d → 3d) and the output proj."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)  # [B, heads, T, D/heads], per example
        return self.proj(out.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, dim: int, heads: int, mlp_dim: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, mlp_dim), nn.Linear(mlp_dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    """The experiment's vision transformer on flattened 28 × 28 images [B, 784] (module doc)."""

    def __init__(self, dim=DIM, depth=DEPTH, heads=HEADS, mlp_dim=MLP_DIM, classes=CLASSES):
        super().__init__()
        self.patch = nn.Linear(PATCH * PATCH, dim)
        self.pos = nn.Embedding(TOKENS, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads, mlp_dim) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, x):
        B, n = x.shape[0], SIDE // PATCH
        p = x.reshape(B, n, PATCH, n, PATCH).permute(0, 1, 3, 2, 4).reshape(B, TOKENS, -1)
        where = torch.arange(TOKENS, device=x.device).expand(B, TOKENS)
        h = self.blocks(self.patch(p) + self.pos(where))
        return self.head(self.norm(h.mean(1)))


def n_params(model: nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


def fresh_head(model: ViT, seed: int) -> None:
    """The head re-initialised for the new task (MNIST's classes are not Fashion-MNIST's), from
    ``seed`` (PyTorch's default Linear init; the global RNG state untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.head.reset_parameters()


def accuracy(model: nn.Module, X, y, batch: int = 2000) -> float:
    """Test accuracy, in eval mode, in batches."""
    training = model.training
    model.eval()
    right = 0
    with torch.no_grad():
        for s in range(0, len(X), batch):
            right += int((model(X[s : s + batch]).argmax(1) == y[s : s + batch]).sum())
    model.train(training)
    return right / len(X)


def pretrain(X, y, Xt, yt, epochs: int, seed: int, out: Path, log=print) -> dict:
    """The public pretraining: non-private AdamW (lr 1e-3, weight decay 0.05, batch 128, cosine to
    0 with one warm-up epoch) on Fashion-MNIST; the weights saved to ``out``. Returns what the
    experiment's rows record (test accuracy on Fashion-MNIST, seconds, the file's SHA-256)."""
    torch.manual_seed(seed)
    model = ViT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    g, batch = torch.Generator().manual_seed(seed), 128
    steps, per_epoch = 0, math.ceil(len(X) / batch)
    total, t0 = epochs * per_epoch, time.perf_counter()
    for epoch in range(epochs):
        for idx in torch.randperm(len(X), generator=g).split(batch):
            warm = min(1.0, (steps + 1) / per_epoch)
            for group in opt.param_groups:
                group["lr"] = 1e-3 * warm * 0.5 * (1 + math.cos(math.pi * steps / total))
            loss = F.cross_entropy(model(X[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
        log(f"pretrain epoch {epoch + 1}/{epochs}: loss {float(loss.detach()):.3f}")
    seconds = time.perf_counter() - t0
    acc = accuracy(model, Xt, yt)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out)
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    log(f"pretrained: Fashion-MNIST test accuracy {acc:.4f} in {seconds:.0f} s -> {out}")
    return {"fmnist_test_accuracy": acc, "seconds": seconds, "sha256": sha, "epochs": epochs}
