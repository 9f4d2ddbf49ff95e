"""A lot's examples read from a map-style ``Dataset``: the sampler's indices, cut into physical
batches, through a ``DataLoader``.

The sampler alone decides which examples a lot holds (``dpsgd/mechanism/sampling.py``: q, the
event each lot is charged as); the reader only reads them, lazily, a physical batch at a time
(``physical_batch_size`` examples: memory bounds the batch, never the lot), with ``num_workers``
worker processes (persistent: started once, not per lot) and the user's ``collate_fn``
(``default_collate``: examples that are tuples or dicts of tensors become batches of the same
structure, the examples in dimension 0). Nothing is read ahead of the lot being stepped, so the
sampler's state is always that of the lots drawn, and a saved state continues exactly.

A ``TensorDataset`` is indexed directly (``index_select`` on each tensor: the rows
``default_collate`` would stack, without N Python calls), on the tensors' own device.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, TensorDataset

from dpsgd.mechanism import batches
from dpsgd.workbench.states import data_sha256


class _LotBatches:
    """The DataLoader's batch sampler: the physical batches (index lists) of the lot being read."""

    def __init__(self):
        self.parts: list[list[int]] = []

    def __iter__(self):
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)


class Reader:
    """The training examples as the engine reads them.

    Args:
        dataset: a map-style ``Dataset`` (``len`` and ``[i]``), each example a tensor or a
            tuple/list/dict of tensors; a ``TensorDataset`` is indexed directly.
        device: where the batches go (the model's device).
        physical_batch_size: the most examples per forward/backward pass (None: the whole lot).
        num_workers, collate_fn: the DataLoader's (``default_collate`` when None).

    Raises:
        ValueError: naming the argument, for a dataset without ``len``/``[i]`` or an empty one.
    """

    def __init__(self, dataset, device, physical_batch_size=None, num_workers=0, collate_fn=None):
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise ValueError(
                f"dataset: a map-style Dataset (len and [i]) is needed, not "
                f"{type(dataset).__name__} (Poisson sampling draws any of the N examples)"
            )
        self.N = len(dataset)
        if self.N < 1:
            raise ValueError("dataset: holds no example (N = 0)")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be an integer >= 0")
        if collate_fn is not None and not callable(collate_fn):
            raise ValueError(f"collate_fn={collate_fn!r} must be callable")
        self.dataset, self.device = dataset, torch.device(device)
        self.physical_batch_size = physical_batch_size
        self.tensors = dataset.tensors if _direct(dataset, collate_fn) else None
        self._parts = _LotBatches()
        self._loader = None
        if self.tensors is None:
            self._loader = DataLoader(
                dataset,
                batch_sampler=self._parts,
                num_workers=num_workers,
                collate_fn=collate_fn,
                persistent_workers=num_workers > 0,
                pin_memory=self.device.type == "cuda",
            )

    def batches(self, idx: torch.Tensor, weights: torch.Tensor | None = None) -> Iterator:
        """(batch on the device, its weights or None) for each physical batch of the lot ``idx``
        (in order; none for an empty lot)."""
        n = len(idx)
        size = self.physical_batch_size or max(1, n)
        cuts = [(s, min(n, s + size)) for s in range(0, n, size)]
        if self.tensors is not None:
            for s, e in cuts:
                part = idx[s:e]
                yield (
                    tuple(t.index_select(0, part.to(t.device)) for t in self.tensors),
                    None if weights is None else weights[s:e],
                )
            return
        self._parts.parts = [idx[s:e].tolist() for s, e in cuts]
        for (s, e), batch in zip(cuts, self._loader):
            batch = batches.to_device(batch, self.device, non_blocking=True)
            yield batch, None if weights is None else weights[s:e]

    def first(self, n: int):
        """The first ``n`` examples as one batch on the device (what the clipper proves on)."""
        idx = torch.arange(min(n, self.N))
        return next(self.batches(idx))[0] if len(idx) else None

    def sha256(self) -> str | None:
        """SHA-256 of a ``TensorDataset``'s tensors (shapes, dtypes and bytes); None for a dataset
        read lazily (hashing it would read it whole)."""
        return None if self.tensors is None else data_sha256(*self.tensors)


def _direct(dataset, collate_fn) -> bool:
    """A TensorDataset read with the default collation: indexed directly."""
    return isinstance(dataset, TensorDataset) and collate_fn is None
