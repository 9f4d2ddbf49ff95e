"""The correlated noise of a matrix-factorisation run, streamed: step t adds row t of scale·C⁻¹Z
(mechanism/correlated/strategy.py) to each clipped group's sum, Z the i.i.d. N(0, σ²C²) draws of the run's
``GaussianNoise``, never holding the past noise beyond a few model-sized buffers.

* BandMF (b-banded Toeplitz C, ‖c‖ = 1): w_t = (z_t − Σ_{j=1}^{b−1} c_j w_{t−j}) / c_0, the
  last b − 1 outputs kept (Choquette-Choo et al. 2023, arXiv 2306.08153, Alg. 9 for a Toeplitz C).
* BLT (c_0 = 1, c_k = Σ_j ω_j θ_j^{k−1}): w_t = z_t − Σ_j ω_j S_j, then S_j ← θ_j S_j + w_t, with d
  buffers S_j (McMahan et al. 2024, arXiv 2408.08868, Alg. 3); the noise added is Δ_∞·w_t.

The recursion runs in the gradients' dtype, one parameter tensor at a time, in the order the step
hands them over (the draws of z_t are taken in that order, as Algorithm 1 draws its noise). Its
state (the step, the buffers) is what a resumed run needs to continue the same noise sequence;
``state_dict`` carries it (with the strategy, compared on load). b = 1 never gets here: the step
then draws Algorithm 1's noise itself (``DPSGD``).
"""

from __future__ import annotations

import torch

from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.correlated.strategy import Strategy


class CorrelatedNoise:
    """Row t of scale·C⁻¹Z for the strategy ``strategy``, z drawn from ``source``.

    Args:
        source: the Gaussian draws (seeded or OS entropy: ``GaussianNoise``).
        strategy: the strategy matrix C (``dpsgd.mechanism.correlated.strategy.Strategy``, not b = 1).
    """

    def __init__(self, source: GaussianNoise, strategy: Strategy):
        if strategy.independent:
            raise ValueError("CorrelatedNoise: b = 1 is Algorithm 1's noise (no correlation)")
        self.source, self.strategy = source, strategy
        self.step = 0  # rows of C⁻¹Z drawn so far
        self.buffers: dict[str, torch.Tensor] = {}  # name → [buffers, *shape]
        if strategy.kind == "bandmf":
            self._c = [float(x) for x in strategy.coef]
        else:
            self._theta = [float(x) for x in strategy.theta]
            self._omega = [float(x) for x in strategy.omega]

    def add_(self, total: dict, std: float) -> None:
        """total[name] += row ``step`` of scale·C⁻¹Z for each tensor (Z ~ N(0, std²)), in place."""
        for name, g in total.items():
            z = self.source.sample(g.shape, std, dtype=g.dtype)
            buf = self.buffers.get(name)
            if buf is None:
                buf = self.buffers[name] = torch.zeros(
                    (self.strategy.buffers, *g.shape), dtype=g.dtype, device=g.device
                )
            if self.strategy.kind == "bandmf":
                g.add_(self._bandmf(z, buf))
            else:
                g.add_(self._blt(z, buf), alpha=self.strategy.scale)
        self.step += 1

    def _bandmf(self, z: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """w_t = (z_t − Σ_j c_j w_{t−j}) / c_0; buf[(t − j) mod (b − 1)] holds w_{t−j} (zero before
        the first step)."""
        b, t = len(self._c), self.step
        for j in range(1, b):
            if t - j >= 0:
                z.add_(buf[(t - j) % (b - 1)], alpha=-self._c[j])
        if self._c[0] != 1.0:
            z.div_(self._c[0])
        buf[t % (b - 1)].copy_(z)
        return z

    def _blt(self, z: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """w_t = z_t − Σ_j ω_j S_j; S_j ← θ_j S_j + w_t."""
        for j, w in enumerate(self._omega):
            z.add_(buf[j], alpha=-w)
        for j, th in enumerate(self._theta):
            buf[j].mul_(th).add_(z)
        return z

    def state_dict(self) -> dict:
        return {
            "strategy": self.strategy.to_dict(),
            "step": self.step,
            # copies: the buffers move on in place with the next step
            "buffers": {n: b.detach().to("cpu", copy=True) for n, b in self.buffers.items()},
        }

    def load_state_dict(self, state: dict, params: dict) -> None:
        """Continue from ``state`` (its strategy must be this one); ``params``: name → tensor, the
        device and dtype the buffers go to."""
        if Strategy.from_dict(state["strategy"]) != self.strategy:
            raise ValueError(
                "correlated noise: the checkpoint's strategy differs from this run's (privacy.noise,"
                " privacy.bands or the horizon it was optimised for)"
            )
        unknown = set(state["buffers"]) - set(params)
        if unknown:
            raise ValueError(f"correlated noise state names unknown parameters: {sorted(unknown)}")
        self.step = int(state["step"])
        self.buffers = {
            n: b.to(params[n].device, params[n].dtype) for n, b in state["buffers"].items()
        }
