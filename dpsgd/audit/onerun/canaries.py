"""The canaries of a one-run audit (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1)
Training Run"): m examples put into the training data, each *included* independently with
probability 1/2 (the secret bits S_i the auditor then guesses).

* **Gradient canaries** (white-box; the "Dirac canaries" of Nasr et al. 2023): no input the model
  reads, a fixed per-example gradient a · Σ_g e_{c(g,i)} (a = canary_norm · C ≥ C), clipped by the
  engine's own rule and added into the lot's clipped sum before the noise and the all-reduce.
  ``audit.placement=null_space`` puts them on the softmax output layer's class-sum directions
  instead (``placement.py``).
* **Input canaries** (black-box): m training examples, each relabelled to a uniformly random
  wrong class.

**N never depends on the bits.** Every canary has a row in the training set, drawn by the run's own
sampler like any other row; a canary that is *out* is a row whose gradient is exactly zero. So N, q
and the run's privacy claim are the same for every draw of the bits, and the claim is for the
dataset with the canaries in it.

Details: docs/AUDIT.md, "dpsgd/audit/onerun/canaries.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpsgd.core.errors import ConfigError
from dpsgd.mechanism.clipping import ClipResult, clip_factors

from .placement import as_rows


@dataclass
class CanaryDraw:
    """Which canaries are in (the secret bits), drawn from the audit's own seed."""

    gradient_in: torch.Tensor  # [m_g] bool
    input_in: torch.Tensor  # [m_i] bool

    @classmethod
    def draw(cls, m_gradient: int, m_input: int, seed: int) -> CanaryDraw:
        g = torch.Generator().manual_seed(seed)
        return cls(
            torch.rand(m_gradient, generator=g) < 0.5, torch.rand(m_input, generator=g) < 0.5
        )


def add_canaries(X: torch.Tensor, y: torch.Tensor, draw: CanaryDraw, classes: int, seed: int):
    """The training data with the canaries: (X, y, input canary images, their wrong labels).

    The last m_i rows become the input canaries (out of the real data; their labels moved to a
    uniformly random other class); the included ones go back as ordinary rows. Then one special row
    per gradient canary and per excluded input canary (label −(j + 1), image zeros): j < m_g are the
    gradient canaries, j ≥ m_g the excluded input canaries (zero gradient)."""
    m_g, m_i = len(draw.gradient_in), len(draw.input_in)
    if m_i + 1 > len(X):
        raise ConfigError(
            f"audit.input_canaries={m_i}: needs fewer than the {len(X)} training examples"
        )
    gen = torch.Generator().manual_seed(seed + 1)
    keep_X, keep_y = X[: len(X) - m_i], y[: len(y) - m_i]
    Xc = X[len(X) - m_i :]
    yc = (y[len(y) - m_i :] + 1 + torch.randint(0, classes - 1, (m_i,), generator=gen)) % classes
    n_special = m_g + int((~draw.input_in).sum())
    special_X = torch.zeros((n_special, *X.shape[1:]), dtype=X.dtype)
    special_y = -(torch.arange(n_special, dtype=y.dtype) + 1)
    X_out = torch.cat([keep_X, Xc[draw.input_in], special_X])
    y_out = torch.cat([keep_y, yc[draw.input_in], special_y])
    return X_out, y_out, Xc, yc


class GradientCanaries:
    """The clipping engine with the gradient canaries' rows routed to their fixed gradients.

    Wraps a ``PerExampleClipper`` (everything else is delegated): ``clipped_sum`` sends the ordinary
    rows of a physical batch to the engine, and adds, for each canary row present, its gradient
    clipped per group by ``clip_factors`` at the engine's bound (times ``loose`` for the first group
    that carries canaries: a broken variant of the audit, never of training). ``coords``:
    ``placement.place``'s; a canary's r entries in a parameter ([m, r] index) each get its group's
    clipped value / √r (its direction is a unit vector)."""

    def __init__(self, clipper, coords: dict, included: torch.Tensor, a: float, loose: float = 1.0):
        self.inner = clipper
        self.coords = {
            n: as_rows(idx) for n, idx in coords.items()
        }  # name -> [m, r] flat indices or −1
        self.included = included  # [m] bool: canary i is in
        self.m = len(included)
        self.a = float(a)
        self.loose = float(loose)
        names = {n: gi for gi, g in enumerate(clipper.groups) for n in g}
        self.group_of = names
        # the first group with a canary entry: group 0 under the Dirac placement, the softmax
        # layer's under the null-space one (a looser bound where no canary lives would be invisible
        # by construction)
        carrying = [
            names[n] for n, idx in self.coords.items() if n in names and bool((idx >= 0).any())
        ]
        self.loose_group = min(carrying, default=0)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _values(self, device, dtype) -> torch.Tensor:
        """The clipped value of a canary's coordinate in each group: a · min(1, C_g / a)."""
        k = len(self.inner.groups)
        norms = torch.full((1, k), self.a, dtype=torch.float64)
        C = self.inner.clip_norm
        f = clip_factors(norms, C)
        if C is not None and self.loose != 1.0:
            g = self.loose_group
            f[0, g] = clip_factors(norms[:, g : g + 1], C * self.loose)[0, 0]
        return (self.a * f[0]).to(device=device, dtype=dtype)

    def clipped_sum(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        out=None,
        multiplicity: int = 1,
        weights: torch.Tensor | None = None,
    ) -> ClipResult:
        """``weights`` (per example, 0 for the padding rows of a fixed-shape lot): the ordinary
        rows' weights go to the engine; a canary row adds its gradient times its weight
        (0: nothing)."""
        kw = {} if weights is None else {"weights": weights}
        special = y < 0
        if not bool(special.any()):
            return self.inner.clipped_sum(x, y, out=out, multiplicity=multiplicity, **kw)
        real = ~special
        if multiplicity == 1:
            # the special rows stay in the batch at weight 0 (label 0, a zero image): no copy of the
            # batch, and exactly nothing of theirs in the sum (their clip factor times 0)
            w_real = real.to(
                device=x.device, dtype=x.dtype if x.is_floating_point() else torch.float32
            )
            kw["weights"] = w_real if weights is None else weights * w_real.to(weights)
            res = self.inner.clipped_sum(x, y.clamp_min(0), out=out, **kw)
        else:
            rows = real.repeat_interleave(multiplicity)
            if weights is not None:
                kw["weights"] = weights[real.to(weights.device)]
            res = self.inner.clipped_sum(x[rows], y[real], out=out, multiplicity=multiplicity, **kw)
        ids = (-y[special] - 1).cpu()
        w = None if weights is None else weights[special.to(weights.device)].cpu()
        keep = ids < self.m  # gradient canaries (the rest: zero gradient)
        keep[keep.clone()] = self.included[ids[keep]]  # an excluded canary's gradient is zero
        if w is not None:
            keep &= w > 0  # a padding row adds nothing
        ids, w = ids[keep], (None if w is None else w[keep])
        if len(ids):
            first = next(iter(res.grads.values()))
            vals = self._values(first.device, first.dtype)
            with torch.no_grad():
                for n, g in res.grads.items():
                    idx = self.coords.get(n)
                    if idx is None:
                        continue
                    sel = idx[ids]  # [n, r]
                    has = sel[:, 0] >= 0
                    r = sel.shape[1]
                    add = (vals[self.group_of[n]] / r**0.5).expand(int(has.sum()), r).clone()
                    if w is not None:
                        add = add * w[has].to(add)[:, None]
                    if add.numel():
                        g.view(-1).index_add_(0, sel[has].reshape(-1).to(g.device), add.reshape(-1))
        return res
