"""One run of the fine-tuning experiment (``experiments.finetune``): a variant of the pretrained ViT
fine-tuned privately on MNIST by dpsgd or, on the same lots, by Opacus; returns one row.

Variants (``VARIANTS``), all from the one public pretraining but ``scratch``:

  full     every parameter trained, the head re-initialised for the new task
  lora     LoRA adapters (rank 8, α = 16) on every Linear but the head, and the head
           (``dpsgd.add_lora``, ``dpsgd.trainable(model, "lora+head")``)
  head     the head only (a linear probe on the frozen public features)
  bias     the bias terms and the head (DP-BiTFiT; optional, not in the default grid)
  scratch  the same ViT from a random initialisation, every parameter trained

dpsgd runs ``dpsgd.PrivateTrainer`` (Poisson lots q = L/N, σ calibrated by the PLD accountant so
that the planned epochs spend the target ε, global clipping on the ghost engine, DP-SGD with heavy
ball momentum). Opacus (``engine="opacus"``) runs the same model through its ``GradSampleModule``
(per-sample gradients by hooks) and ``DPOptimizer`` on the very lots dpsgd draws (the same sampler,
seed and σ), with torch's SGD and the same momentum: its ε is the same charge. ``split="val"``
trains on 50 000 training examples and scores the 10 000 held out (hyperparameter choice; the test
set is never seen); ``split="test"`` trains on all 60 000 and scores the test set.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .finetune_model import ViT, accuracy, fresh_head, n_params

VARIANTS = ("full", "lora", "head", "bias", "scratch")
SELECTION = {
    "full": "all",
    "lora": "lora+head",
    "head": "head",
    "bias": "bias+head",
    "scratch": "all",
}
LORA_RANK, LORA_ALPHA = 8, 16.0
VALIDATION = 10_000  # training examples held out for split="val"
DELTA, ACCOUNTANT = 1e-5, "pld"


def load(split: str, subset: int | None = None):
    """(X, y, X_eval, y_eval): MNIST's training set and test set (``test``), or 50 000 training
    examples and the other 10 000 of a fixed random permutation (``val``); ``subset`` keeps the
    first examples of each (tests)."""
    from dpsgd.data.readers import load_dataset

    X, y, Xt, yt = load_dataset("mnist", "data")
    if split == "val":
        perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))
        held, kept = perm[:VALIDATION], perm[VALIDATION:]
        X, y, Xt, yt = X[kept], y[kept], X[held], y[held]
    elif split != "test":
        raise ValueError(f"split={split!r}: val or test")
    if subset:
        X, y, Xt, yt = X[:subset], y[:subset], Xt[: subset // 5], yt[: subset // 5]
    return X, y, Xt, yt


def build(variant: str, seed: int, pretrained: Path | None) -> torch.nn.Module:
    """The variant's model, its trainable parameters chosen (module doc); initial weights from
    ``seed`` where they are new (the head, the adapters, a model from scratch)."""
    import dpsgd

    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: one of {', '.join(VARIANTS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ViT()
        if variant != "scratch":
            model.load_state_dict(torch.load(pretrained, weights_only=True))
            fresh_head(model, seed)
            if variant == "lora":
                dpsgd.add_lora(model, LORA_RANK, LORA_ALPHA)
        dpsgd.trainable(model, SELECTION[variant])
    return model


def run(job: dict, log=print) -> dict:
    """One run (``job``: variant, engine, eps, seed, lr, momentum, clip, lot, epochs, split,
    pretrained, subset); returns its row (the parent adds the process's peak RSS). Timed: the
    epochs alone (``train_seconds``; the set-up, σ calibration and the proof before the first lot
    in ``setup_seconds``); ``train_peak_mb``: the peak RSS while training above the RSS before it
    (data and model loaded)."""
    torch.set_num_threads(1)
    X, y, Xt, yt = load(job["split"], job.get("subset"))
    model = build(job["variant"], job["seed"], job.get("pretrained"))
    base = _reset_peak()
    go = _dpsgd if job["engine"] == "dpsgd" else _opacus
    out = go(model, X, y, job, log)
    peak = _status_mb("VmHWM")
    epochs = out["steps"] * job["lot"] / len(X)
    return {
        **{k: job[k] for k in ("variant", "engine", "eps", "seed", "lr", "momentum", "split")},
        **out,
        "clip_norm": job["clip"],
        "lot_size": job["lot"],
        "N": len(X),
        "q": job["lot"] / len(X),
        "accuracy": accuracy(model, Xt, yt),
        "trainable_params": n_params(model, trainable=True),
        "params": n_params(model),
        "seconds_per_epoch": out["train_seconds"] / max(epochs, 1e-9),
        "train_peak_mb": None if peak is None or base is None else peak - base,
        "versions": _versions(),
    }


def _status_mb(field: str) -> float | None:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in MB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak() -> float | None:
    """Reset the process's peak RSS to its RSS now (Linux: clear_refs 5); returns that RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_mb("VmRSS")


def _dpsgd(model, X, y, job: dict, log) -> dict:
    """DP-SGD through ``dpsgd.PrivateTrainer``; the statement goes to the row's ``privacy``."""
    import dpsgd

    t0 = time.perf_counter()
    tr = dpsgd.PrivateTrainer(
        model,
        (X, y),
        lot_size=job["lot"],
        clip_norm=job["clip"],
        target_epsilon=job["eps"],
        epochs=job["epochs"],
        delta=DELTA,
        accountant=ACCOUNTANT,
        lr=job["lr"],
        momentum=job["momentum"],
        mode="ghost",
        seed=job["seed"],
        threads=False,
    )
    t1 = time.perf_counter()
    for e in range(math.ceil(job["epochs"])):
        stop = tr.train_epoch()
        log(f"epoch {e + 1}: loss {tr.last_loss:.4f}, ε {tr.epsilon:.3f}")
        if stop:
            break
    t2 = time.perf_counter()
    st = tr.statement()
    return {
        "setup_seconds": t1 - t0,
        "train_seconds": t2 - t1,
        "sigma": tr.plan.sigma,
        "steps": tr.steps,
        "epsilon": tr.epsilon,
        "mode": tr.clipper.mode,
        "privacy": st,
    }


def _opacus(model, X, y, job: dict, log) -> dict:
    """The same lots, σ, C, L and momentum through Opacus (hooks per-sample gradients)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    from dpsgd.accountant import Ledger
    from dpsgd.config.calibration import sigma_for_lots
    from dpsgd.mechanism.sampling import make_sampler, record_lots

    t0 = time.perf_counter()
    sampler = make_sampler(
        "poisson", len(X), job["lot"], torch.Generator().manual_seed(job["seed"])
    )
    lots = math.ceil(job["epochs"] * sampler.lots_per_epoch())  # PrivateTrainer's horizon
    sigma = sigma_for_lots(sampler, job["eps"], DELTA, lots, ACCOUNTANT)
    torch.manual_seed(job["seed"] + 1)  # Opacus draws its noise from the global generator
    # loss_reduction="mean" on both: GradSampleModule rescales each row to the example's own
    # gradient and DPOptimizer divides the noisy sum by expected_batch_size, dpsgd's Σ/L ("sum"
    # would step on the noisy sum itself, L times larger)
    gsm = GradSampleModule(model, loss_reduction="mean")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = DPOptimizer(
        torch.optim.SGD(params, lr=job["lr"], momentum=job["momentum"]),
        noise_multiplier=sigma,
        max_grad_norm=job["clip"],
        expected_batch_size=job["lot"],
        loss_reduction="mean",
    )
    steps, t1 = 0, time.perf_counter()
    for e in range(math.ceil(job["epochs"])):
        for idx in sampler.epoch():
            if steps == lots:
                break
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(gsm(X[idx]), y[idx]).backward()
            opt.step()
            steps += 1
        log(f"epoch {e + 1}: {steps} lots")
    t2 = time.perf_counter()
    led = Ledger()
    record_lots(led, sampler, sigma, steps, 0, 1)
    gsm._close()
    return {
        "setup_seconds": t1 - t0,
        "train_seconds": t2 - t1,
        "sigma": sigma,
        "steps": steps,
        "epsilon": float(led.epsilon(DELTA, ACCOUNTANT, "joint")[0]),
        "mode": "opacus-hooks",
    }


def _versions() -> dict:
    import platform

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("peft", "opacus"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out
