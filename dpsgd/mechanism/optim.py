"""One step of Algorithm 1 (Abadi et al. 2016, "Differentially private SGD").

    For each lot L_t (Poisson-sampled with rate q = L/N by the sampler):
      g(x_i)   ← per-example gradient                                  (clipping engine)
      ḡ(x_i)   ← g(x_i) / max(1, ‖g(x_i)‖₂ / C)        clip            (clipping engine)
      g̃_t     ← (1/L) (Σ_i ḡ(x_i) + N(0, σ²C² I))      noise, divide  (here)
      θ_{t+1} ← θ_t − η_t g̃_t                          descend        (here)

The sum is divided by the *expected* lot size L, never by the realised Poisson lot size |L_t|
(dividing by |L_t| would make the sensitivity depend on the data). An empty lot still takes a step:
the noise alone, divided by L.

Augmentation multiplicity (De et al. 2022, arXiv 2204.13650): with K > 1 each example of the lot
is replaced by K augmented copies (``augment(x, generator)``, an independent random draw per row),
and the per-example gradient that is clipped is the mean over its copies, g(x_i) = (1/K) Σ_k
∇ℓ(θ, aug_k(x_i)): averaged *before* clipping, so example i still adds one vector of norm ≤ C and
the sensitivity, the noise σC and the accounting are those of K = 1. K = 1 is the plain step.

Details: docs/PERFORMANCE.md, "dpsgd/mechanism/optim.py".
"""

from __future__ import annotations

import torch

from dpsgd.mechanism.correlated import CorrelatedNoise
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.plan import Plan


class DPSGD:
    """Noisy SGD on top of a per-example clipping engine: one lot of Algorithm 1 per ``step``.

    Args:
        model: the network whose trainable parameters are updated in place.
        clipper: a ``dpsgd.mechanism.clipping.PerExampleClipper`` over ``model``.
        noise: the Gaussian noise source (``GaussianNoise``: seeded, or OS entropy).
        plan: the mechanism (``dpsgd.mechanism.plan.Plan``): σ, C and the expected lot size L are
            read from it, never given separately.
        lr: the learning rate η (``set_lr`` changes it per epoch).
        momentum: μ in [0, 1); 0 is the plain update.
        augment_multiplicity: K augmented copies per example, averaged before clipping.
        augment: ``augment(x, generator) -> x``, per row, when the step makes the K copies itself.
        augment_generator: the generator of those draws when a step is given none.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        clipper,
        noise: GaussianNoise,
        plan: Plan,
        lr: float,
        momentum: float = 0.0,
        augment_multiplicity: int = 1,
        augment=None,
        augment_generator=None,
    ):
        if not isinstance(plan, Plan):
            raise ValueError(
                f"DPSGD: plan={plan!r} must be a dpsgd.mechanism.plan.Plan (Plan.by_hand(σ, C, L) "
                "for steps outside a run)"
            )
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"training.momentum={momentum!r} must be in [0, 1)")
        self.plan = plan
        self.event = plan.event  # what each lot is charged as (None: not private)
        self.model = model
        self.clipper = clipper
        self.noise = noise
        self.C = float(plan.clip_norm)
        self.L = float(
            plan.lot_size
        )  # an attribute: the audit's realised_lot variant replaces it per step
        self.lr = float(lr)
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.comm = (
            None  # distributed.Aggregator under torchrun: Σ over ranks, the noise added once
        )
        K = augment_multiplicity
        if isinstance(K, bool) or not isinstance(K, int) or K < 1:
            raise ValueError(f"privacy.augment_multiplicity={K!r} must be an integer >= 1")
        self.K = K
        self.augment = augment  # augment(x, generator) -> x, per-row random
        self.augment_generator = augment_generator
        self.momentum = float(momentum)
        self.velocity: dict[
            str, torch.Tensor
        ] = {}  # v_t per parameter (empty before the first step)
        # privacy.noise=bandmf|blt: row t of C⁻¹Z instead of independent draws (b = 1: None, the
        # noise below draw for draw)
        s = plan.strategy
        self.correlated = (
            CorrelatedNoise(noise, s)
            if plan.private and s is not None and not s.independent
            else None
        )

    @property
    def sigma(self) -> float:
        """The noise multiplier: the plan's (its charged event's σ; 0 when not private)."""
        return self.plan.sigma

    def state_dict(self) -> dict:
        """The optimiser state a resumed run needs (the momentum buffers v_t, on the CPU; with
        correlated noise, its step and buffers)."""
        out = {
            "momentum": self.momentum,
            "velocity": {n: v.detach().cpu() for n, v in self.velocity.items()},
        }
        if self.correlated is not None:
            out["correlated"] = self.correlated.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state["velocity"]) - set(self.params)
        if unknown:
            raise ValueError(f"optimizer state names unknown parameters: {sorted(unknown)}")
        self.velocity = {
            n: v.to(self.params[n].device, self.params[n].dtype)
            for n, v in state["velocity"].items()
        }
        if self.correlated is not None:  # the same noise sequence continues
            if "correlated" not in state:
                raise ValueError("optimizer state holds no correlated-noise state to continue")
            self.correlated.load_state_dict(state["correlated"], self.params)

    def _rows(self, xb: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The K augmented copies of each example of a physical batch, consecutive: [B·K, ...]
        (``generator``: the lot's; None: the one given at construction)."""
        if self.K > 1:
            xb = xb.repeat_interleave(self.K, 0)
        g = self.augment_generator if generator is None else generator
        return xb if self.augment is None else self.augment(xb, g)

    def set_lr(self, lr: float) -> None:
        self.lr = float(lr)

    def noisy_gradient(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        physical_batch_size: int | None = None,
        weights: torch.Tensor | None = None,
    ):
        """g̃_t = (Σ_i w_i clip(g_i) + N(0, σ²C²)) / L for one lot; returns (grads, loss_sum,
        lot_size).

        ``physical_batch_size`` bounds the examples per forward/backward (memory only; None = the
        whole lot at once). ``weights`` [len(x)] (None: all ones): per-example weights, 0 for the
        padding rows of a fixed-shape lot; lot_size counts the rows of positive weight."""
        total, loss_sum, lot_size = self._noisy_sum(x, y, physical_batch_size, weights)
        with torch.no_grad():
            for g in total.values():
                g.div_(self.L)
        return total, loss_sum, lot_size

    def _noisy_sum(self, x, y, physical_batch_size, weights=None, generator=None):
        """Σ_i clip(g_i) + N(0, σ²C²) per parameter (no division yet).

        The first physical batch's sums become the accumulators; later batches are added into
        them in place (``clipped_sum(..., out=...)``; for Linear layers inside the weight-gradient
        GEMM), and the noise is added last, in place. Allocating the accumulators only after the
        first batch's backward pass keeps them out of the step's memory peak. ``weights``: sliced
        per physical batch like x and y, and passed to the clipper only when given."""
        physical_batch_size = physical_batch_size or max(1, len(x))
        if weights is not None and len(weights) != len(x):
            raise ValueError(f"weights has {len(weights)} rows, the lot {len(x)}")
        lot_size = len(x) if weights is None else int((weights > 0).sum())  # the real rows
        total = None  # Σ_i clip(g_i), accumulated over physical batches
        loss_sum = None  # Σ_i loss_i as a tensor: no device sync per step
        for start in range(0, len(x), physical_batch_size):
            xb, yb = (
                (x, y)
                if physical_batch_size >= len(x)
                else (
                    x[start : start + physical_batch_size],
                    y[start : start + physical_batch_size],
                )
            )
            kw = (
                {} if weights is None else {"weights": weights[start : start + physical_batch_size]}
            )
            if self.K > 1 or self.augment is not None:
                res = self.clipper.clipped_sum(
                    self._rows(xb, generator), yb, out=total, multiplicity=self.K, **kw
                )
            else:
                res = self.clipper.clipped_sum(xb, yb, out=total, **kw)
            total = res.grads
            loss_sum = res.loss_sum if loss_sum is None else loss_sum + res.loss_sum
        if total is None:  # empty lot (or share): the step is the noise alone
            total = {n: torch.zeros_like(p) for n, p in self.params.items()}
            loss_sum = torch.zeros((), device=x.device)
        if self.comm is not None:  # the global sum over ranks, noised exactly once
            return self.comm.aggregate(total, loss_sum, lot_size, self._add_noise)
        self._add_noise(total)
        return total, loss_sum, lot_size

    def _add_noise(self, total: dict) -> None:
        """N(0, σ²C²) into each clipped group's sum, in place (correlated: row t of C⁻¹Z)."""
        with torch.no_grad():
            if self.correlated is not None:
                self.correlated.add_(total, self.sigma * self.C)
                return
            for g in total.values():
                self.noise.add_(g, self.sigma * self.C)

    def step(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        physical_batch_size: int | None = None,
        weights: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> dict:
        """One lot of Algorithm 1: θ ← θ − (η/L)(Σ_i w_i clip(g_i) + N(0, σ²C²)).

        The division by L is folded into the update (one pass less over the parameters).
        ``weights``: see ``noisy_gradient`` (None: the plain step, operation for operation).
        ``generator``: the lot's augmentation draws, when the step augments the K copies itself.
        Returns {'loss_sum' (0-dim tensor, on the model's device), 'lot_size' (real rows)} for
        logging."""
        total, loss_sum, lot_size = self._noisy_sum(x, y, physical_batch_size, weights, generator)
        with torch.no_grad():
            if self.momentum == 0.0:
                for n, p in self.params.items():
                    p.add_(total[n], alpha=-self.lr / self.L)
            else:
                for n, p in self.params.items():
                    g = total[n].div_(self.L)  # g̃_t
                    v = self.velocity.get(n)
                    if v is None:
                        self.velocity[n] = v = g.clone()
                    else:
                        v.mul_(self.momentum).add_(g)
                    p.add_(v, alpha=-self.lr)
        return {"loss_sum": loss_sum, "lot_size": lot_size}
