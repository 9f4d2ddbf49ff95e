"""What a batch of examples is, for the clipping engines and the engine's loop: a tensor, or a tuple,
list or dict of them (nested), every tensor holding the examples in dimension 0.

A fine-tuning batch is ``{"input_ids": [B, T], "attention_mask": [B, T], "labels": [B, T]}``; an
image batch ``(x, y)``. Example i is row i of every tensor: ``take`` and ``narrow`` slice all of
them alike, ``rows`` counts the examples (refusing tensors that disagree, naming them), and
``BatchLoss`` is the user's ``loss(model, batch) -> [B]``, one loss per example, however the model
wants its batch (``model(**batch).logits``, token losses averaged over a padding mask).

A model's output may be a tensor or a Hugging Face ``ModelOutput`` (anything with ``logits``):
``logits_of`` gives the scores the default cross-entropy reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def tree_map(fn, batch):
    """``fn`` applied to every tensor of ``batch``; the same structure back (a Mapping as a dict)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: tree_map(fn, v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(tree_map(fn, v) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(tree_map(fn, v) for v in batch)
    raise ValueError(
        f"batch: a {type(batch).__name__} where a tensor was expected; a batch is a tensor or a "
        "tuple, list or dict of tensors with the examples in dimension 0 (tokenize and pad in the "
        "Dataset or in collate_fn)"
    )


def named_leaves(batch, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor of ``batch``, in order: ``"['input_ids']"``, ``"[0]"``."""
    if isinstance(batch, torch.Tensor):
        return [(path or "batch", batch)]
    if isinstance(batch, Mapping):
        items = batch.items()
    elif isinstance(batch, (tuple, list)):
        items = enumerate(batch)
    else:
        tree_map(lambda t: t, batch)  # the one-line refusal
        return []
    return [leaf for k, v in items for leaf in named_leaves(v, f"{path}[{k!r}]")]


def leaves(batch) -> list[torch.Tensor]:
    return [t for _, t in named_leaves(batch)]


def rows(batch) -> int:
    """The examples of ``batch``: dimension 0 of each of its tensors, which must agree; ValueError
    naming the tensor that does not."""
    named = named_leaves(batch)
    if not named:
        raise ValueError("batch: holds no tensor")
    first, n = named[0][0], None
    for path, t in named:
        if t.dim() == 0:
            raise ValueError(
                f"batch{path if path != 'batch' else ''}: a 0-dimensional tensor; every tensor of "
                "a batch holds the examples in dimension 0"
            )
        if n is None:
            n = t.shape[0]
        elif t.shape[0] != n:
            raise ValueError(
                f"batch{path}: {t.shape[0]} rows, batch{first} {n}; every tensor of a batch holds "
                "the same examples in dimension 0"
            )
    return int(n)


def take(batch, idx: torch.Tensor):
    """The examples ``idx`` of ``batch`` (``index_select`` on dimension 0 of every tensor)."""
    return tree_map(lambda t: t.index_select(0, idx.to(t.device)), batch)


def narrow(batch, start: int, stop: int):
    """Examples ``start`` .. ``stop`` − 1 of ``batch`` (views)."""
    return tree_map(lambda t: t[start:stop], batch)


def to_device(batch, device, non_blocking: bool = False):
    return tree_map(lambda t: t.to(device, non_blocking=non_blocking), batch)


def device_of(batch) -> torch.device:
    ts = leaves(batch)
    return ts[0].device if ts else torch.device("cpu")


def logits_of(output) -> torch.Tensor:
    """A model's scores: the output itself when a tensor, else its ``logits`` (a Hugging Face
    ``ModelOutput``); ValueError otherwise."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise ValueError(
        f"the model returned a {type(output).__name__}: the default loss (cross-entropy) needs a "
        "tensor of scores or an output with .logits; give loss=..."
    )


class BatchLoss:
    """``loss(model, batch) -> [B]``: a user's per-example loss over a batch, which calls the model
    as the model wants (``model(**batch)``). The one-value-per-example shape is checked on every
    call: a mean or a sum over the batch would mix examples, and clipping each example's gradient
    would then bound nothing."""

    def __init__(self, fn):
        if not callable(fn):
            raise ValueError(f"loss={fn!r} must be callable: loss(model, batch) -> [B]")
        self.fn = fn

    def __call__(self, model, batch) -> torch.Tensor:
        n = rows(batch)
        out = self.fn(model, batch)
        if not isinstance(out, torch.Tensor) or out.shape != (n,):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"loss(model, batch) must return one value per example (shape [{n}]), got {shape}; "
                "average token losses per example (dim 1), never over the batch"
            )
        return out


def token_losses(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, shift=False):
    """Each example's mean token cross-entropy ([B]) over its labels other than ``ignore_index``
    (padding); ``shift``: a causal language model's, token t predicting label t + 1. An example
    without a counted token has loss 0. ``logits`` [B, T, V], ``labels`` [B, T]."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    if logits.dtype in (torch.bfloat16, torch.float16):  # the losses in float32 (mixed precision)
        logits = logits.float()
    per_token = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index, reduction="none"
    ).view(labels.shape)
    counted = (labels != ignore_index).sum(1)
    return per_token.sum(1) / counted.clamp_min(1)
