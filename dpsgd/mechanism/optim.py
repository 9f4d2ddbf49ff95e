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

The non-private step (``plain=True``: ``privacy.private=false``, ``PrivateTrainer(private=False)``)
is a plain PyTorch step: one forward pass, the model's own summed loss Σ_i ℓ_i (cross-entropy with
``reduction="sum"``, or the given per-example loss summed), one backward pass, no per-example work,
no clipping and no noise; the sum is divided by L like the private one (θ ← θ − (η/L) Σ_i ∇ℓ_i,
which is torch's mean reduction when the lot holds L examples).

Details: docs/PERFORMANCE.md, "dpsgd/mechanism/optim.py".
"""

from __future__ import annotations

import copy

import torch

from dpsgd.mechanism.clipping.clip import example_losses, summed_loss
from dpsgd.mechanism.correlated.noise import CorrelatedNoise
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
        optimizer: a ``torch.optim.Optimizer`` over the model's trainable parameters (every one of
            them, nothing else): each step writes the noisy mean gradient g̃ into ``.grad`` and
            calls ``optimizer.step()`` (Adam, AdamW, ...: post-processing of g̃, no privacy cost);
            None: the built-in update above (``lr``, ``momentum``).
        plain: the non-private step (module doc): the clipper is not called, nothing is noised;
            refused with a charged plan.
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
        optimizer=None,
        plain: bool = False,
    ):
        if not isinstance(plan, Plan):
            raise ValueError(
                f"DPSGD: plan={plan!r} must be a dpsgd.mechanism.plan.Plan (Plan.by_hand(σ, C, L) "
                "for steps outside a run)"
            )
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"training.momentum={momentum!r} must be in [0, 1)")
        if plain and plan.event is not None:
            raise ValueError("DPSGD: plain=True (not private) with a plan that charges each lot")
        self.plain = bool(plain)
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
        self.optimizer = _checked_optimizer(optimizer, model, self.params)
        self.updates = 0  # updates begun (the lot loop charges a step that began one: lots.py)
        # privacy.noise=bandmf|blt: row t of C⁻¹Z instead of independent draws (b = 1: None, the
        # noise below draw for draw)
        s = plan.strategy
        self.correlated = (
            CorrelatedNoise(noise, s)
            if plan.private and s is not None and not s.independent
            else None
        )

    @property
    def engine(self) -> str:
        """What computes the step's gradient sum: ``plain`` (one backward pass of the summed
        loss), else the clipper's engines (``PerExampleClipper.mode``)."""
        return "plain" if self.plain else self.clipper.mode

    @property
    def sigma(self) -> float:
        """The noise multiplier: the plan's (its charged event's σ; 0 when not private)."""
        return self.plan.sigma

    def state_dict(self) -> dict:
        """The optimiser state a resumed run needs (the momentum buffers v_t, on the CPU; a torch
        optimizer's own state under ``torch``, with its class; with correlated noise, its step and
        buffers)."""
        out = {
            "momentum": self.momentum,
            "velocity": {n: v.detach().cpu() for n, v in self.velocity.items()},
        }
        if self.optimizer is not None:  # a copy: torch's shares the live moment tensors
            out["torch"] = copy.deepcopy(self.optimizer.state_dict())
            out["torch_class"] = type(self.optimizer).__name__
        if self.correlated is not None:
            out["correlated"] = self.correlated.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state["velocity"]) - set(self.params)
        if unknown:
            raise ValueError(f"optimizer state names unknown parameters: {sorted(unknown)}")
        if (self.optimizer is None) != (state.get("torch") is None):
            raise ValueError(
                f"optimizer state is {state.get('torch_class') or 'the built-in update'}'s, this "
                f"step has {type(self.optimizer).__name__ if self.optimizer else 'the built-in'}"
            )
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["torch"])
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

    def prove(self, x: torch.Tensor, y: torch.Tensor, generator=None) -> None:
        """The clipper's proofs (``PerExampleClipper.prove``) on examples ``x``, ``y`` as a step
        hands them to it (K augmented copies each; ``generator``: the augmentation's). The plain
        step relies on nothing per example: nothing to prove."""
        if self.plain:
            return
        if self.K > 1 or self.augment is not None:
            self.clipper.prove(self._rows(x, generator), y, multiplicity=self.K)
        else:
            self.clipper.prove(x, y)

    def set_lr(self, lr: float) -> None:
        """The learning rate η of the next lots (a schedule's value; every parameter group of a
        torch optimizer)."""
        self.lr = float(lr)
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr

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
        """Σ_i clip(g_i) + N(0, σ²C²) per parameter (no division yet), the lot held as x, y and cut
        into physical batches of ``physical_batch_size`` examples (``noisy_sum``). ``weights``:
        sliced per physical batch like x and y, and passed to the clipper only when given."""
        physical_batch_size = physical_batch_size or max(1, len(x))
        if weights is not None and len(weights) != len(x):
            raise ValueError(f"weights has {len(weights)} rows, the lot {len(x)}")
        lot_size = len(x) if weights is None else int((weights > 0).sum())  # the real rows
        parts = self._physical(x, y, physical_batch_size, weights, generator)
        return self.noisy_sum(parts, lot_size, x.device)

    def _physical(self, x, y, physical_batch_size, weights, generator):
        """(x rows, y, clipper keywords) of each physical batch of a lot held as x, y."""
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
                yield self._rows(xb, generator), yb, {"multiplicity": self.K, **kw}
            else:
                yield xb, yb, kw

    def noisy_sum(self, parts, lot_size: int, device):
        """Σ_i clip(g_i) + N(0, σ²C²) per parameter over a lot's physical batches ``parts``:
        (x, y, clipper keywords) each; y None for a batch of tensors read by the user's
        ``loss(model, batch)``. Returns (the noisy sum, Σ_i loss_i, ``lot_size``).

        The first physical batch's sums become the accumulators; later batches are added into
        them in place (``clipped_sum(..., out=...)``; for Linear layers inside the weight-gradient
        GEMM), and the noise is added last, in place. Allocating the accumulators only after the
        first batch's backward pass keeps them out of the step's memory peak."""
        total = None  # Σ_i clip(g_i), accumulated over physical batches
        loss_sum = None  # Σ_i loss_i as a tensor: no device sync per step
        for xb, yb, kw in parts:
            if self.plain:
                total, part = self._plain_sum(xb, yb, total, kw.get("weights"))
            else:
                res = self.clipper.clipped_sum(xb, yb, out=total, **kw)
                total, part = res.grads, res.loss_sum
            loss_sum = part if loss_sum is None else loss_sum + part
        if total is None:  # empty lot (or share): the step is the noise alone
            total = {n: torch.zeros_like(p) for n, p in self.params.items()}
            loss_sum = torch.zeros((), device=device)
        if self.comm is not None:  # the global sum over ranks, noised exactly once
            return self.comm.aggregate(total, loss_sum, lot_size, self._add_noise)
        self._add_noise(total)
        return total, loss_sum, lot_size

    def _plain_sum(self, x, y, out, weights):
        """Σ_i w_i ∇ℓ_i of one physical batch (its K rows per example already drawn) by one
        backward pass of the summed loss (module doc), added into ``out`` when given; returns
        (grads by name, the loss sum, detached)."""
        loss = self.clipper.loss
        with torch.enable_grad():
            if weights is None:
                total, _, reported = summed_loss(self.model, x, y, self.K, None, loss)
            else:  # Σ_i w_i ℓ_i: a weight-0 row (padding) adds exactly 0
                rows = example_losses(self.model, x, y, self.K, loss)
                total = (rows * weights.to(rows)).sum()
                reported = total.detach()
        gs = torch.autograd.grad(total, list(self.params.values()), allow_unused=True)
        grads = {}
        with torch.no_grad():
            for (n, p), g in zip(self.params.items(), gs):
                if out is not None:
                    grads[n] = out[n] if g is None else out[n].add_(g)
                else:
                    grads[n] = torch.zeros_like(p) if g is None else g
        return grads, reported

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
        self.update(total)
        return {"loss_sum": loss_sum, "lot_size": lot_size}

    def update(self, total: dict) -> None:
        """The descent on a lot's noisy sum Σ_i clip(g_i) + N(0, σ²C²) (consumed): with a torch
        optimizer, g̃ = sum / L into each parameter's ``.grad`` and ``optimizer.step()``
        (post-processing of the noisy gradient: Adam's moments, weight decay and any schedule
        cost nothing more); else the built-in SGD, θ ← θ − (η/L) sum, or heavy ball on g̃."""
        self.updates += 1
        with torch.no_grad():
            if self.optimizer is not None:
                for n, p in self.params.items():
                    p.grad = total[n].div_(self.L)  # g̃_t
                self.optimizer.step()
            elif self.momentum == 0.0:
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
        if not self.plain:  # the next lot's noise, drawn on a free core meanwhile (noise.py)
            ahead = getattr(self.noise, "ahead", None)
            if ahead is not None:
                ahead()


def _checked_optimizer(optimizer, model, params: dict):
    """``optimizer`` when it updates exactly the model's trainable parameters; ValueError naming
    the first that it lacks or that is not one (a frozen or foreign tensor would move without
    being clipped, or a clipped and noised one would never move)."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer={optimizer!r} must be a torch.optim.Optimizer")
    mine = {id(p): n for n, p in params.items()}
    frozen = {id(p): n for n, p in model.named_parameters() if not p.requires_grad}
    seen = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in frozen:
                continue  # never given a gradient: never moves
            if id(p) not in mine:
                raise ValueError(
                    f"optimizer: updates a tensor of shape {tuple(p.shape)} that is not a trainable "
                    "parameter of the model (it would move unclipped and unnoised)"
                )
            seen.add(id(p))
    missing = [n for n, p in params.items() if id(p) not in seen]
    if missing:
        raise ValueError(
            f"optimizer: the trainable parameter '{missing[0]}' is clipped and noised but not in "
            "the optimizer (build it on the model's trainable parameters, or freeze it: "
            "requires_grad_(False) before make_private)"
        )
    return optimizer
