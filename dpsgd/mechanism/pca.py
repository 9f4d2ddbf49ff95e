"""Input projections: DP-PCA (Abadi et al. 2016, §4 "DP-PCA") and random projection.

DP-PCA, as in the paper's code (``dp_pca.py``, ``ComputeDPPrincipalProjection``):

  1. take a sample of the training images (rate ``fraction``, Poisson; default all of them),
  2. normalise each image x_i to unit L2 norm,
  3. A = Σ_i x_i x_iᵀ = XᵀX (d × d),
  4. add a d × d matrix E of i.i.d. N(0, σ_p²) entries and symmetrise: Â = ((A + E) + (A + E)ᵀ) / 2,
  5. V = the top-k eigenvectors of Â (d × k),
  6. project the *raw* (unnormalised) images: x ↦ Vᵀx.

Privacy: adding or removing one normalised x changes A by x xᵀ, whose Frobenius norm is ‖x‖² = 1,
so step 4 is one Gaussian mechanism with sensitivity 1 and noise multiplier σ_p (symmetrising is
post-processing), subsampled at rate ``fraction``: the event ``Gaussian(σ_p, q=fraction)``
(``accountant/events.py``), charged to the same ledger as training by ``charge_pca``, the one place
it is recorded (the run, the config's budget check, the audit's Poisson claim and the experiments'
planning all call it).

A random projection (i.i.d. N(0, 1/k) matrix) does not look at the data and costs nothing.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
import torch

from dpsgd.accountant.events import Gaussian


def dp_pca(
    X: torch.Tensor, k: int, sigma_p: float, generator: torch.Generator, fraction: float = 1.0
) -> torch.Tensor:
    """The d × k DP-PCA projection matrix of the rows of X (float64 internally)."""
    X = X.reshape(len(X), -1)
    n, d = X.shape
    if not 1 <= k <= d:
        raise ValueError(f"model.pca_dims={k}: must be in [1, {d}] (the input dimension)")
    if sigma_p < 0:
        raise ValueError(f"privacy.sigma_p={sigma_p}: must be >= 0")
    if not 0 < fraction <= 1:
        raise ValueError(f"privacy.pca_fraction={fraction}: must be in (0, 1]")
    if (
        fraction < 1
    ):  # Poisson subsample, so that amplification by sampling at rate `fraction` holds
        X = X[torch.rand(n, generator=generator) < fraction]
    Xn = X.to(torch.float64, copy=True)  # one n × d copy, normalised in place
    Xn.div_(
        Xn.norm(dim=1, keepdim=True).clamp_min(1e-12)
    )  # an all-zero image stays zero (norm 0 <= 1)
    # XᵀX as one GEMM. A symmetric rank-k update (BLAS syrk) would halve the flops, but it rounds
    # differently (scipy.linalg.blas.dsyrk vs this GEMM on MNIST: entries up to 5.7e-14 apart, and
    # slower here), and the presets must reproduce their projection bit for bit
    A = Xn.T @ Xn
    if sigma_p > 0:
        E = torch.normal(0.0, float(sigma_p), size=(d, d), generator=generator, dtype=torch.float64)
        A = A + E
    A = 0.5 * (A + A.T)
    # only the top k eigenpairs (LAPACK syevr via scipy); ascending, so reverse
    _, evecs = scipy.linalg.eigh(A.numpy(), subset_by_index=[d - k, d - 1])
    return torch.from_numpy(np.ascontiguousarray(evecs[:, ::-1])).to(X.dtype)


def pca_event(sigma_p: float, fraction: float = 1.0) -> Gaussian:
    """The privacy event of one DP-PCA release: the Gaussian mechanism, sensitivity 1, noise σ_p,
    subsampled at rate ``fraction``."""
    return Gaussian(float(sigma_p), float(fraction))


def charge_pca(ledger, sigma_p: float, fraction: float = 1.0) -> None:
    """Record one DP-PCA release in ``ledger`` (label "pca")."""
    ledger.record(pca_event(sigma_p, fraction), 1, "pca")


def random_projection(d: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """A data-independent d × k Gaussian projection (entries N(0, 1/k)); no privacy cost."""
    if not 1 <= k <= d:
        raise ValueError(f"model.pca_dims={k}: must be in [1, {d}] (the input dimension)")
    return torch.randn(d, k, generator=generator) / k**0.5


def project(X: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Raw images (n × d, or any shape flattening to d) projected to n × k."""
    return X.reshape(len(X), -1) @ V


PROJECTIONS = ("none", "pca", "random")  # model.projection


def fit_projection(
    kind: str,
    X: torch.Tensor,
    k: int,
    sigma_p: float,
    generator: torch.Generator,
    ledger=None,
    fraction: float = 1.0,
) -> torch.Tensor | None:
    """The input projection of the config (``model.projection``); DP-PCA's release is charged to
    ``ledger``.

    Returns None for ``kind == "none"`` or ``k == 0`` (the model sees the raw inputs).
    """
    if kind == "none" or k == 0:
        return None
    if kind == "random":
        return random_projection(X[0].numel(), k, generator)
    if kind == "pca":
        V = dp_pca(X, k, sigma_p, generator, fraction)
        if ledger is not None:
            charge_pca(ledger, sigma_p, fraction)
        return V
    raise ValueError(f"model.projection={kind!r}: must be one of {list(PROJECTIONS)}")
