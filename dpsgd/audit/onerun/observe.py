"""What the white-box auditor sees and how it scores each gradient canary: every iterate θ_t.

Around each DP-SGD step the observer reads the parameters at the canaries' coordinates before and
after and recovers the released noisy sum s_t of that step from the update, as the claimed
mechanism defines it (Abadi et al. 2016, Algorithm 1; optim.py; L the *expected* lot size). On
canary i's direction the claimed mechanism gives z_{t,i} ~ N(0, 1), shifted by μ = √k/σ in each lot
that holds canary i. The scores: ``sum`` (Σ_t z_{t,i}; Steinke et al. 2023, §6) and ``llr``
(Σ_t log(1 − q + q · exp(μ z_{t,i} − μ²/2)), the log-likelihood ratio of the claimed mechanism).

``normalise="measured"`` divides each step's z by the noise std measured across the m canaries
(``noise_scale``), which couples them; ``normalise="claimed"`` divides by the claimed σC only.
Either is a function of the released iterates only, so the one-run bound holds for it.
``detrend`` = τ > 0 (off by default) subtracts a running mean of the canary's own past z.

Details (the update inversion, the scores, why detrending is off): docs/AUDIT.md,
"dpsgd/audit/onerun/observe.py".
"""

from __future__ import annotations

import math

import torch

from .placement import as_rows


def noise_scale(z: torch.Tensor) -> float:
    """The noise std of one step's z across the canaries, as the auditor measures it: 1.4826 × the
    median absolute deviation (a consistent, robust estimate for a Gaussian; the few canaries in the
    lot do not move it). 1 under the claimed mechanism; what a mechanism really adds otherwise."""
    if len(z) < 2:
        return 1.0
    mad = float((z - z.median()).abs().median()) * 1.4826
    return mad if mad > 0 else 1.0


class WhiteBoxObserver:
    """Wraps ``DPSGD.step`` (``observe(dp)``) and accumulates both scores for every gradient
    canary."""

    def __init__(
        self,
        coords: dict,
        groups_used: int,
        sigma: float,
        C: float,
        L: float,
        q: float,
        detrend: int = 0,
        normalise: str = "measured",
    ):
        self.coords = {n: as_rows(idx) for n, idx in coords.items() if bool((idx >= 0).any())}
        self.normalise = normalise
        self.m = len(next(iter(coords.values()))) if coords else 0
        self.k = groups_used
        self.unit = math.sqrt(max(groups_used, 1)) * sigma * C  # σC·√k: z = ⟨s, Σ_g e⟩ / unit
        self.mu = math.sqrt(groups_used) / sigma if sigma > 0 else math.inf
        self.L, self.q = float(L), float(q)
        self.sum = torch.zeros(self.m, dtype=torch.float64)
        self.llr = torch.zeros(self.m, dtype=torch.float64)
        self.sumsq = torch.zeros(
            self.m, dtype=torch.float64
        )  # Σ_t z², z in units of the claimed σC (noise_check.py)
        self.velocity = None
        self.steps = 0
        self.detrend = int(detrend)
        self.trend = torch.zeros(self.m, dtype=torch.float64)

    def _read(self, params: dict) -> dict:
        """{name: [m]} each canary's coordinate in the parameter: its r entries summed, / √r."""
        return {
            n: params[n]
            .detach()
            .reshape(-1)[idx.clamp_min(0).to(params[n].device)]
            .double()
            .cpu()
            .sum(1)
            / idx.shape[1] ** 0.5
            for n, idx in self.coords.items()
        }

    def observe(self, dp) -> None:
        """Route every ``dp.step`` through this observer
        (the parameters as a white-box auditor sees them)."""
        inner = dp.step

        def step(x, y, physical_batch_size=None, **kw):
            before = self._read(dp.params)
            out = inner(x, y, physical_batch_size=physical_batch_size, **kw)
            after = self._read(dp.params)
            self._score(before, after, dp.lr, dp.momentum)
            return out

        dp.step = step

    def _score(self, before: dict, after: dict, lr: float, momentum: float) -> None:
        proj = torch.zeros(
            self.m, dtype=torch.float64
        )  # ⟨−(θ_{t+1} − θ_t)/η, Σ_g e_{c(g,i)}⟩ = ⟨v_t, ·⟩
        for n, idx in self.coords.items():
            has = idx[:, 0] >= 0
            proj[has] -= (after[n] - before[n])[has] / lr
        if momentum:
            v_prev = self.velocity if self.velocity is not None else torch.zeros_like(proj)
            self.velocity, proj = proj, proj - momentum * v_prev
        z = proj * self.L / self.unit
        self.sumsq += z * z
        if self.detrend:
            z, self.trend = (
                z - self.trend,
                self.trend + (z - self.trend) / min(self.steps + 1, self.detrend),
            )
        scale = noise_scale(z) if self.normalise == "measured" else 1.0
        z, mu = z / scale, self.mu / scale
        self.sum += z
        # log(1 − q + q·e^x) as logaddexp(log(1 − q), log q + x): no overflow for the large shifts
        # of a broken variant
        log_out = torch.tensor(
            math.log1p(-self.q) if self.q < 1 else -math.inf, dtype=torch.float64
        )
        self.llr += torch.logaddexp(log_out, math.log(self.q) + mu * z - mu**2 / 2)
        self.steps += 1

    def scores(self, kind: str) -> torch.Tensor:
        return {"sum": self.sum, "llr": self.llr}[kind]
