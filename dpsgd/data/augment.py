"""Per-example image transforms of the paper's CIFAR-10 setup (Abadi et al. 2016, §5.3).

The paper trains "the network of the TensorFlow convolutional neural networks tutorial" on 24×24
crops; where the paper is silent we follow that tutorial (``cifar10_input.py``):

* training: a random 24×24 crop of the 32×32 image and a random horizontal flip
  (``tf.random_crop``, ``tf.image.random_flip_left_right``);
* test and evaluation: the central 24×24 crop;
* both: per-image standardisation (``tf.image.per_image_standardization``),
  x ↦ (x − mean(x)) / max(std(x), 1/√n), mean and (population) std over the n = C·H·W values of
  one image.

``AUGMENTATIONS`` maps ``dataset.augment`` to a plain callable ``augment(x, generator)`` on a lot
``x`` of shape [B, C, H, W] → [B, C, h, w]. Each transform acts on every example on its own, so
example i's clipped gradient still depends on example i alone and the sensitivity C of Algorithm 1
is unchanged. The randomness comes from ``generator`` only (the trainer seeds one per lot from the
run's seed and the lot's index: ``lot_generator``), so a seeded run and its resume draw the same
crops.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dpsgd.data.datasets import (
    AUGMENTATION_NAMES,
    CROP,
)  # torch-free, so `python -m dpsgd.data` needs no torch


def per_image_standardization(x: torch.Tensor) -> torch.Tensor:
    """(x − mean) / max(std, 1/√n) per image (TF ``per_image_standardization``; population std)."""
    if x.dim() < 2 or len(x) == 0:
        return x
    flat = x.flatten(1)
    n = flat.shape[1]
    mean = flat.mean(1, keepdim=True)
    std = flat.std(1, correction=0, keepdim=True).clamp_min(1.0 / math.sqrt(n))
    return ((flat - mean) / std).view_as(x)


def center_crop(x: torch.Tensor, size: int = CROP) -> torch.Tensor:
    """The central size×size window of [B, C, H, W] images (offset ⌊(H − size)/2⌋, as data.py
    crops)."""
    H, W = x.shape[-2:]
    if size > min(H, W):
        raise ValueError(f"crop {size} is larger than the images ({H}x{W})")
    top, left = (H - size) // 2, (W - size) // 2
    return x[..., top : top + size, left : left + size]


def crop_flip(x: torch.Tensor, generator: torch.Generator, size: int = CROP) -> torch.Tensor:
    """A random size×size window of each image (offsets uniform in [0, H − size] × [0, W − size]),
    mirrored left-right with probability 1/2; one gather, on x's device."""
    B, C, H, W = x.shape
    if size > min(H, W):
        raise ValueError(f"crop {size} is larger than the images ({H}x{W})")
    top = torch.randint(0, H - size + 1, (B,), generator=generator)
    left = torch.randint(0, W - size + 1, (B,), generator=generator)
    flip = torch.rand(B, generator=generator) < 0.5
    r = torch.arange(size)
    rows = top[:, None] + r  # [B, size]
    cols = left[:, None] + torch.where(flip[:, None], size - 1 - r, r)  # [B, size]
    rows, cols = rows.to(x.device), cols.to(x.device)
    b = torch.arange(B, device=x.device)[:, None, None, None]
    c = torch.arange(C, device=x.device)[None, :, None, None]
    return x[b, c, rows[:, None, :, None], cols[:, None, None, :]]


def identity(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    return x


AUGMENTATIONS = {  # dataset.augment -> augment(x [B, C, H, W], generator) -> [B, C, h, w]
    "none": identity,
    "crop_flip": crop_flip,
}
if (
    tuple(AUGMENTATIONS) != AUGMENTATION_NAMES
):  # the names the config accepts are the functions here
    raise ImportError(
        f"data/augment.py: AUGMENTATIONS {list(AUGMENTATIONS)} != datasets.AUGMENTATION_NAMES"
    )


def lot_generator(seed: int, step: int) -> torch.Generator:
    """The generator of lot ``step``'s augmentation: a function of (seed, step) only, so lots are
    replayed bit-identically by a resumed run (numpy SeedSequence, like
    dpsgd/run/state.py:derive_seed)."""
    tag = int.from_bytes(b"augment", "little")
    s = int(
        np.random.SeedSequence([int(seed), tag, int(step)]).generate_state(1, np.uint64)[0]
        >> np.uint64(1)
    )
    return torch.Generator().manual_seed(s)


class LotTransform:
    """What a lot goes through before the DP step (``train.run_epoch``), and what evaluation sees.

    ``train(x, step)``: the configured augmentation (seeded by the run's seed and ``step``), then
    per-image standardisation when ``standardize``. ``eval(x)``: the central ``crop`` when the
    stored images are larger (the training set is kept at 32×32 for random crops), then
    standardisation."""

    def __init__(
        self,
        augment: str = "none",
        standardize: bool = False,
        crop: int | None = None,
        seed: int = 0,
    ):
        if augment not in AUGMENTATIONS:
            raise ValueError(f"dataset.augment={augment!r}: must be one of {sorted(AUGMENTATIONS)}")
        self.name, self.standardize, self.crop, self.seed = (
            augment,
            bool(standardize),
            crop,
            int(seed),
        )
        self.fn = AUGMENTATIONS[augment]
        if augment == "crop_flip" and crop is not None:
            self.fn = lambda x, g: crop_flip(x, g, crop)

    @property
    def identity(self) -> bool:
        return self.name == "none" and not self.standardize

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The training transform as a plain ``augment(x, generator)`` callable."""
        if self.name != "none":
            x = self.fn(x, generator)
        return per_image_standardization(x) if self.standardize else x

    def train(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """Lot ``step``'s examples, its randomness drawn from ``lot_generator(seed, step)``."""
        if self.identity:
            return x
        return self(x, lot_generator(self.seed, step) if self.name != "none" else None)

    def eval(self, x: torch.Tensor) -> torch.Tensor:
        if self.crop is not None and x.dim() == 4 and x.shape[-1] > self.crop:
            x = center_crop(x, self.crop)
        return per_image_standardization(x) if self.standardize else x
