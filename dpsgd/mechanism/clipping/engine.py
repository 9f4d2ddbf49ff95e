"""PerExampleClipper: Σ_i clip(g_i) over one physical batch (Abadi et al. 2016, Algorithm 1).

    ḡ(x_i) = g(x_i) · min(1, C / ‖g(x_i)‖₂)

clipping="global" clips one norm over all trainable parameters; clipping="per_layer" clips each
group of ``groups.clipping_groups`` to C on its own (the rule σ calibration and the ledger's k
share). No noise and no division here: the DP optimiser adds N(0, σ²C²) per group and divides by L.

mode="vmap": torch.func per-example gradients (the reference); mode="ghost": ghost norms and
book-keeping (ghost.py), no per-example gradients of Linear/Conv2d layers; mode="auto": ghost when
the model allows it (checked once, against plain autograd), else vmap. ``multiplicity=K`` clips the
mean gradient of each example's K augmented copies; ``weights`` multiplies each example's clipped
gradient and loss (0 for the padding rows of fixed-shape lots); ``memory_budget_bytes`` bounds the
per-example tensors held at once. Why each keeps the sensitivity at C: docs/ARCHITECTURE.md
(augmentation multiplicity), docs/ACCOUNTING.md (fixed-shape lots); the engines' cost:
docs/PERFORMANCE.md.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from dpsgd.core.runtime import ieee_float32
from dpsgd.models.networks import check_dp_compatible
from .clip import CLIPPINGS, MODES
from .ghost import DEFAULT_BUDGET_BYTES, Unsupported, build_layers, ghost_clipped_sum
from .layers import GenericLayer
from .groups import clipping_groups
from .vmap import vmap_clipped_sum


def _check_batch(x: torch.Tensor, y: torch.Tensor, K: int, weights: torch.Tensor | None) -> None:
    """Refuse a batch whose shapes do not fit: B·K rows of x, B labels, B weights."""
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise ValueError(f"multiplicity={K!r} must be an integer >= 1")
    if x.shape[0] != y.shape[0] * K:
        raise ValueError(
            f"x has {x.shape[0]} rows but y has {y.shape[0]} examples"
            + (f" × multiplicity {K}" if K > 1 else "")
        )
    if weights is not None and (weights.dim() != 1 or weights.shape[0] != y.shape[0]):
        raise ValueError(
            f"weights has shape {tuple(weights.shape)}, not [{y.shape[0]}] (one per example)"
        )


@dataclass
class ClipResult:
    grads: dict[str, torch.Tensor]  # Σ_i clip(g_i), same shape/device/dtype as each parameter
    loss_sum: torch.Tensor  # Σ_i loss_i (cross-entropy), 0-dim, detached (no device sync)
    norms: torch.Tensor  # [B, k] per-example, per-group norms before clipping


class PerExampleClipper:
    """Σ_i clip_C(∇ℓ(θ, x_i)) over a lot, per clipping group: ghost norms or ``torch.func`` (vmap).

    Args:
        model: the network; refused if a layer mixes examples (BatchNorm).
        clip_norm: C, each example's gradient is scaled to norm ≤ C in every group; None: no
            clipping (only a deliberately broken audit variant and the non-private tests use it).
        clipping: ``global`` (one group, k = 1) or ``per_layer`` (one group per layer, k = layers).
        mode: ``ghost``, ``vmap`` or ``auto`` (ghost when every layer has a rule, else vmap).
        memory_budget_bytes: how much one chunk of per-example work may hold.
        check_finite: refuse an example holding NaN or inf, naming it (one device sync per call).
        loss: ``loss(output, target) -> [B]``, one loss per example (``reduction="none"``); None:
            cross-entropy on logits and integer labels.

    Attributes:
        groups: the k groups of parameter names (the k the accountant charges).
    """

    def __init__(
        self,
        model: nn.Module,
        clip_norm: float | None,
        clipping: str = "global",
        mode: str = "auto",
        memory_budget_bytes: int = DEFAULT_BUDGET_BYTES,
        check_finite: bool = True,
        loss=None,
    ):
        if loss is not None and not callable(loss):
            raise ValueError(f"loss={loss!r} must be callable: loss(output, target) -> [B]")
        if clip_norm is not None and not (float(clip_norm) > 0):
            raise ValueError(f"clip_norm={clip_norm!r} must be > 0 (or None to disable clipping)")
        if clipping not in CLIPPINGS:
            raise ValueError(f"clipping={clipping!r} must be one of {CLIPPINGS}")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} (privacy.grad_sample_mode) must be one of {MODES}")
        check_dp_compatible(model)
        self.model = model
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.clipping = clipping
        self.loss = loss
        self.budget = int(memory_budget_bytes)
        self.check_finite = bool(
            check_finite
        )  # refuse a non-finite example (one device sync per call)
        self.groups = clipping_groups(model, clipping)  # the k groups the accountant charges
        # frozen (requires_grad=False): not clipped, not a group
        self.trainable = tuple(n for n, p in model.named_parameters() if p.requires_grad)
        self._layers, self.native = None, False
        try:
            self._layers, self.native = build_layers(model)
            ghost_ok, why = True, ""
        except Unsupported as e:
            ghost_ok, why = False, str(e)
        if mode == "ghost" and not ghost_ok:
            raise ValueError(
                f"mode='ghost' cannot handle this model: {why}; use mode='vmap' or 'auto'"
            )
        self.requested_mode = mode
        self.mode = "ghost" if mode in ("ghost", "auto") and ghost_ok else "vmap"
        if self.mode == "ghost" and not self.native:  # said once: which layers lack a ghost rule
            generic = [
                f"{n} ({type(m).__name__})"
                for n, m in model.named_modules()
                if any(isinstance(r, GenericLayer) and r.module is m for r in self._layers)
            ]
            warnings.warn(
                f"ghost clipping: no layer rule for {', '.join(generic)}; their per-example "
                "gradients come from the exact per-example path (vmap), the other layers' from "
                "ghost norms (dpsgd/mechanism/clipping/registry.py:register_layer adds a rule)",
                stacklevel=2,
            )
        self._verified = self.mode == "vmap"

    def clipped_sum(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        out: dict[str, torch.Tensor] | None = None,
        multiplicity: int = 1,
        weights: torch.Tensor | None = None,
    ) -> ClipResult:
        """Σ_i clip(g_i) for one physical batch. With ``out`` (a tensor per trainable parameter,
        e.g. the sum over the lot's earlier physical batches), the sum is added into it in place and
        ``grads`` are those tensors: no parameter-sized temporary and no extra pass.

        ``multiplicity`` K: x holds K augmented copies per example (B·K rows), y the B labels; see
        the module docstring. ``norms`` and ``loss_sum`` are per example (loss: mean over copies).

        ``weights`` ([B], one per example, ≥ 0; None = all ones): Σ_i w_i clip(g_i) and
        Σ_i w_i loss_i; a weight-0 row (padding) adds exactly 0. ``norms`` are unweighted.

        A non-finite value in an example (or its weight) is refused, on both engines, with a
        ValueError naming the first such example (``check_finite``, the default): its gradient, and
        with it the clipped sum, would not be finite."""
        K = multiplicity
        _check_batch(x, y, K, weights)
        self._check_trainable()
        if self.check_finite:
            _check_finite(x, K, weights)
        if x.shape[0] == 0:
            return self._empty(x, out)
        if self.mode == "ghost":
            try:
                # the verifying call compares with autograd at IEEE float32 precision (no TF32)
                with ieee_float32(not self._verified):
                    grads, loss_sum, norms = ghost_clipped_sum(
                        self.model,
                        self._layers,
                        x,
                        y,
                        self.groups,
                        self.clip_norm,
                        verify=not self._verified,
                        budget_bytes=self.budget,
                        out=out,
                        multiplicity=K,
                        weights=weights,
                        loss=self.loss,
                    )
                self._verified = True
                return ClipResult(grads, loss_sum, norms)
            except Unsupported as e:
                if self.requested_mode == "ghost":
                    raise ValueError(f"mode='ghost' cannot handle this model: {e}") from None
                warnings.warn(
                    f"ghost clipping unavailable ({e}); falling back to vmap", stacklevel=2
                )
                self.mode = "vmap"
        grads, loss_sum, norms = vmap_clipped_sum(
            self.model,
            x,
            y,
            self.groups,
            self.clip_norm,
            chunk_bytes=self.budget,
            out=out,
            multiplicity=K,
            weights=weights,
            loss=self.loss,
        )
        return ClipResult(grads, loss_sum, norms)

    def _empty(self, x: torch.Tensor, out: dict[str, torch.Tensor] | None) -> ClipResult:
        """The clipped sum of an empty batch: zeros (or ``out`` unchanged), no norms."""
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        dtype = next(iter(params.values())).dtype
        grads = out if out is not None else {n: torch.zeros_like(p) for n, p in params.items()}
        return ClipResult(
            grads,
            torch.zeros((), dtype=dtype, device=x.device),
            torch.zeros(0, len(self.groups), dtype=dtype, device=x.device),
        )

    def _check_trainable(self) -> None:
        """The groups (and k, which the accountant charges) were fixed from requires_grad when the
        clipper was built; freezing or unfreezing a parameter afterwards would clip, and let the
        optimiser noise and update, a set of parameters other than the one those groups describe."""
        now = tuple(n for n, p in self.model.named_parameters() if p.requires_grad)
        if now != self.trainable:
            changed = sorted(set(now).symmetric_difference(self.trainable)) or ["(order)"]
            raise ValueError(
                f"requires_grad changed for {', '.join(changed)} after the "
                "PerExampleClipper was built; freeze layers first, then build the "
                "clipper and the optimiser"
            )


def _check_finite(x: torch.Tensor, K: int, weights: torch.Tensor | None) -> None:
    """ValueError naming the first example (K rows of x each) or weight that holds NaN or ±inf."""
    for what, t, rows in (("x", x, K), ("weights", weights, 1)):
        if t is None or not (t.is_floating_point() or t.is_complex()):
            continue
        # one pass: a sum is finite only if every term is (NaN and ±inf propagate; a finite sum
        # that overflows falls through to the exact check below)
        if bool(torch.isfinite(t.sum())):
            continue
        bad = (
            ~torch.isfinite(t.reshape(len(t), -1)).all(dim=1)
            if len(t)
            else t.new_zeros(0, dtype=torch.bool)
        )
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            where = (
                f"row {row} of x (example {row // rows})"
                if what == "x" and rows > 1
                else f"example {row}" + (" of x" if what == "x" else "'s weight")
            )
            raise ValueError(
                f"clipped_sum: {where} holds a non-finite value (NaN or inf); every example must "
                "be finite (its gradient, and the clipped sum, would not be)"
            )
