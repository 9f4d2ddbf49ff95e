"""Evaluation of a model on held data: (mean cross-entropy, accuracy), batched, in eval mode.

Training evaluates after every ``training.eval_every`` epochs (dpsgd/train.py:end_of_epoch); the
tuner (dpsgd/tune/winner.py) and the benchmarks use the same function. On the CPU a row-wise model
(the MLPs) runs ``EVAL_ROWS`` rows at a time, the same bits as one pass (``rowwise``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpsgd.mechanism.batches import logits_of

# rows per forward pass of a row-wise model in ``evaluate`` (its activations stay in cache)
EVAL_ROWS = 1024
_ROWWISE = (torch.nn.Linear, torch.nn.ReLU, torch.nn.Identity, torch.nn.Flatten)


def rowwise(model) -> bool:
    """Whether every layer of ``model`` maps each row on its own by one GEMM or an elementwise map
    (the MLPs): on the CPU a row's logits are then the same bits whichever rows share its forward
    pass (the CPU GEMM reduces over a row in the same order at any number of rows: checked by
    tests/run/test_evaluate.py and, end to end, by the mnist_medium preset's metrics.csv)."""
    return all(isinstance(m, _ROWWISE) for m in model.modules() if not list(m.children()))


def _logits(model, xb: torch.Tensor) -> torch.Tensor:
    """``model(xb)``; on the CPU a row-wise model runs EVAL_ROWS rows at a time (2× faster on the
    MNIST network at 10 000 rows: its 1000 hidden units × 10 000 rows would be 40 MB of
    activations), the same bits. A GPU keeps one pass per batch (its GEMM may choose another kernel
    at another row count)."""
    if len(xb) <= EVAL_ROWS or xb.device.type != "cpu" or not rowwise(model):
        return logits_of(model(xb))  # a tensor, or a Hugging Face output's logits
    return torch.cat([model(xb[s : s + EVAL_ROWS]) for s in range(0, len(xb), EVAL_ROWS)])


@torch.no_grad()
def evaluate(model, X, y, batch_size: int, transform=None) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) on (X, y), eval mode, batched; ``transform`` maps each batch
    to what the model sees (augment.LotTransform.eval: centre crop, standardisation). The loss is
    summed in float32 over each batch of ``batch_size`` (training.eval_batch_size: its value moves
    the last bits of train_loss), whatever rows ``_logits`` computes at a time."""
    was = model.training
    model.eval()
    if bool((y < 0).any()):  # an audit's gradient canaries (label < 0) have no class: not evaluated
        X, y = X[y >= 0], y[y >= 0]
    loss, correct = 0.0, 0
    for s in range(0, len(X), batch_size):
        xb = X[s : s + batch_size]
        out = _logits(model, xb if transform is None else transform(xb))
        loss += F.cross_entropy(out, y[s : s + batch_size], reduction="sum").item()
        correct += (out.argmax(1) == y[s : s + batch_size]).sum().item()
    model.train(was)
    return loss / max(1, len(X)), correct / max(1, len(X))
