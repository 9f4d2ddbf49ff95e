"""Exponential moving average of the weights (De et al. 2022, arXiv 2204.13650, §"parameter
averaging").

After each lot t (each DP-SGD update θ_t):

    θ̄_t = β θ̄_{t−1} + (1 − β) θ_t,      θ̄_0 = θ_0 (the initial weights),   β = training.ema_decay

θ̄ is a function of the released iterates θ_1 .. θ_T only, so it is post-processing of the DP-SGD
releases and costs no privacy (Dwork & Roth 2014, Prop. 2.1). When EMA is on, evaluation (the
accuracies in metrics.csv) and the released model (``checkpoint.pt``'s ``ema``) are θ̄; the
training weights θ_T stay in ``model`` (what a resumed run continues from).

Every floating-point entry of the model's state_dict is averaged (parameters, frozen ones included,
and floating buffers; a frozen tensor stays equal to itself); other entries are copied.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < float(decay) < 1.0:
            raise ValueError(f"training.ema_decay={decay!r}: must be in (0, 1)")
        self.decay = float(decay)
        self.shadow = {n: v.detach().clone() for n, v in model.state_dict().items()}
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """θ̄ ← β θ̄ + (1 − β) θ, in place (``lerp_``: θ̄ + (1 − β)(θ − θ̄))."""
        for n, v in model.state_dict().items():
            s = self.shadow[n]
            if s.is_floating_point():
                s.lerp_(v.detach(), 1.0 - self.decay)
            else:
                s.copy_(v)
        self.updates += 1

    def state_dict(self) -> dict:
        return {
            "decay": self.decay,
            "updates": self.updates,
            "weights": {n: v.detach().cpu().clone() for n, v in self.shadow.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if float(state["decay"]) != self.decay:
            raise ValueError(
                f"training.ema_decay={self.decay} differs from the saved EMA's {state['decay']}"
            )
        if state["weights"].keys() != self.shadow.keys():
            raise ValueError("the saved EMA weights do not match the model's state_dict")
        for n, v in state["weights"].items():
            self.shadow[n].copy_(v)
        self.updates = int(state["updates"])

    @contextmanager
    def applied(self, model: nn.Module):
        """The model holds θ̄ inside the block, and its own weights again after it."""
        saved = {n: v.detach().clone() for n, v in model.state_dict().items()}
        model.load_state_dict(self.shadow)
        try:
            yield model
        finally:
            model.load_state_dict(saved)
