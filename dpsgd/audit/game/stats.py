"""From the scores of a distinguishing game to a lower bound on ε that holds with confidence 1 − α.

A mechanism M is (ε, δ)-DP when, for neighbouring datasets D, D' and every set S of outputs,
P[M(D') ∈ S] ≤ e^ε P[M(D) ∈ S] + δ (Abadi et al. 2016, Def. 1). A threshold test
S = {score ≥ t} has false-positive rate FPR = P[M(D) ∈ S] and false-negative rate
FNR = P[M(D') ∉ S]; substituting them gives the hypothesis-testing form of DP
(Kairouz, Oh & Viswanath 2015, Thm 2.1; Jagielski, Ullman & Oprea 2020):

    ε ≥ log((1 − δ − FNR) / FPR)      and, with D and D' swapped,   ε ≥ log((1 − δ − FPR) / FNR).

Only counts are observed, so FPR and FNR are replaced by one-sided Clopper–Pearson upper bounds
(Clopper & Pearson 1934): the p at which the binomial tail P[Bin(n, p) ≤ k] equals 1 − conf, i.e.
the conf-quantile of Beta(k + 1, n − k). Each rate is bounded at confidence 1 − α/2, so both hold
jointly with probability ≥ 1 − α (Bonferroni), and the ε above is then a 1 − α lower bound.

The threshold t and the direction of the test are chosen on a random ``select_fraction`` of the
trials and evaluated only on the rest, so picking the best of many thresholds does not inflate the
bound.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import beta

DIRECTIONS = (("in>t", 1.0), ("in<t", -1.0))  # decide "canary present" when score ≥ t / score < t


def cp_upper(k, n, conf: float):
    """One-sided Clopper–Pearson upper bound on a binomial rate (k successes in n) at confidence
    conf: the conf-quantile of Beta(k + 1, n − k) (Clopper & Pearson 1934); 1 when k = n."""
    k, n = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    with np.errstate(all="ignore"):
        ub = beta.ppf(conf, k + 1, np.maximum(n - k, 1e-300))
    return np.where(k >= n, 1.0, ub)


def eps_from_rates(fpr, fnr, delta: float):
    """max(0, log((1 − δ − FNR) / FPR)): the ε a test with these error rates certifies
    (Kairouz et al. 2015, Thm 2.1). +inf when FPR = 0 and 1 − δ − FNR > 0."""
    fpr, fnr = np.asarray(fpr, dtype=float), np.asarray(fnr, dtype=float)
    with np.errstate(all="ignore"):
        e = np.log(np.maximum(1.0 - delta - fnr, 0.0) / fpr)
    return np.where(np.isfinite(e), np.maximum(e, 0.0), np.where(e > 0, np.inf, 0.0))


def _counts(out, inn, t):
    """For thresholds t: FP = #{out ≥ t}, FN = #{in < t}."""
    out, inn = np.sort(out), np.sort(inn)
    fp = len(out) - np.searchsorted(out, t, side="left")
    fn = np.searchsorted(inn, t, side="left")
    return fp, fn


def _best_threshold(out, inn, delta, conf):
    """Threshold maximising the CP lower bound of ε on this (selection) sample; returns (t, ε)."""
    t = np.unique(np.concatenate([out, inn]))
    fp, fn = _counts(out, inn, t)
    e = eps_from_rates(cp_upper(fp, len(out), conf), cp_upper(fn, len(inn), conf), delta)
    i = int(np.argmax(e))
    return float(t[i]), float(e[i])


def clopper_pearson_bound(
    scores, present, delta: float, alpha: float = 0.05, select_fraction: float = 0.5, seed: int = 0
) -> dict:
    """Clopper–Pearson lower bound on ε from scores of trials with
    (present=True) / without the canary.

    A random ``select_fraction`` of the trials chooses the threshold and the test's direction; the
    rest evaluate it. Both error rates are bounded at confidence 1 − α/2 (jointly 1 − α).
    Returns eps_lb, eps_point (observed rates, no interval), threshold, direction, n_out, n_in,
    false_pos, false_neg — the fields of ``AuditResult`` that the statistics fill.
    """
    scores, present = np.asarray(scores, dtype=float), np.asarray(present, dtype=bool)
    perm = np.random.default_rng(seed).permutation(len(scores))
    n_sel = int(round(select_fraction * len(scores)))
    sel, ev = perm[:n_sel], perm[n_sel:]
    conf = 1.0 - alpha / 2
    best = None
    for direction, sign in DIRECTIONS:
        s = sign * scores
        t, e = _best_threshold(s[sel][~present[sel]], s[sel][present[sel]], delta, conf)
        if best is None or e > best[2]:
            best = (direction, sign, e, t)
    direction, sign, _, t = best
    s = sign * scores[ev]
    out, inn = s[~present[ev]], s[present[ev]]
    if not (len(out) and len(inn)):
        raise ValueError(
            f"select_fraction={select_fraction:g}: the {len(ev)} evaluation trials hold no trial "
            f"{'without' if not len(out) else 'with'} the canary; evaluate on more trials"
        )
    fp, fn = _counts(out, inn, np.array([t]))
    fp, fn = int(fp[0]), int(fn[0])
    eps_lb = float(
        eps_from_rates(cp_upper(fp, len(out), conf), cp_upper(fn, len(inn), conf), delta)
    )
    eps_point = float(eps_from_rates(fp / len(out), fn / len(inn), delta))
    return dict(
        eps_lb=eps_lb,
        eps_point=eps_point,
        threshold=sign * t,
        direction=direction,
        n_out=len(out),
        n_in=len(inn),
        false_pos=fp,
        false_neg=fn,
    )
