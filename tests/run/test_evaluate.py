"""dpsgd/run/evaluate.py:evaluate — a row-wise model's logits in chunks of EVAL_ROWS rows are the
bits of one forward pass over the whole evaluation batch, so chunking moves no metric
(docs/PERFORMANCE.md)."""

import torch
import torch.nn.functional as F

from dpsgd.models.networks import MLP, CifarCNN
from dpsgd.run.evaluate import EVAL_ROWS, evaluate, rowwise


def _reference(model, X, y, batch_size):
    """The evaluation before chunking: one forward pass per batch of ``batch_size``."""
    loss, correct = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(X), batch_size):
            out = model(X[s : s + batch_size])
            loss += F.cross_entropy(out, y[s : s + batch_size], reduction="sum").item()
            correct += (out.argmax(1) == y[s : s + batch_size]).sum().item()
    return loss / len(X), correct / len(X)


def test_chunked_evaluation_is_bit_identical():
    torch.manual_seed(0)
    model = MLP(60, (1000,), 10).eval()
    n = 3 * EVAL_ROWS + 77  # chunks of EVAL_ROWS rows and a shorter last one
    X, y = torch.randn(n, 60) * 100, torch.randint(0, 10, (n,))
    with torch.no_grad():
        whole = model(X)
        parts = torch.cat([model(X[s : s + EVAL_ROWS]) for s in range(0, n, EVAL_ROWS)])
    assert torch.equal(whole, parts)
    for batch_size in (n, 2 * EVAL_ROWS + 5, 100):
        assert evaluate(model, X, y, batch_size) == _reference(model, X, y, batch_size)


def test_only_rowwise_models_are_chunked():
    assert rowwise(MLP(60, (1000,), 10))
    assert not rowwise(CifarCNN())  # convolutions may pick another algorithm at another batch size
