"""ε of each batch sampler for the same (N, L, σ, lots, δ): the privacy CLI's ``--N/--L`` mode.

Each sampler object (``dpsgd/mechanism/sampling.py``) says what its lots are charged as
(``Sampler.charges``: the ledger events and the neighbouring relation the training loop records);
they go into a ``Ledger`` and are composed by every accountant that serves them. ``epsilon`` is
the smallest of those (each a valid upper bound). For ``shuffle`` the result is a bracket: the
``epsilon`` above (upper: one Gaussian per epoch at σ/2, replace-one) and ``epsilon_lower`` (Chua et
al. 2024, ``accountant/shuffle_lower.py``), with ``epsilon_if_poisson``: the Poisson number
(q = L/N, every lot) a shuffled run would wrongly report. For ``fixed_size``, ``epsilon_lower`` is
the ε of one dataset pair whose gradients never change (the lot's remove pair, and its reverse, at
rate L/N and noise σ/2, self-composed by PLD: the mechanism itself loses that much on that pair, up to
the PLD grid's error), and ``epsilon_poisson_replace_one`` the Poisson lots' ε under replace-one as
dp_accounting accounts it (``truncated.replace_one_poisson_epsilon``); ``closing_note`` compares
balls_in_bins with Poisson and fixed_size with Poisson under replace-one.
"""
from __future__ import annotations

import time

from dpsgd.accountant import Ledger, pld, shuffle_lower, truncated
from dpsgd.mechanism.sampling import SAMPLERS, make_sampler


def sampler_epsilon(name: str, N: int, L: int, sigma: float, steps: int, delta: float,
                    B: int | None = None) -> dict:
    """{"sampler", "adjacency", "epsilon", "accountant", "by_accountant", ...} for one sampler."""
    t0 = time.perf_counter()
    s = make_sampler(name, N, L, None, B if name == "truncated_poisson" else None)
    led = Ledger()
    for ch, n in s.charges(sigma, steps).items():
        led.record(ch.q, ch.sigma, n, 1, "sgd", ch.event, ch.adjacency, ch.N, ch.B, ch.t)
    by, refused = {}, {}
    for acc in s.accountants:
        try:
            by[acc] = led.epsilon(delta, acc)[0]
        except ValueError as e:
            refused[acc] = " ".join(str(e).split())
    best = min(by, key=by.get) if by else None
    out = {"sampler": name, "N": N, "L": L, "B": getattr(s, "B", None), "sigma": sigma, "steps": steps,
           "delta": delta, "lots_per_epoch": s.lots_per_epoch(), "adjacency": s.relation,
           "amplification_by_sampling": s.amplification, "epsilon": by.get(best), "accountant": best,
           "by_accountant": by}
    if refused:
        out["refused"] = refused
    if name == "shuffle":
        epochs = sum(led.entries[i].count for i in range(len(led.entries)))
        out["epsilon_lower"] = shuffle_lower.epsilon_lower(sigma, s.lots_per_epoch(), epochs, delta)
        out["epsilon_lower_source"] = "Chua et al. 2024 (arXiv 2403.17673), max-statistic lower bound"
        out["epsilon_if_poisson"] = pld.epsilon(L / N, sigma, steps, delta)
    if name == "fixed_size":
        out["epsilon_lower"] = pld.epsilon(L / N, sigma / 2.0, steps, delta)
        out["epsilon_lower_source"] = ("one dataset pair with constant gradients: the lot's remove/add pair "
                                       "(rate L/N, noise sigma/2) self-composed, PLD")
        out["epsilon_poisson_replace_one"] = truncated.replace_one_poisson_epsilon(L / N, sigma, steps, delta)
    out["seconds"] = time.perf_counter() - t0
    return out


def closing_note(res: dict) -> list[str]:
    """Lines comparing the tight samplers with Poisson: balls_in_bins / poisson (add/remove) and
    fixed_size / Poisson under replace-one (each against a 1.10 target), with fixed_size's lower bound."""
    lines = []
    if "balls_in_bins" in res and "poisson" in res:
        r = res["balls_in_bins"]["epsilon"] / res["poisson"]["epsilon"]
        lines.append(f"balls_in_bins / poisson = {r:.3f} (target <= 1.10: {'met' if r <= 1.10 else 'NOT met'})")
    if "fixed_size" in res:
        f = res["fixed_size"]
        r = f["epsilon"] / f["epsilon_poisson_replace_one"]
        lines.append(f"fixed_size / Poisson under replace-one ({f['epsilon_poisson_replace_one']:.4f}) = {r:.3f} "
                     f"(target <= 1.10: {'met' if r <= 1.10 else 'NOT met'}); fixed_size on one dataset pair with "
                     f"constant gradients already loses {f['epsilon_lower']:.4f} "
                     f"({f['epsilon_lower'] / f['epsilon_poisson_replace_one']:.3f} x that Poisson number)")
    return lines


def all_samplers(N, L, sigma, steps, delta, B=None) -> dict:
    """Every sampler's :func:`sampler_epsilon` (truncated_poisson needs B; skipped without it)."""
    return {name: sampler_epsilon(name, N, L, sigma, steps, delta, B)
            for name in SAMPLERS if name != "truncated_poisson" or B is not None}
