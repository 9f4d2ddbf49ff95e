"""What Abadi et al. 2016 (arXiv 1607.00133 v2) state, as data: drawn on every figure and tabulated
next to our numbers in results/README.md.

These are the *paper's* numbers, never ours; every number of ours comes from a CSV in results/.
Where a value is read off a plot rather than printed in the text, ``source`` says so.
"""

from __future__ import annotations

import math

MNIST_N = 60_000  # training examples
SQRT_N = math.sqrt(MNIST_N)  # ≈ 245: the paper's rule of thumb for the lot size

# Figure 2 (§3.1): q = 0.01, σ = 4, δ = 1e-5.  (epochs, curve, ε, source)
FIGURE2 = [
    (100, "moments", 1.26, "§3.1 text and Fig. 2"),
    (100, "strong_composition_paper", 9.34, "§3.1 text and Fig. 2"),
    (400, "moments", 2.55, "Fig. 2 (right end of the moments curve)"),
]
FIGURE2_SETTING = {"q": 0.01, "sigma": 4.0, "delta": 1e-5}

# §5.2 / Figure 3: the three noise levels and the non-private baseline (δ = 1e-5 throughout).
# preset -> (σ, σ_p, ε, test accuracy the paper reports)
PRESETS = {
    "mnist_small": {"sigma": 2.0, "sigma_p": 4.0, "epsilon": 8.0, "accuracy": 0.97},
    "mnist_medium": {"sigma": 4.0, "sigma_p": 7.0, "epsilon": 2.0, "accuracy": 0.95},
    "mnist_large": {"sigma": 8.0, "sigma_p": 16.0, "epsilon": 0.5, "accuracy": 0.90},
    "mnist_nonprivate": {"sigma": 0.0, "sigma_p": 0.0, "epsilon": math.inf, "accuracy": 0.983},
}
PRESET_LABEL = {
    "mnist_small": "small noise",
    "mnist_medium": "medium noise",
    "mnist_large": "large noise",
    "mnist_nonprivate": "non-private",
}
DELTA = 1e-5
FIGURE4_DELTAS = (1e-5, 1e-4, 1e-3, 1e-2)

# Figure 5 (§5.2, "Effect of the parameters"): each run from the medium preset to (ε, δ) = (2,
# 1e-5).
FIGURE5_BUDGET = {"epsilon": 2.0, "delta": 1e-5}
FIGURE5_PANELS = {  # panel -> (config key varied, x-axis label, medium-preset value)
    "pca_dims": ("model.pca_dims", "projection dimensions", 60),
    "hidden_units": ("model.hidden", "hidden units", 1000),
    "lot_size": ("privacy.lot_size", "lot size L (examples)", 600),
    "learning_rate": ("training.lr", "learning rate η (constant)", None),
    "clip_norm": ("privacy.clip_norm", "gradient clipping bound C", 4.0),
    "noise": ("privacy.sigma", "noise multiplier σ", 4.0),
}
# The claims Figure 5's text makes, one per line of the README table. ``kind`` tells
# ``experiments.figures`` how to compute our side from figure5.csv.
FIGURE5_CLAIMS = [
    {
        "panel": "pca_dims",
        "kind": "pca_gap",
        "paper": "no PCA ≈ 2 % (absolute) less accurate than 60-d DP-PCA",
        "value": 0.02,
    },
    {
        "panel": "pca_dims",
        "kind": "random_projection",
        "paper": "random projection ≈ 92.5 % test accuracy",
        "value": 0.925,
    },
    {
        "panel": "hidden_units",
        "kind": "hidden_monotone",
        "paper": "more hidden units do not decrease accuracy (qualitative)",
        "value": None,
    },
    {
        "panel": "lot_size",
        "kind": "argmax",
        "paper": f"best lot size ≈ √N ≈ {SQRT_N:.0f}",
        "value": SQRT_N,
    },
    {
        "panel": "learning_rate",
        "kind": "argmax",
        "paper": "accuracy peaks near η = 0.05 (stable for 0.01–0.07)",
        "value": 0.05,
    },
]

# §5.3 / Figure 6: CIFAR-10, the convolutions pretrained on CIFAR-100 (treated as public) and
# frozen, DP-SGD on the fully connected layers, per-layer clipping. Figure 6's caption: "With δ set
# to 1e-5, we achieve accuracy 67%, 70%, and 73%, with ε being 2, 4, and 8, respectively. The first
# graph uses a lot size of 2,000, (2) and (3) use a lot size of 4,000. In all cases, σ is set to 6,
# and clipping is set to 3." The non-private baseline is §5.3's text: "Retraining only the fully
# connected layers with this architecture for about 250 epochs with a batch size of 120 gives us
# approximately 80% accuracy". preset -> what the paper states; ``source`` says where.
CIFAR10_N = 50_000  # training images
CIFAR10_PRESETS = {
    "cifar10_eps2": {
        "epsilon": 2.0,
        "lot_size": 2000,
        "sigma": 6.0,
        "clip_norm": 3.0,
        "accuracy": 0.67,
        "epochs": None,
        "source": "Fig. 6 (1) and caption",
    },
    "cifar10_eps4": {
        "epsilon": 4.0,
        "lot_size": 4000,
        "sigma": 6.0,
        "clip_norm": 3.0,
        "accuracy": 0.70,
        "epochs": None,
        "source": "Fig. 6 (2) and caption",
    },
    "cifar10_eps8": {
        "epsilon": 8.0,
        "lot_size": 4000,
        "sigma": 6.0,
        "clip_norm": 3.0,
        "accuracy": 0.73,
        "epochs": None,
        "source": "Fig. 6 (3) and caption",
    },
    "cifar10_nonprivate": {
        "epsilon": math.inf,
        "lot_size": 120,
        "sigma": 0.0,
        "clip_norm": math.inf,
        "accuracy": 0.80,
        "epochs": 250,
        "source": "§5.3 text (non-private baseline)",
    },
}
