"""Training data as the sampler draws it: two tensors (examples, targets) held in memory, indexed by
lot. Poisson sampling needs random access to all N examples, so every source is read once, whole,
into tensors, as the command line holds its datasets.

Accepted: a pair ``(X, y)`` of tensors (or arrays), a ``TensorDataset``, any map-style ``Dataset``
(``len`` and ``[i] -> (x, y)``), or an iterable of ``(x, y)`` pairs.
"""

from __future__ import annotations

import numpy as np
import torch


def as_tensors(data, name: str = "data") -> tuple[torch.Tensor, torch.Tensor]:
    """(X, y) of ``data``, first dimension N ≥ 1 on both; ValueError naming ``name`` otherwise."""
    if isinstance(data, torch.utils.data.TensorDataset) and len(data.tensors) == 2:
        X, y = data.tensors
    elif isinstance(data, (tuple, list)) and len(data) == 2 and not _is_pair_list(data):
        X, y = (torch.as_tensor(np.asarray(a)) if not torch.is_tensor(a) else a for a in data)
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        X, y = _stack((data[i] for i in range(len(data))), name)
    elif hasattr(data, "__iter__"):
        X, y = _stack(iter(data), name)
    else:
        raise ValueError(
            f"{name}: give (X, y) tensors, a TensorDataset, a Dataset of (x, y) or an iterable of "
            f"(x, y) pairs, not {type(data).__name__}"
        )
    if X.shape[0] != y.shape[0] or X.shape[0] < 1:
        raise ValueError(f"{name}: {X.shape[0]} examples but {y.shape[0]} targets (need N >= 1)")
    return X, y


def _is_pair_list(data) -> bool:
    """A list of two (x, y) examples, not (X, y)."""
    return isinstance(data, list) and all(isinstance(d, tuple) and len(d) == 2 for d in data)


def _stack(pairs, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"{name}: example {i} is not an (x, y) pair")
        xs.append(torch.as_tensor(pair[0]))
        ys.append(torch.as_tensor(pair[1]))
    if not xs:
        raise ValueError(f"{name}: no examples")
    return torch.stack(xs), torch.stack(ys)
