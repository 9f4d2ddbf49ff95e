"""PerExampleClipper: Σ_i clip(g_i) over one physical batch (Abadi et al. 2016, Algorithm 1).

    ḡ(x_i) = g(x_i) · min(1, C / ‖g(x_i)‖₂)

clipping="global" clips one norm over all trainable parameters; clipping="per_layer" clips each
group of ``groups.clipping_groups`` to C on its own (the rule σ calibration and the ledger's k
share). No noise and no division here: the DP optimiser adds N(0, σ²C²) per group and divides by L.

mode="vmap": torch.func per-example gradients (the reference); mode="ghost": ghost norms and
book-keeping (ghost.py), no per-example gradients of Linear/Conv2d layers; mode="auto": ghost
where its structure is proved, else the exact path (vmap, or the per-example loop where vmap
cannot run the model). Every engine relies on what proof.py proves on the first call of each input
signature: the examples independent (else NotPerExample), and the engine's per-example gradients
those of the batch; each fallback is said once, naming the layer and the cost. ``multiplicity=K`` clips the
mean gradient of each example's K augmented copies; ``weights`` multiplies each example's clipped
gradient and loss (0 for the padding rows of fixed-shape lots); ``memory_budget_bytes`` bounds the
per-example tensors held at once. Why each keeps the sensitivity at C: docs/ARCHITECTURE.md
(augmentation multiplicity), docs/ACCOUNTING.md (fixed-shape lots); the engines' cost:
docs/PERFORMANCE.md.
"""

from __future__ import annotations

import cmath
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from dpsgd.core.errors import NotPerExample
from dpsgd.mechanism import batches
from dpsgd.mechanism.batches import BatchLoss
from dpsgd.models.networks import check_dp_compatible

from .clip import CLIPPINGS, MODES, PRECISIONS
from .ghost import DEFAULT_BUDGET_BYTES, Unsupported, build_layers, ghost_clipped_sum, shape_pattern
from .groups import clipping_groups
from .layers import GenericLayer
from .proof import forked_rng, prove_exact, prove_ghost
from .vmap import loop_clipped_sum, vmap_clipped_sum


def _check_batch(x, y: torch.Tensor | None, K: int, weights: torch.Tensor | None) -> int:
    """Refuse a batch whose shapes do not fit: B·K rows of x, B labels, B weights; ``y`` None: a
    batch whose tensors agree on B (``batches.rows``), K = 1. Returns B."""
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise ValueError(f"multiplicity={K!r} must be an integer >= 1")
    if y is None:
        if K != 1:
            raise ValueError("multiplicity > 1 needs (x, y) batches")
        B = batches.rows(x)
    elif x.shape[0] != y.shape[0] * K:
        raise ValueError(
            f"x has {x.shape[0]} rows but y has {y.shape[0]} examples"
            + (f" × multiplicity {K}" if K > 1 else "")
        )
    else:
        B = y.shape[0]
    if weights is not None and (weights.dim() != 1 or weights.shape[0] != B):
        raise ValueError(f"weights has shape {tuple(weights.shape)}, not [{B}] (one per example)")
    return B


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
        mode: ``ghost``, ``vmap`` or ``auto`` (ghost where its structure is proved, else the
            exact path: vmap, or the per-example loop); ``mode`` then says what ran (``ghost``,
            ``vmap``, ``ghost+vmap``, ...).
        memory_budget_bytes: how much one chunk of per-example work may hold.
        check_finite: refuse an example holding NaN or inf, naming it (one device sync per call).
        loss: ``loss(output, target) -> [B]``, one loss per example (``reduction="none"``); None:
            cross-entropy on logits and integer labels. A ``dpsgd.mechanism.batches.BatchLoss``
            (the user's ``loss(model, batch) -> [B]``): ``clipped_sum(batch)`` takes batches, a
            tensor or a tuple/list/dict of tensors with the examples in dimension 0, and no y.
        precision: ``fp32``, or ``bf16``: the forward pass (and with it the backward) under
            ``torch.autocast(bfloat16)``, the model's float32 weights kept; the per-example norms,
            clip factors and sums are computed in float32 (the parameters' dtype), so the clip
            bound holds to float32 rounding.

    Attributes:
        groups: the k groups of parameter names (the k the accountant charges).

    Raises:
        NotPerExample (a ValueError): a model whose examples mix, or a mode that cannot run it.
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
        precision: str = "fp32",
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
        self.precision = _check_precision(model, precision)
        self.model = model
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.clipping = clipping
        self.loss = loss
        self.batches = isinstance(loss, BatchLoss)  # clipped_sum(batch): loss(model, batch)
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
            raise NotPerExample(
                f"mode='ghost' cannot handle this model: {why}; use mode='vmap' or 'auto'"
            )
        self.requested_mode = mode
        self._ghost = mode in ("ghost", "auto") and ghost_ok  # else every signature is exact
        self._proved: set = set()  # ghost signatures proved (proof.py)
        self._exact: dict = {}  # input signature -> the exact engine proved for it
        self._said: set[str] = set()
        n = sum(p.numel() for n_, p in model.named_parameters() if n_ in self.trainable)
        self._vmap_cost = (
            f"the exact per-example path (vmap): each example's gradient of all {n} trainable "
            "parameters materialised, in chunks within the memory budget"
        )
        self._why = why if mode == "auto" else None  # said with the exact engine (first call)
        if self._ghost and not self.native:  # said once: which layers lack a ghost rule
            generic = [
                f"{n} ({type(m).__name__})"
                for n, m in model.named_modules()
                if any(isinstance(r, GenericLayer) and r.module is m for r in self._layers)
            ]
            self._say(
                f"ghost clipping: no layer rule for {', '.join(generic)}; their per-example "
                "gradients come from the exact per-example path (vmap over each such module: "
                "B × its parameters), the other layers' from ghost norms "
                "(dpsgd/mechanism/clipping/registry.py:register_layer adds a rule)"
            )

    def _say(self, msg: str, reason: str | None = None) -> None:
        """A fallback, said once per ``reason`` (default: the message) as a UserWarning."""
        reason = msg if reason is None else reason
        if reason not in self._said:
            self._said.add(reason)
            warnings.warn(msg, stacklevel=3)

    def prove(self, x, y: torch.Tensor | None = None, multiplicity: int = 1) -> None:
        """Prove, on this batch, what a call on it would rely on (proof.py: independence of the
        examples, and the structure of the engine that runs it), as ``clipped_sum`` does on the
        first call of each input signature; nothing returned or written, the RNG untouched. Raises
        NotPerExample (a ValueError, one line) for a model whose examples mix. The command line,
        PrivateTrainer and the engine call it on a few training examples before the first lot."""
        with forked_rng(batches.device_of(x)):
            self.clipped_sum(x, y, multiplicity=multiplicity)

    def clipped_sum(
        self,
        x,
        y: torch.Tensor | None = None,
        out: dict[str, torch.Tensor] | None = None,
        multiplicity: int = 1,
        weights: torch.Tensor | None = None,
    ) -> ClipResult:
        """Σ_i clip(g_i) for one physical batch. With ``out`` (a tensor per trainable parameter,
        e.g. the sum over the lot's earlier physical batches), the sum is added into it in place and
        ``grads`` are those tensors: no parameter-sized temporary and no extra pass.

        ``multiplicity`` K: x holds K augmented copies per example (B·K rows), y the B labels; see
        the module docstring. ``norms`` and ``loss_sum`` are per example (loss: mean over copies).
        With a ``BatchLoss``, ``x`` is the batch (the examples in dimension 0 of every tensor) and
        ``y`` None.

        ``weights`` ([B], one per example, ≥ 0; None = all ones): Σ_i w_i clip(g_i) and
        Σ_i w_i loss_i; a weight-0 row (padding) adds exactly 0. ``norms`` are unweighted.

        A non-finite value in an example (or its weight) is refused, on both engines, with a
        ValueError naming the first such example (``check_finite``, the default): its gradient, and
        with it the clipped sum, would not be finite.

        The first call of each input signature proves what its engine relies on (proof.py) and
        refuses a model whose examples mix (NotPerExample); ``auto`` moves a signature whose ghost
        structure does not hold to the exact path, and says so once."""
        K = multiplicity
        if (y is None) != self.batches:
            raise ValueError(
                "clipped_sum(batch) goes with loss(model, batch), clipped_sum(x, y) with "
                "loss(output, target)"
            )
        B = _check_batch(x, y, K, weights)
        self._check_trainable()
        if self.check_finite:
            _check_finite(x, K, weights)
        if B == 0:
            return self._empty(batches.device_of(x), out)
        key = _input_signature(x, y, K)
        engine = self._exact.get(key)
        kw = {"out": out, "multiplicity": K, "weights": weights, "loss": self.loss}
        kw["autocast"] = _autocast(self.precision, batches.device_of(x))
        if engine is None and self._ghost:
            try:
                grads, loss_sum, norms = ghost_clipped_sum(
                    self.model,
                    self._layers,
                    x,
                    y,
                    self.groups,
                    self.clip_norm,
                    budget_bytes=self.budget,
                    check=lambda sig: self._prove_ghost(x, y, K, key, sig),
                    **kw,
                )
                return ClipResult(grads, loss_sum, norms)
            except Unsupported as e:
                if self.requested_mode == "ghost":
                    raise NotPerExample(
                        f"mode='ghost' cannot handle this model: {e}; use mode='auto' or 'vmap'"
                    ) from None
                engine = self._prove_exact(x, y, K, key, f"ghost clipping: {e}")
        elif engine is None:
            engine = self._prove_exact(x, y, K, key)
        run = vmap_clipped_sum if engine == "vmap" else loop_clipped_sum
        if engine == "vmap":
            kw["chunk_bytes"] = self.budget
        grads, loss_sum, norms = run(self.model, x, y, self.groups, self.clip_norm, **kw)
        return ClipResult(grads, loss_sum, norms)

    def _prove_ghost(self, x, y, K: int, key: tuple, signature: tuple) -> None:
        """The ghost engine's check of a call (``ghost_clipped_sum``'s ``check``): a new signature
        is proved (proof.py:prove_ghost) or raises Unsupported, naming the layer."""
        if (key, signature) in self._proved:
            return
        why = prove_ghost(self.model, x, y, K, self.loss, signature)
        if why is not None:
            raise Unsupported(why)
        self._proved.add((key, signature))

    def _prove_exact(self, x, y, K: int, key: tuple, why: str | None = None) -> str:
        """The exact engine of an input signature (proof.py:prove_exact), said once when ghost
        was asked (``why``) or vmap cannot run the model."""
        engines = ("vmap",) if self.requested_mode == "vmap" else ("vmap", "loop")
        try:
            engine, failed, proved = prove_exact(self.model, x, y, K, self.loss, engines)
        except NotPerExample as e:
            if self.requested_mode == "vmap" and "no exact per-example path" in str(e):
                raise NotPerExample(
                    f"mode='vmap' cannot run this model: {e}; mode='auto' tries the per-example "
                    "loop"
                ) from None
            raise
        if not proved:
            return engine
        self._exact[key] = engine
        cost = (
            self._vmap_cost
            if engine == "vmap"
            else "the per-example loop: one forward and backward pass per example (batch of 1)"
        )
        if "vmap" in failed:
            cost += f" (vmap cannot run it: {failed['vmap']})"
        if why is not None:
            self._say(f"{why}; inputs {_describe(key)} run on {cost}", reason=why)
        elif self._why:
            self._say(f"ghost clipping cannot run this model: {self._why}; it runs on {cost}")
        elif engine == "loop":
            self._say(f"every lot runs on {cost}")
        return engine

    @property
    def mode(self) -> str:
        """The engines that run: ``ghost``, ``vmap`` or ``loop``, or several joined by ``+``
        (ghost, and the exact path on the signatures moved off it)."""
        used = [e for e in ("vmap", "loop") if e in self._exact.values()]
        return "+".join((["ghost"] if self._ghost else []) + used) or "vmap"

    def _empty(self, device, out: dict[str, torch.Tensor] | None) -> ClipResult:
        """The clipped sum of an empty batch: zeros (or ``out`` unchanged), no norms."""
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        dtype = next(iter(params.values())).dtype
        grads = out if out is not None else {n: torch.zeros_like(p) for n, p in params.items()}
        return ClipResult(
            grads,
            torch.zeros((), dtype=dtype, device=device),
            torch.zeros(0, len(self.groups), dtype=dtype, device=device),
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


def _input_signature(x, y: torch.Tensor | None, K: int) -> tuple:
    """What a call's input is, for the proofs' cache: dtypes, shape patterns (``shape_pattern``),
    K and the device type; of every tensor of a batch (``y`` None), with its path."""
    if y is None:
        B = batches.rows(x)
        leaves = tuple(
            (path, t.dtype, shape_pattern(t.shape, B, B)) for path, t in batches.named_leaves(x)
        )
        return (batches.device_of(x).type, K, leaves)
    B = y.shape[0]
    return (
        x.device.type,
        K,
        x.dtype,
        shape_pattern(x.shape, x.shape[0], B),
        y.dtype,
        shape_pattern(y.shape, x.shape[0], B),
    )


def _describe(key: tuple) -> str:
    """'x [B, 8, 16] float32' for an input signature (a batch: each tensor by its path)."""
    if len(key) == 3:
        return ", ".join(
            f"{path} [{', '.join(str(d) for d in p)}] {str(dt).replace('torch.', '')}"
            for path, dt, p in key[2]
        )
    _, K, dx, px, _, _ = key
    dims = ", ".join(str(d) for d in px)
    return f"x [{dims}] {str(dx).replace('torch.', '')}" + (f" (K = {K})" if K > 1 else "")


def _check_precision(model, precision: str) -> str:
    """``fp32`` or ``bf16`` (autocast over float32 weights); ValueError naming the argument."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")
    if precision == "bf16":
        bad = [
            (n, p.dtype)
            for n, p in model.named_parameters()
            if p.requires_grad and p.dtype != torch.float32
        ]
        if bad:
            raise ValueError(
                f"precision='bf16' autocasts the forward pass of a float32 model; parameter "
                f"'{bad[0][0]}' is {bad[0][1]} (keep the trained weights in float32: the norms, "
                "clip factors, sums and noise are computed in their dtype)"
            )
    return precision


def _autocast(precision: str, device: torch.device):
    """The forward pass's context: ``torch.autocast`` to bfloat16, or None (full precision)."""
    if precision != "bf16":
        return None
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _check_finite(x, K: int, weights: torch.Tensor | None) -> None:
    """ValueError naming the first example (K rows of x each) or weight that holds NaN or ±inf."""
    named = (
        [("x", x, K)]
        if isinstance(x, torch.Tensor)
        else [(f"batch{p}", t, 1) for p, t in batches.named_leaves(x)]
    )
    for what, t, rows in (*named, ("weights", weights, 1)):
        if t is None or not (t.is_floating_point() or t.is_complex()):
            continue
        # one pass: a sum is finite only if every term is (NaN and ±inf propagate; a finite sum
        # that overflows falls through to the exact check below)
        if cmath.isfinite(t.sum().item()):  # real or complex
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
                else f"example {row}"
                + (" of x" if what == "x" else "'s weight" if what == "weights" else f" of {what}")
            )
            raise ValueError(
                f"clipped_sum: {where} holds a non-finite value (NaN or inf); every example must "
                "be finite (its gradient, and the clipped sum, would not be)"
            )
