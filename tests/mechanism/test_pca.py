"""DP-PCA (paper §4): with zero noise it spans the exact PCA subspace; noise is symmetric and
charged."""

import pytest
import torch

from dpsgd.accountant.events import Gaussian
from dpsgd.mechanism.pca import dp_pca, fit_projection, project, random_projection
from tolerances import reduction_rtol


def _data(n=400, d=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a few strong directions so the top-k subspace is well separated
    basis = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    scales = torch.tensor([10.0, 7.0, 5.0, 3.0] + [0.3] * (d - 4), dtype=torch.float64)
    return (torch.randn(n, d, generator=g, dtype=torch.float64) * scales) @ basis.T


def _projector(V):
    V = V.to(torch.float64)
    return V @ torch.linalg.pinv(V)


def test_zero_noise_spans_exact_pca_subspace_of_normalised_data():
    X = _data()
    k = 4
    V = dp_pca(X, k, sigma_p=0.0, generator=torch.Generator().manual_seed(0))
    assert V.shape == (30, k)
    Xn = X / X.norm(dim=1, keepdim=True)
    # independent reference: right singular vectors of the normalised data matrix (SVD, not eigh)
    ref = torch.linalg.svd(Xn, full_matrices=False).Vh[:k].T
    # eigh vs SVD subspaces: projector error ~eps64/gap, the spectral gap here is ~10 (scales 3
    # vs 0.3)
    assert torch.allclose(_projector(V), _projector(ref), atol=1e-8)
    # float64 eigenvectors of a 30×30 matrix, then dot products of 30 terms of norm-1 vectors
    assert torch.allclose(V.T @ V, torch.eye(k, dtype=V.dtype), atol=reduction_rtol(2 * 30))


def test_noise_is_seeded_and_perturbs_the_subspace_a_little():
    X = _data()
    V1 = dp_pca(X, 4, 1.0, torch.Generator().manual_seed(3))
    V2 = dp_pca(X, 4, 1.0, torch.Generator().manual_seed(3))
    V3 = dp_pca(X, 4, 1.0, torch.Generator().manual_seed(4))
    assert torch.equal(V1, V2) and not torch.equal(V1, V3)
    exact = dp_pca(X, 4, 0.0, torch.Generator())
    # 400 unit-norm rows: the signal eigenvalues are ~O(100) ≫ noise ~σ√d, so the subspace is close
    assert (_projector(V1) - _projector(exact)).norm() < 0.5


def test_projects_raw_not_normalised_images():
    X = _data(n=50, d=12).float()
    V = dp_pca(X, 3, 0.0, torch.Generator())
    assert torch.allclose(project(X, V), X @ V)


class _Recorder:
    def __init__(self):
        self.calls = []

    def record(self, *a):
        self.calls.append(a)


def test_pca_release_is_charged_to_the_ledger_and_random_projection_is_free():
    X = _data(n=100, d=20).float()
    led = _Recorder()
    fit_projection("pca", X, 5, 7.0, torch.Generator().manual_seed(0), led, fraction=0.5)
    assert led.calls == [(Gaussian(sigma=7.0, q=0.5, groups=1), 1, "pca")]
    led2 = _Recorder()
    R = fit_projection("random", X, 5, 7.0, torch.Generator().manual_seed(0), led2)
    assert R.shape == (20, 5) and led2.calls == []
    assert fit_projection("none", X, 5, 7.0, torch.Generator(), led2) is None
    assert fit_projection("pca", X, 0, 7.0, torch.Generator(), led2) is None and led2.calls == []


def test_bad_dims_refused():
    with pytest.raises(ValueError, match="model.pca_dims"):
        dp_pca(_data(n=10, d=5), 6, 0.0, torch.Generator())
    with pytest.raises(ValueError, match="model.pca_dims"):
        random_projection(5, 0, torch.Generator())
