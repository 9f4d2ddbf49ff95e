"""What a run reports: ε under every accountant, one metrics.csv row per epoch, the privacy
statement (privacy.json), the console progress line and the final console line.

The statement names the mechanism, the sampling actually run and how it was charged, the accountant
and the (ε, δ) conversion used, the per-layer convention, the noise source and where the run ran
(every result records the sampling, the accountant and the conversion it was charged with).

It leads with the VALID guarantee: the smallest ε among the accountants whose ε is an upper bound
on the privacy loss of the mechanism actually run — moments (Abadi et al. 2016, Thm 2 tail bound),
RDP (Mironov et al. 2019, Balle et al. 2020 conversion) and PLD (pessimistic discretisation) —
all under the JOINT convention (k separately clipped groups of one lot = one Gaussian mechanism
at σ/√k). The min of valid upper bounds is itself a valid upper bound. The configured accountant
and convention (``epsilon``, which the budget stop uses) is shown beside it, labelled; under the
paper's per_tensor convention it under-states ε and is kept only to reproduce the paper's numbers.
Every ε printed in a statement is rounded UP (4 significant digits), so no printed claim is below
what was spent; privacy.json keeps the exact floats.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, Decimal
from pathlib import Path

from dpsgd.accountant import ACCOUNTANTS, CONVENTIONS
from dpsgd.config.fingerprint import config_fingerprint
from dpsgd.config.schema import Config
from dpsgd.run.checkpoint import METRICS, PRIVACY, fingerprint_hash

COLUMNS = [
    "epoch",
    "steps",
    "lr",
    "lot_loss",
    "train_loss",
    "train_accuracy",
    "test_accuracy",
    "epsilon",
    "epsilon_moments",
    "epsilon_rdp",
    "epsilon_pld",
    "epsilon_moments_joint",
    "epsilon_rdp_joint",
    "epsilon_pld_joint",
    "lambda_star",
    "delta",
    "sigma",
    "sigma_p",
    "q",
    "C",
    "L",
    "groups",
    "sampling",
    "clipping",
    "convention",
    "accountant",
    "grad_sample_mode",
    "seed",
    "epoch_time_s",
    "wall_time_s",
    "epsilon_valid",
]
TRAIN_METRICS = ("lot_loss", "train_loss", "train_accuracy")  # on private training data, no noise
TIMINGS = ("epoch_time_s", "wall_time_s")
VALID_ACCOUNTANTS = ACCOUNTANTS  # each gives an upper bound on ε (joint convention)
VALID_CONVENTION = "joint"
STATUSES = ("running", "complete", "interrupted", "diverged")
STOP_REASONS = (
    "epochs_completed",
    "max_steps",
    "target_epsilon_reached",
    "interrupted",
    "diverged",
)
CONVERSIONS = {
    "moments": "moments accountant: log moments α(λ) at integer λ = 1..32, tail bound "
    "ε = min_λ (α(λ) + log(1/δ)) / λ (Abadi et al. 2016, Thm 2)",
    "rdp": "Rényi DP of the subsampled Gaussian (Mironov et al. 2019) with the improved RDP→(ε,δ) "
    "conversion (Balle et al. 2020)",
    "pld": "privacy loss distribution, FFT composition, pessimistic discretisation (tight)",
}


def epsilons(ledger, c: Config) -> dict:
    """ε under every accountant × {configured convention, joint, per_tensor}, λ* of the moments
    accountant, and the valid ε (min over VALID_ACCOUNTANTS under the joint convention).

    An accountant that refuses a ledger (raises ValueError) or gives no finite ε is recorded as
    (None, None) with its reason under ``refused[accountant][convention]`` and skipped for the valid
    ε; it never stops the run. ``epsilon`` (configured accountant and convention) is None when that
    one refused. A non-private run has ε = inf here (metrics.csv writes ``inf``); privacy.json
    writes ``null`` beside ``"private": false`` and the words of its statement (strict JSON).
    """
    p = c.privacy
    if not p.private:
        return {
            "epsilon": math.inf,
            "by": {},
            "lambda_star": None,
            "refused": {},
            "epsilon_valid": math.inf,
            "valid_accountant": None,
        }
    by, refused = {}, {}
    for acc in ACCOUNTANTS:
        by[acc] = {}
        for conv in dict.fromkeys([p.convention, VALID_CONVENTION, *CONVENTIONS]):
            try:
                by[acc][conv] = ledger.epsilon(p.delta, accountant=acc, convention=conv)
                if not math.isfinite(by[acc][conv][0]):
                    raise ValueError(f"no finite ε at δ={p.delta:g} (ε = {by[acc][conv][0]})")
            except ValueError as e:
                by[acc][conv] = (None, None)
                refused.setdefault(acc, {})[conv] = " ".join(str(e).split()) or type(e).__name__
    valid = [
        (by[a][VALID_CONVENTION][0], a)
        for a in VALID_ACCOUNTANTS
        if by[a][VALID_CONVENTION][0] is not None
    ]
    eps_valid, acc_valid = min(valid, key=lambda v: v[0]) if valid else (None, None)
    return {
        "epsilon": by[c.accountant.name][p.convention][0],
        "by": by,
        "lambda_star": by["moments"][p.convention][1],
        "refused": refused,
        "epsilon_valid": eps_valid,
        "valid_accountant": acc_valid,
    }


def eps_up(x) -> str:
    """ε rounded UP to 4 significant digits (exact decimal of the float), so a printed claim is
    never below the computed one: 1.58269… → '1.583', 1.99998… → '2.000'; None → 'n/a'."""
    if x is None or x != x:
        return "n/a"
    if math.isinf(x) or x == 0:
        return "∞" if x > 0 else "0"
    d = Decimal(x)
    quantum = Decimal(1).scaleb(d.adjusted() - 3)
    return format(d.quantize(quantum, rounding=ROUND_CEILING), "f")


def _nan(x):
    return math.nan if x is None else x


def _none(x):
    return None if x is None or x != x else x


def metrics_row(
    c: Config, run, lr: float, lot_loss: float, ev, epoch_time: float, wall: float
) -> dict:
    """One metrics.csv row after an epoch of ``run`` (a ``dpsgd.run.state.Run``: its progress's
    epoch, steps and eps, its parts' sampler, clipper and k); ``ev`` = (train loss, train accuracy,
    test accuracy)."""
    p, at, b = c.privacy, run.progress, run.parts
    eps, sampler = at.eps, b.sampler
    by = eps["by"]
    e = lambda a, conv: _nan(by[a][conv][0]) if by else math.inf  # noqa: E731
    return {
        "epoch": at.epoch,
        "steps": at.steps,
        "lr": lr,
        "lot_loss": lot_loss,
        "train_loss": ev[0],
        "train_accuracy": ev[1],
        "test_accuracy": ev[2],
        "epsilon": _nan(eps["epsilon"]),
        "epsilon_moments": e("moments", p.convention),
        "epsilon_rdp": e("rdp", p.convention),
        "epsilon_pld": e("pld", p.convention),
        "epsilon_moments_joint": e("moments", "joint"),
        "epsilon_rdp_joint": e("rdp", "joint"),
        "epsilon_pld_joint": e("pld", "joint"),
        "lambda_star": eps["lambda_star"],
        "delta": p.delta,
        "sigma": b.plan.sigma,
        "sigma_p": p.sigma_p if p.private else 0.0,
        "q": sampler.q,
        "C": b.plan.clip_norm if p.private else math.inf,
        "L": b.plan.lot_size,
        "groups": b.k,
        "sampling": sampler.name,
        "clipping": p.clipping if p.private else "none",
        "convention": p.convention,
        "accountant": c.accountant.name if p.private else "none",
        "grad_sample_mode": b.dp.engine,
        "seed": c.seed,
        "epoch_time_s": round(epoch_time, 3),
        "wall_time_s": round(wall, 3),
        "epsilon_valid": _nan(eps["epsilon_valid"]),
        **_audit_column(run),
    }


def _audit_column(run) -> dict:
    """An audit run's metrics rows carry its label (column ``audit``; absent in every other run)."""
    inst = getattr(run, "instrument", None)
    return {} if inst is None else {"audit": inst.label.get("summary", "audit")}


def valid_claim(eps, delta) -> str | None:
    """'(1.583, 1e-05)-DP, pld accountant, joint convention' — the valid guarantee; None if none."""
    if eps["epsilon_valid"] is None:
        return None
    return (
        f"({eps_up(eps['epsilon_valid'])}, {delta:g})-DP, {eps['valid_accountant']} accountant, "
        f"{VALID_CONVENTION} convention"
    )


def configured_label(c: Config, eps) -> str | None:
    """The configured accountant/convention's ε, labelled; None when it is the valid one itself."""
    acc, conv = c.accountant.name, c.privacy.convention
    if acc == eps["valid_accountant"] and conv == VALID_CONVENTION:
        return None
    v = eps_up(eps["epsilon"])
    if eps["epsilon"] is None:
        v += f" (refused: {eps['refused'][acc][conv]})"
    if conv == "per_tensor":
        return (
            f"paper's accounting ({acc}, per-tensor): ε = {v} — under-states ε, reproduces the "
            "paper's numbers"
        )
    return f"configured accounting ({acc}, {conv}): ε = {v} — a valid but looser bound"


def statement_text(c: Config, status: str, eps, steps: int) -> str:
    """The one-line privacy statement: the valid guarantee first, the configured value beside it.

    complete → a claim for the released model; running / interrupted → for the model after ``steps``
    lots; diverged → no claim for a model (it is not released), only the privacy spent so far."""
    p = c.privacy
    if not p.private:
        return (
            "NOT PRIVATE: no clipping, no noise, exact PCA; no privacy guarantee, nothing accounted"
        )
    claim = valid_claim(eps, p.delta)
    if claim is None:
        why = "; ".join(
            f"{a}: {r[VALID_CONVENTION]}"
            for a, r in eps["refused"].items()
            if VALID_CONVENTION in r
        )
        claim = f"no valid (ε, δ) bound: every accountant refused this run's ledger ({why})"
    if status == "diverged":
        text = (
            f"DIVERGED after {steps} lots (non-finite loss or parameter): the model is not "
            "released and no privacy claim is made for it; privacy spent on the training data so "
            f"far: {claim}"
        )
    elif valid_claim(eps, p.delta) is None:
        text = f"NO PRIVACY CLAIM: {claim}"
    elif status == "complete":
        text = f"{claim}, for the released model"
    else:
        text = f"{claim}, for the model after {steps} lots (run {status})"
    label = configured_label(c, eps)
    return text if label is None else f"{text}; {label}"


CHARGED = {  # what each sampler's release() records (dpsgd/mechanism/sampling.py)
    "poisson": "one Poisson-subsampled Gaussian mechanism (q = L/N, noise multiplier σ) per lot, "
    "add/remove",
    "fixed_size": (
        "one Gaussian on L examples sampled without replacement per lot, replace-one (γ = L/N, "
        "sensitivity 2C): PLD of the symmetric dominating pair (Dong, Roth & Su 2022 Thm 9; valid "
        "under composition) or RDP of Wang, Balle & Kasiviswanathan 2019 Thm 9; the PLD and RDP "
        "accountants"
    ),
    "truncated_poisson": (
        "one truncated Poisson-subsampled Gaussian per lot (lots capped at max_lot_size B, padded "
        "with zero-weight rows), add/remove, PLD of Ganesh et al. 2025; the PLD accountant only"
    ),
    "balls_in_bins": (
        "one epoch of random allocation over t = N/L lots per epoch (each example in one lot, "
        "uniformly at random), add/remove, RDP of the pair (1/t) Σ_j N(e_j, σ²I) vs N(0, σ²I) "
        "(Feldman & Shenfeld 2025; Chua et al. 2025): remove and add directions exact (add by "
        "one-dimensional quadrature with a stated margin, AM–GM where unresolved); the RDP "
        "accountant only"
    ),
    "shuffle": (
        "shuffle uses substitution adjacency without amplification: one Gaussian mechanism "
        "per epoch, q = 1, sensitivity 2C, noise multiplier σ/2 (each example is in exactly "
        "one lot per epoch); the Poisson analysis does not cover this sampler"
    ),
    "cyclic_poisson": (
        "one Poisson-subsampled Gaussian (q = b·L/N within the lot's part, noise multiplier σ) per "
        "cycle of b lots, add/remove: cyclic Poisson sampling of a b-banded strategy with column "
        "norms <= 1 (Choquette-Choo et al. 2023, arXiv 2306.08153, Thm 4; jax_privacy's "
        "amplified_bandmf_event): n lots cost ceil(n/b) charges; the PLD, RDP and moments "
        "accountants"
    ),
    "cyclic": (
        "one Gaussian mechanism (q = 1, noise multiplier σ) per epoch of t = N/L lots, add/remove: "
        "each example in one fixed part, visited once per epoch (b-min-separation), the strategy "
        "normalised to sensitivity <= 1 per participation (BandMF: its column norm; BLT: Δ_∞, "
        "which bounds what any participation adds), composed over epochs; no amplification by "
        "sampling"
    ),
}


def _shuffle_lower(ledger, plan, p) -> dict:
    """The lower end of the shuffle bracket (Chua et al. 2024): no valid ε of this run is below
    it."""
    from dpsgd.accountant.privacy_loss import shuffle_lower

    epochs = sum(e.count for e in ledger.entries if e.label in ("sgd", "lost"))
    try:
        low = (
            shuffle_lower.epsilon_lower(plan.sigma, plan.sampler.lots_per_epoch(), epochs, p.delta)
            if epochs
            else 0.0
        )
    except ValueError as e:
        return {"epsilon_lower": None, "epsilon_lower_refused": str(e)}
    return {
        "epsilon_lower": low,
        "epsilon_lower_source": (
            "Chua et al. 2024 (ICML, arXiv 2403.17673) lower bound for shuffled lots "
            "(max-statistic slices, replace-one): the ε above (upper) is never below it"
        ),
    }


def privacy_statement(c: Config, run, status: str, stop_reason: str | None) -> dict:
    """privacy.json of ``run`` (a ``dpsgd.run.state.Run``: its progress's ledger, eps, steps, epoch
    and resumes, its parts' sampler, k, noise and runtime) with the given status and stop reason:
    the claim, the mechanism and its sampling, ε under every accountant, and where it ran."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {list(STATUSES)}, got status={status!r}")
    if stop_reason is not None and stop_reason not in STOP_REASONS:
        raise ValueError(
            f"stop_reason must be None or one of {list(STOP_REASONS)}, got "
            f"stop_reason={stop_reason!r}"
        )
    at, p = run.progress, c.privacy
    st = {
        "status": status,
        "stop_reason": stop_reason,
        "private": p.private,
        "statement": statement_text(c, status, at.eps, at.steps),
    }
    inst = getattr(run, "instrument", None)
    if inst is not None:  # labelled: the data held the audit's canaries (the claim counts them)
        st["statement"] = f"AUDIT RUN ({inst.label.get('summary', 'audit')}): {st['statement']}"
        st["audit_run"] = inst.label
    if p.private:
        st["mechanism"] = _mechanism(c, run.parts.plan, run.parts.k)
        if run.parts.plan.strategy is not None:  # privacy.noise=bandmf|blt
            st["correlated_noise"] = correlated_noise(run.parts.plan, run.parts.model)
    st["sampling"] = _sampling(run.parts.plan, p, at.ledger)
    st["convention"] = {
        "configured": p.convention,
        "groups": run.parts.k,
        "joint": "k separately clipped groups on one lot = one Gaussian mechanism with multiplier "
        "σ/√k (correct)",
        "per_tensor": "k mechanisms at σ per lot: the paper's original code; under-states ε",
    }
    st["k"] = run.parts.k
    st.update(parameters(c, run))
    st.update(_epsilons(c, at))
    if p.private and status != "running":  # the final word: what an attacker can do with it
        st["risk"] = _risk(at.ledger, st.get("epsilon_valid_accountant"))
    st.update(_provenance(c, run))
    st["not_covered"] = not_covered(c, run)
    return st


def _mechanism(c: Config, plan, k: int) -> str:
    """The mechanism in words (σ, C and L from the run's plan): clipping, noise, division by L,
    DP-PCA and augmentation multiplicity."""
    p = c.privacy
    s = plan.strategy
    noise = (
        f"Gaussian noise N(0, σ²C²) with σ={plan.sigma} added to each group's sum"
        if s is None or s.independent
        else f"correlated Gaussian noise (privacy.noise={s.kind}): row t of {s.scale:.6g}·C⁻¹Z "
        f"added to each group's sum at lot t, Z i.i.d. N(0, σ²C²) with σ={plan.sigma}, C the "
        "strategy matrix of correlated_noise"
    )
    return (
        "DP-SGD (Abadi et al. 2016, Algorithm 1): each example's gradient clipped to "
        f"C={plan.clip_norm} ({p.clipping}: k={k} group(s)), {noise}, divided by the expected lot "
        f"size L={plan.lot_size}"
        + (
            f"; DP-PCA (§4) to {c.model.pca_dims} dims: one Gaussian release of the sum of x xᵀ "
            f"over unit-norm images (sensitivity 1), σ_p={p.sigma_p}, sampling rate "
            f"{p.pca_fraction}"
            if c.model.projection == "pca"
            else ""
        )
        + (
            f"; augmentation multiplicity K={p.augment_multiplicity} (De et al. 2022): the "
            "gradients of an example's K augmented copies are averaged before clipping, so its "
            "contribution still has norm ≤ C and the sensitivity is unchanged"
            if p.augment_multiplicity > 1
            else ""
        )
    )


def correlated_noise(plan, model=None) -> dict:
    """The correlated noise of a plan with a strategy (privacy.noise=bandmf|blt): the strategy, what
    it was optimised for, the noise it adds per step and what its charge rests on."""
    from dpsgd.mechanism.correlated import strategy as strategies

    s = plan.strategy
    per_step = strategies.noise_multiplier_per_step(s)
    if s.kind == "bandmf":
        how = (
            f"banded Toeplitz C with b={s.bands} coefficients, ‖c‖₂ = 1 (column norms <= 1), "
            f"minimising the mean squared error of the {_workload(s)} over n={s.horizon} lots "
            "(L-BFGS, exact gradient; start: the truncated (1 − x)^(−1/2) of Fichtenberger et al. "
            "2023)"
        )
    else:
        how = (
            f"buffered linear Toeplitz C (c_0 = 1, c_k = Σ_j ω_j θ_j^(k−1), {s.buffers} buffers) "
            f"minimising Δ_∞²·(mean squared error of the {_workload(s)}) over n={s.horizon} lots, "
            f"Δ_∞ = {s.scale:.8g} its per-participation sensitivity at separation {s.min_sep} "
            "(closed form): the noise is scaled by Δ_∞"
        )
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad) if model else None
    return {
        "noise": s.kind,
        "bands": s.bands,
        "independent": s.independent,
        "strategy": s.to_dict(),
        "optimised": how,
        "noise_multiplier_per_step": per_step,
        "noise_std_per_step": per_step * plan.sigma * plan.clip_norm,
        "expected_error_ratio": strategies.expected_error_ratio(s),
        "expected_error_ratio_meaning": (
            f"√(‖A·scale·C⁻¹‖_F² / ‖A‖_F²) over n={s.horizon} lots, A the {_workload(s)}: the "
            "noise the iterates carry relative to independent noise at the same σ"
        ),
        "buffers": s.buffers,
        "buffer_floats": None if n_params is None else s.buffers * n_params,
        "participation": plan.sampler.name,
    }


def correlated_line(plan) -> str:
    """The opening console line of a correlated-noise run: the noise, its strategy and the
    participation schema its charge needs."""
    s, sampler = plan.strategy, plan.sampler
    what = (
        f"BandMF, b={s.bands} bands" if s.kind == "bandmf" else f"BLT, {s.buffers} buffer(s)"
    ) + (" (b = 1: Algorithm 1's independent noise)" if s.independent else "")
    if sampler.name == "cyclic_poisson":
        schema = (
            f"cyclic Poisson over {sampler.cycle} fixed parts (lot t from part t mod "
            f"{sampler.cycle} at q={sampler.q:.4g}), charged ceil(n/{sampler.cycle}) Poisson-"
            "subsampled Gaussians (Choquette-Choo et al. 2023, Thm 4)"
        )
    else:
        schema = (
            f"cyclic, {sampler.cycle} fixed parts each visited once per epoch (b-min-separation, "
            "no amplification), one Gaussian charged per epoch"
        )
    return (
        f"noise: {what}, optimised for {s.horizon} lots ({_workload(s)}; noise std per step "
        f"{noise_multiplier(s):.4g}·σC, expected error ×{expected_ratio(s):.4g} of independent "
        f"noise); participation: {schema} (privacy.sampling={sampler.name})"
    )


def noise_multiplier(s) -> float:
    from dpsgd.mechanism.correlated.strategy import noise_multiplier_per_step

    return noise_multiplier_per_step(s)


def expected_ratio(s) -> float:
    from dpsgd.mechanism.correlated.strategy import expected_error_ratio

    return expected_error_ratio(s)


def _workload(s) -> str:
    return "prefix sums (SGD)" if s.momentum == 0 else f"heavy-ball momentum μ={s.momentum:g}"


def _sampling(plan, p, ledger) -> dict:
    """How the lots were drawn, what that is charged as, and (shuffle) the lower end of its
    bracket."""
    sampler = plan.sampler
    out = {
        "name": sampler.name,
        "N": sampler.N,
        "L": sampler.L,
        "q": sampler.q,
        "lots_per_epoch": sampler.lots_per_epoch(),
        "adjacency": sampler.adjacency,
        "neighbouring_relation": sampler.relation,
        "accountants": list(sampler.accountants),
        "max_lot_size": getattr(sampler, "B", None),
        "amplification_by_sampling": sampler.amplification,
        "charged": CHARGED[sampler.name],
    }
    if p.private and sampler.name == "shuffle" and ledger is not None:
        out.update(_shuffle_lower(ledger, plan, p))
    return out


def _epsilons(c: Config, at) -> dict:
    """The accountant, the conversion, ε (valid and configured) under every accountant, and the
    ledger's position."""
    p, eps = c.privacy, at.eps
    return {
        "accountant": c.accountant.name,
        "conversion": CONVERSIONS,
        "epsilon_valid": _finite(
            eps["epsilon_valid"]
        ),  # null when not private (unbounded) or none valid
        "epsilon_valid_accountant": eps["valid_accountant"],
        "epsilon_valid_convention": VALID_CONVENTION if p.private else None,
        "epsilon": _finite(eps["epsilon"]),
        "epsilon_by_accountant": {
            a: {conv: _finite(v[0]) for conv, v in d.items()} for a, d in eps["by"].items()
        },
        "epsilon_refused": eps["refused"],
        "lambda_star": eps["lambda_star"],
        "delta": p.delta,
        "target_epsilon": p.target_epsilon,
        "steps": at.steps,
        "epochs": at.epoch,
    }


def _provenance(c: Config, run) -> dict:
    """Where and how it ran: noise source, runtime, processes, ledger, configuration, resumes,
    weights."""
    b, at, fp = run.parts, run.progress, config_fingerprint(c)
    dist = getattr(
        run, "dist", None
    )  # torchrun: processes and the backend of the gradient all-reduce
    ema = c.training.ema_decay
    return {
        "noise": {"source": b.noise.name, "seed": b.noise.seed},
        "runtime": b.runtime,
        "distributed": (
            dist.describe(b.device)
            if dist is not None and dist.active
            else {"world_size": 1, "backend": None}
        ),
        "ledger": at.ledger.to_dict() if at.ledger is not None else None,
        "config_fingerprint": fp,
        "config_hash": fingerprint_hash(fp),
        "resumes": at.resumes,
        "weights": {  # which weights the accuracies in metrics.csv and the released model are
            "evaluated": "ema" if ema else "final",
            "ema_decay": ema,
            "released": (
                "checkpoint.pt: ema (the EMA of the iterates, post-processing: no privacy cost)"
                if ema
                else "checkpoint.pt: model"
            ),
        },
    }


def _finite(x):
    """A float for strict JSON: None (null) where it is NaN or ±inf (the words beside it say
    why)."""
    return None if x is None or not math.isfinite(x) else x


def _in_rows(run, columns) -> bool:
    """Whether any metrics row of ``run`` holds a number in one of ``columns``."""
    rows = getattr(getattr(run, "writer", None), "rows", None) or []
    return any(
        isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) for r in rows for k in columns
    )


def not_covered(c: Config, run) -> list[dict]:
    """What the run writes that its (ε, δ) statement does not cover, each with the file, the columns
    and why (docs/PRIVACY_STATEMENT.md): the training-set metrics (computed on the private training
    data without noise, as in the paper's Figure 3; left out with ``training.train_metrics=false``),
    the timings, and the accuracy on a validation split of the training data."""
    if not c.privacy.private:
        return [
            {
                "what": "everything this run writes",
                "file": None,
                "columns": None,
                "computed": True,
                "why": "not private: no clipping, no noise, exact PCA; there is no (ε, δ) "
                "guarantee",
            }
        ]
    where = f"{METRICS} (also the console progress line and checkpoint.pt)"
    computed = c.training.train_metrics or _in_rows(run, TRAIN_METRICS)
    out = [
        {
            "what": "training-set loss and accuracy",
            "file": where,
            "columns": list(TRAIN_METRICS),
            "computed": computed,
            "why": (
                "the mean loss of each epoch's lots and the loss and accuracy of the model on the "
                "whole training set are computed on the private training data without noise (as in "
                "the paper's Figure 3): each value is a function of the training data outside the "
                "(ε, δ) guarantee; training.train_metrics=false writes nan in these columns"
                if computed
                else "not computed (training.train_metrics=false): these columns hold nan"
            ),
        },
        {
            "what": "timings",
            "file": where,
            "columns": list(TIMINGS),
            "computed": True,
            "why": "wall-clock times grow with the number of examples in the lots, which depends "
            "on the training data under add/remove adjacency: a side channel the analysis does not "
            "cover",
        },
    ]
    v = c.dataset.validation
    if v:
        out.append(
            {
                "what": "validation accuracy",
                "file": where,
                "columns": ["test_accuracy"],
                "computed": True,
                "why": f"dataset.validation={v}: test_accuracy is measured without noise on {v} "
                "training examples held out from training; the guarantee covers the examples "
                "trained on, not these, and hyperparameters chosen on them are not accounted",
            }
        )
    return out


def parameters(c: Config, run) -> dict:
    """Which tensors were trained privately (clipped, noised, the k groups) and which are public:
    loaded from a pretrained artifact and frozen, never charged (paper §5.3: convolutions pretrained
    on CIFAR-100, "treated as public")."""
    model = getattr(run.parts, "model", None)
    if model is None:
        return {}
    named = list(model.named_parameters())
    out = {
        "private_parameters" if c.privacy.private else "trained_parameters": [
            n for n, p in named if p.requires_grad
        ]
    }
    if c.privacy.private:  # the k separately clipped groups (per layer: a module's weight and bias)
        out["clipping_groups"] = [list(g) for g in run.parts.clipper.groups]
    m = c.model
    if m.pretrained is not None:
        from dpsgd.models.pretrained import SOURCE, relative

        out["public_parameters"] = {
            "tensors": [n for n, p in named if not p.requires_grad],
            "artifact": relative(m.pretrained),
            "sha256": m.pretrained_sha256,
            "source": SOURCE,
        }
    else:
        out["public_parameters"] = None
    return out


def eta(run, now: float) -> str:
    """`` | epoch k/≈K, eta 1m05s``: the planned end and the time to it at this process's pace."""
    K, done = run.planned_epochs(), run.progress.epoch - run.first_epoch
    if done <= 0:
        return ""
    left = max(0.0, (now - run.progress.t_start) / done * (K - run.progress.epoch))
    m, sec = divmod(int(round(left)), 60)
    h, m = divmod(m, 60)
    text = f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"
    return f" | of ≈{K}, eta {text}"


def progress_line(row: dict, c: Config, tail: str = "") -> None:
    """One console line per epoch; ε leads with the valid bound (joint convention, best
    accountant)."""

    def pct(v):
        return "   -  " if v != v else f"{100 * v:6.2f}%"

    if c.privacy.private:
        v = row["epsilon_valid"]
        acc = next(
            (
                a
                for a in VALID_ACCOUNTANTS
                if _none(v) is not None and row[f"epsilon_{a}_joint"] == v
            ),
            None,
        )
        eps = f"ε≤{eps_up(v)} ({acc}, joint)" if acc is not None else "ε: no valid bound"
        if not (c.accountant.name == acc and c.privacy.convention == VALID_CONVENTION):
            name = "paper's" if c.privacy.convention == "per_tensor" else "configured"
            eps += (
                f"; {name} {c.accountant.name}/{c.privacy.convention} "
                f"{eps_up(_none(row['epsilon']))}"
            )
    else:
        eps = "NOT PRIVATE"
    print(
        f"epoch {row['epoch']:4d} | steps {row['steps']:6d} | lr {row['lr']:.4f} | loss "
        f"{row['lot_loss']:.4f} | train {pct(row['train_accuracy'])} | test "
        f"{pct(row['test_accuracy'])} | {eps} | {row['epoch_time_s']:.1f}s{tail}",
        flush=True,
    )


def _risk(ledger, accountant: str | None) -> dict:
    """A membership attacker's TPR at FPR 0.1/1/10 % (``dpsgd/accountant/risk.py``), from the
    accountant that gave the valid ε (PLD when it served)."""
    from dpsgd.accountant import risk

    try:
        return risk.risk(ledger, accountant or "pld", VALID_CONVENTION)
    except ValueError as e:
        return {"refused": " ".join(str(e).split())}


def final_line(statement: dict, test_accuracy: float, run_dir=None) -> str:
    """The trainer's closing console text: outcome, accuracy and the privacy statement (valid ε
    first), what it does not cover, then where the results are."""
    head = "DIVERGED" if statement["status"] == "diverged" else "done"
    text = (
        f"{head} ({statement['stop_reason']}): {statement['steps']} lots, {statement['epochs']} "
        f"epochs, test accuracy {test_accuracy:.4f}\n{statement['statement']}"
    )
    r = statement.get("risk") or {}
    if "tpr_at_fpr" in r:
        from dpsgd.accountant.risk import summary

        text += f"\nrisk: {summary(r)} (privacy.json risk; {r['accountant']}, f-DP)"
    outside = [e for e in statement.get("not_covered") or [] if e["columns"] and e["computed"]]
    if statement.get("private") and outside:
        cols = "; ".join(f"{', '.join(e['columns'])} ({e['what']})" for e in outside)
        text += f"\nnot covered by ε (privacy.json not_covered): {cols}"
    if run_dir is not None:
        run_dir = Path(run_dir)
        text += (
            f"\nresults: {run_dir / METRICS}"
            f"\n         {run_dir / PRIVACY}"
            f"\n         {run_dir / 'run.log'} (this console)"
            f"\n         {run_dir / '.hydra'}"
        )
    return text
