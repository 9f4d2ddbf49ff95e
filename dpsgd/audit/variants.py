"""Broken mechanisms the audits must catch — the one list and its one implementation, shared by both
audits: the one-run audit (``python -m dpsgd.audit run``, ``audit.variant``; every variant) and the
one-step game (``python -m dpsgd.audit step --mechanism``; ``GAME_VARIANTS``). Never selectable by a
training configuration. Each breaks the real code path it is handed (``break_mechanism``: the built
clipper and DPSGD step), while the claim is computed as if nothing were broken:

* ``correct``        — nothing changed;
* ``no_clip``        — the engine's clipping is off (``clip_norm = None``); the noise is still σC;
* ``noise_div10``    — the step adds noise σC/10;
* ``noise_per_rank`` — noise sized for a local batch on each of R ranks: every rank adds
  N(0, (σC/R)²) (σC scaled by its share L/R of the lot over L), and the R draws are summed: std
  σC/√R (with one process the R draws are made in it; the claim stays σ);
* ``realised_lot``   — the noisy sum divided by the lot's realised size |L_t| instead of the
  expected L (the lot as this process holds it);
* ``loose_group``    — the first clipping group that carries gradient canaries clipped at 2C while C
  is claimed (applied to the gradient canaries' contributions, which is what the audit observes).
"""

from __future__ import annotations

VARIANTS = ("correct", "no_clip", "noise_div10", "noise_per_rank", "realised_lot", "loose_group")
# the ones the one-step game plays (loose_group acts on the one-run audit's gradient canaries; the
# game's realised_lot needs its mnist_other setting, dpsgd/audit/game/settings.py)
GAME_VARIANTS = ("correct", "no_clip", "noise_div10", "realised_lot")


class ScaledNoise:
    """The noise source with every draw's std multiplied by ``factor`` (the plan, and so the claim,
    unchanged); every other attribute is the wrapped source's."""

    def __init__(self, inner, factor: float):
        self.inner, self.factor = inner, float(factor)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add_(self, t, std: float):
        return self.inner.add_(t, std * self.factor)


class PerRankNoise(ScaledNoise):
    """R independent draws of N(0, (std/R)²) per call: the sum over R ranks of noise sized for a
    local batch."""

    def __init__(self, inner, ranks: int):
        super().__init__(inner, 1.0 / int(ranks))
        self.ranks = int(ranks)

    def add_(self, t, std: float):
        for _ in range(self.ranks):
            self.inner.add_(t, std / self.ranks)
        return t


def break_mechanism(parts, variant: str, ranks: int = 4) -> None:
    """Apply ``variant`` to built parts (``parts.dp``: the DPSGD step, ``parts.clipper``: its
    clipping engine), in place; ``correct`` and ``loose_group``
    (applied by the canaries) change nothing here."""
    dp = parts.dp
    if variant == "no_clip":
        parts.clipper.clip_norm = None
    elif variant == "noise_div10":
        dp.noise = ScaledNoise(dp.noise, 0.1)
    elif variant == "noise_per_rank":
        dp.noise = PerRankNoise(dp.noise, ranks)
    elif variant == "realised_lot":
        inner, expected = dp.step, dp.L

        def step(x, y, physical_batch_size=None, weights=None):
            dp.L = float(max(1, len(x) if weights is None else int((weights > 0).sum())))
            try:
                return inner(
                    x,
                    y,
                    physical_batch_size=physical_batch_size,
                    **({} if weights is None else {"weights": weights}),
                )
            finally:
                dp.L = expected

        dp.step = step
