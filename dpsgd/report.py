"""What a run reports: ε under every accountant, one metrics.csv row per epoch, the privacy
statement (privacy.json) and the console progress line.

The statement names the mechanism, the sampling actually run and how it was charged, the accountant
and the (ε, δ) conversion used, the per-layer convention, the noise source and where the run ran
(house rule: every result records sampling, accountant and conversion).
"""
from __future__ import annotations

import math

from .checkpoint import fingerprint_hash
from .config import Config

COLUMNS = ["epoch", "steps", "lr", "lot_loss", "train_loss", "train_accuracy", "test_accuracy",
           "epsilon", "epsilon_moments", "epsilon_rdp", "epsilon_pld", "epsilon_moments_joint",
           "epsilon_rdp_joint", "epsilon_pld_joint", "lambda_star", "delta", "sigma", "sigma_p", "q",
           "C", "L", "groups", "sampling", "clipping", "convention", "accountant", "grad_sample_mode",
           "seed", "epoch_time_s", "wall_time_s"]
ACCOUNTANTS = ("moments", "rdp", "pld")
CONVERSIONS = {
    "moments": "moments accountant: log moments α(λ) at integer λ = 1..32, tail bound "
               "ε = min_λ (α(λ) + log(1/δ)) / λ (Abadi et al. 2016, Thm 2)",
    "rdp": "Rényi DP of the subsampled Gaussian (Mironov et al. 2019) with the improved RDP→(ε,δ) "
           "conversion (Balle et al. 2020)",
    "pld": "privacy loss distribution, FFT composition, pessimistic discretisation (tight)",
}


def epsilons(ledger, c: Config) -> dict:
    """ε under every accountant × {configured convention, joint}, plus λ* of the moments accountant."""
    p = c.privacy
    if not p.private:
        return {"epsilon": math.inf, "by": {}, "lambda_star": None}
    by = {}
    for acc in ACCOUNTANTS:
        by[acc] = {}
        for conv in dict.fromkeys([p.convention, "joint", "per_tensor"]):
            by[acc][conv] = ledger.epsilon(p.delta, accountant=acc, convention=conv)
    eps, _ = by[c.accountant.name][p.convention]
    return {"epsilon": eps, "by": by, "lambda_star": by["moments"][p.convention][1]}


def metrics_row(epoch, steps, lr, lot_loss, ev, eps, c, sampler, clipper, k, epoch_time, wall):
    p, by = c.privacy, eps["by"]
    e = lambda a, conv: by[a][conv][0] if by else math.inf  # noqa: E731
    return {
        "epoch": epoch, "steps": steps, "lr": lr, "lot_loss": lot_loss,
        "train_loss": ev[0], "train_accuracy": ev[1], "test_accuracy": ev[2],
        "epsilon": eps["epsilon"], "epsilon_moments": e("moments", p.convention),
        "epsilon_rdp": e("rdp", p.convention), "epsilon_pld": e("pld", p.convention),
        "epsilon_moments_joint": e("moments", "joint"), "epsilon_rdp_joint": e("rdp", "joint"),
        "epsilon_pld_joint": e("pld", "joint"), "lambda_star": eps["lambda_star"], "delta": p.delta,
        "sigma": p.sigma if p.private else 0.0, "sigma_p": p.sigma_p if p.private else 0.0,
        "q": sampler.q, "C": p.clip_norm if p.private else math.inf, "L": p.lot_size, "groups": k,
        "sampling": sampler.name, "clipping": p.clipping if p.private else "none",
        "convention": p.convention, "accountant": c.accountant.name if p.private else "none",
        "grad_sample_mode": clipper.mode, "seed": c.seed, "epoch_time_s": round(epoch_time, 3),
        "wall_time_s": round(wall, 3),
    }


def privacy_statement(c: Config, status, stop_reason, ledger, eps, sampler, k, noise, steps, epochs, fp,
                      resumes, runtime=None):
    p = c.privacy
    st = {"status": status, "stop_reason": stop_reason, "private": p.private}
    if not p.private:
        st["statement"] = ("NOT PRIVATE: no clipping, no noise, exact PCA; no privacy guarantee, "
                           "nothing accounted")
    else:
        st["mechanism"] = (
            f"DP-SGD (Abadi et al. 2016, Algorithm 1): each example's gradient clipped to C={p.clip_norm} "
            f"({p.clipping}: k={k} group(s)), Gaussian noise N(0, σ²C²) with σ={p.sigma} added to each "
            f"group's sum, divided by the expected lot size L={p.lot_size}"
            + (f"; DP-PCA (§4) to {c.model.pca_dims} dims: one Gaussian release of the sum of x xᵀ over "
               f"unit-norm images (sensitivity 1), σ_p={p.sigma_p}, sampling rate {p.pca_fraction}"
               if c.model.projection == "pca" else ""))
        st["statement"] = (f"({eps['epsilon']:.6g}, {p.delta:g})-differential privacy for the released "
                           f"model, {c.accountant.name} accountant, {p.convention} convention")
    st["sampling"] = {
        "name": sampler.name, "N": sampler.N, "L": sampler.L, "q": sampler.q,
        "lots_per_epoch": sampler.lots_per_epoch(), "adjacency": sampler.adjacency,
        "amplification_by_sampling": sampler.amplification,
        "charged": ("one subsampled Gaussian mechanism (q = L/N, noise multiplier σ) per lot"
                    if sampler.name == "poisson" else
                    "shuffle uses substitution adjacency without amplification: one Gaussian mechanism "
                    "per epoch, q = 1, sensitivity 2C, noise multiplier σ/2 (each example is in exactly "
                    "one lot per epoch); the Poisson analysis does not cover this sampler"),
    }
    st["convention"] = {
        "configured": p.convention, "groups": k,
        "joint": "k separately clipped groups on one lot = one Gaussian mechanism with multiplier σ/√k (correct)",
        "per_tensor": "k mechanisms at σ per lot: the paper's original code; under-states ε",
    }
    st["accountant"] = c.accountant.name
    st["conversion"] = CONVERSIONS
    st["epsilon"] = eps["epsilon"]
    st["epsilon_by_accountant"] = {a: {conv: v[0] for conv, v in d.items()} for a, d in eps["by"].items()}
    st["lambda_star"] = eps["lambda_star"]
    st["delta"] = p.delta
    st["target_epsilon"] = p.target_epsilon
    st["steps"], st["epochs"] = steps, epochs
    st["noise"] = {"source": noise.name, "seed": noise.seed}
    st["runtime"] = runtime
    st["ledger"] = ledger.to_dict() if ledger is not None else None
    st["config_fingerprint"], st["config_hash"] = fp, fingerprint_hash(fp)
    st["resumes"] = resumes
    return st


def progress_line(row: dict, c: Config) -> None:
    def pct(v):
        return "   -  " if v != v else f"{100 * v:6.2f}%"
    eps = (f"ε={row['epsilon']:.4g} ({c.accountant.name}, {c.privacy.convention}; joint pld "
           f"{row['epsilon_pld_joint']:.4g})" if c.privacy.private else "NOT PRIVATE")
    print(f"epoch {row['epoch']:4d} | steps {row['steps']:6d} | lr {row['lr']:.4f} | loss {row['lot_loss']:.4f} "
          f"| train {pct(row['train_accuracy'])} | test {pct(row['test_accuracy'])} | {eps} "
          f"| {row['epoch_time_s']:.1f}s", flush=True)
