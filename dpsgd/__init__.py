"""dpsgd: DP-SGD (Abadi et al. 2016, "Deep Learning with Differential Privacy") with its accounting.

The public API (docs/API.md), imported on first use, so that ``import dpsgd`` stays light:

    make_private       DP-SGD in your own loop: any optimizer, Dataset, loss and precision; every
                       lot it draws charged (dpsgd.workbench.engine)
    PrivateTrainer     DP-SGD on any nn.Module and dataset, every lot charged (dpsgd.workbench)
    Ledger             every release of a run, composed into ε by any accountant (dpsgd.accountant)
    epsilon            ε of a Poisson schedule (q, σ, steps, δ)
    sigma_for_epsilon  the smallest σ that keeps a schedule within a target ε
    trainable          what fine-tuning trains: "bias" (BiTFiT), "head", "lora", ... (dpsgd.models)
    add_lora           LoRA adapters on a model's Linear layers, through peft (dpsgd.models)
"""

from __future__ import annotations

import importlib
import os
import sys

# OpenMP threads that wait for work sleep instead of spinning: set before torch loads its OpenMP
# runtime (which reads it once), unless the user chose. Two spinning threads on two cores beside
# one busy process ran 5× slower than one thread; sleeping ones do not (docs/PERFORMANCE.md,
# "Threads"). dpsgd.core.runtime's thread policy uses two threads on two cores only when this took.
PASSIVE_WAIT = "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ
if PASSIVE_WAIT:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
PASSIVE_WAIT = PASSIVE_WAIT or (
    "torch" not in sys.modules and os.environ["OMP_WAIT_POLICY"].strip().upper() == "PASSIVE"
)

__version__ = "0.1.0"

_PUBLIC = {
    "make_private": "dpsgd.workbench.engine",
    "PrivateEngine": "dpsgd.workbench.engine",
    "PrivateTrainer": "dpsgd.workbench.trainer",
    "Ledger": "dpsgd.accountant",
    "epsilon": "dpsgd.accountant.calibrate",
    "sigma_for_epsilon": "dpsgd.accountant.calibrate",
    "trainable": "dpsgd.models.trainable",
    "add_lora": "dpsgd.models.trainable",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'dpsgd' has no attribute {name!r}")
