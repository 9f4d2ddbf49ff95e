"""What a resume may change: the table of allowed keys (``RESUME_ALLOWED``) and what changing each
costs, and the configuration's fingerprint (every other key, compared on resume: default deny).

docs/RUNS.md walks the table; dpsgd/run/checkpoint.py:check_resumable refuses a resume whose
fingerprint differs, naming the first key; dpsgd/run/guard.py charges, on every resume, the lots
that may have run after the checkpoint, whatever changed.
"""

from __future__ import annotations

from dpsgd.config.schema import Config

# Keys that may differ on a resume, and what changing one costs. Every other key of the validated
# Config is compared (default deny: a new option is compared without being listed anywhere).
#   free:   changes nothing a lot computes or releases; costs nothing
#   length: how far the run goes; each lot that runs is charged as it runs
#   replay: changes what the lots after the checkpoint compute (other weights, other floating-point
#           sums) but not what one lot costs. Costs nothing more: every resume charges the lots that
#           may have run after the checkpoint as lost whatever it changes (dpsgd/run/guard.py)
FREE, LENGTH, REPLAY = "free", "length", "replay"
RESUME_ALLOWED: dict[str, tuple[str, str]] = {
    "resume": (FREE, "names the run being resumed"),
    "name": (FREE, "a folder name; nothing is computed from it"),
    "dataset.root": (FREE, "where the md5-verified archives are read from: the same data"),
    "dataset.download": (
        FREE,
        "whether a missing archive may be fetched: the same md5-verified data",
    ),
    "model.pretrained": (
        FREE,
        "the artifact's path; its content is compared (model.pretrained_sha256)",
    ),
    "training.eval_every": (FREE, "which epochs are evaluated; evaluation changes no lot"),
    "training.eval_batch_size": (FREE, "how evaluation is batched; evaluation changes no lot"),
    "training.checkpoint_every": (FREE, "when checkpoints are written; changes no lot"),
    "training.train_metrics": (
        FREE,
        "whether the (uncovered) training-set metrics are computed; changes no lot",
    ),
    "logger.name": (FREE, "where the metrics rows are also sent; changes no lot"),
    "logger.project": (FREE, "the wandb project the rows are sent to; changes no lot"),
    "training.epochs": (LENGTH, "the run's length; each lot that runs is charged as it runs"),
    "training.max_steps": (LENGTH, "the run's length; each lot that runs is charged as it runs"),
    "training.lr": (
        REPLAY,
        "post-processing of the noisy gradients (no cost per lot), but other weights",
    ),
    "training.lr_end": (
        REPLAY,
        "post-processing of the noisy gradients (no cost per lot), but other weights",
    ),
    "training.lr_saturate_epochs": (REPLAY, "post-processing (no cost per lot), but other weights"),
    "training.momentum": (
        REPLAY,
        "post-processing of the noisy gradients (no cost per lot), but other weights",
    ),
    "device": (REPLAY, "the same mechanism, but sums that are not bit-identical"),
    "tf32": (REPLAY, "the same mechanism, but sums that are not bit-identical"),
    "privacy.physical_batch_size": (
        REPLAY,
        "the same mechanism, but sums that are not bit-identical",
    ),
    "privacy.grad_sample_mode": (REPLAY, "the same mechanism, but sums that are not bit-identical"),
}


def config_leaves(c: Config) -> dict:
    """Every leaf of the validated ``Config`` as ``group.key`` (or ``key``) → value, in schema
    order."""
    out = {}
    for k, v in c.to_dict().items():
        if isinstance(v, dict):
            out.update(
                {f"{k}.{kk}": list(vv) if isinstance(vv, tuple) else vv for kk, vv in v.items()}
            )
        else:
            out[k] = v
    return out


def config_fingerprint(c: Config) -> dict:
    """The values a resumed run must share with the original (refused otherwise, naming the key):
    every key of the configuration except those in ``RESUME_ALLOWED`` (default deny), and
    ``q`` = L/N."""
    fp = {k: v for k, v in config_leaves(c).items() if k not in RESUME_ALLOWED}
    fp["q"] = c.privacy.lot_size / c.N
    return fp
