"""The streamed correlated noise (dpsgd/mechanism/correlated/noise.py) against a dense C⁻¹Z computed
directly in float64, its resume, and b = 1 = Algorithm 1 in the DP step.

Tolerances (docs/DEVELOPMENT.md, Tolerances): forward substitution with m terms per row has backward
error |ΔC| <= γ_m |C| (Higham 2002, Thm 8.5), so |x̂ − x| <= γ_m |C⁻¹||C||x̂| componentwise, γ_m <=
m·eps; the streamed and the dense solutions are each within it, hence ``2·m·eps·|C⁻¹||C||x|``. The
BLT recursion sums the same products through its d buffers (t multiply-adds deep): m = n + 2d.
"""

import io

import numpy as np
import pytest
import torch
from scipy.linalg import solve_triangular, toeplitz

from dpsgd.mechanism.correlated import strategy as S
from dpsgd.mechanism.correlated import toeplitz as T
from dpsgd.mechanism.clipping import PerExampleClipper
from dpsgd.mechanism.correlated.noise import CorrelatedNoise
from dpsgd.mechanism.noise import GaussianNoise
from dpsgd.mechanism.optim import DPSGD
from dpsgd.mechanism.plan import Plan
from dpsgd.accountant.events import Cyclic, Poisson
from tolerances import EPS32, EPS64

T = 240
SHAPES = {"w": (3, 4), "b": (5,)}
STRATEGIES = [
    ("bandmf", lambda: S.banded(2, T)),
    ("bandmf", lambda: S.banded(6, T, 0.9)),
    ("bandmf", lambda: S.banded(16, T)),
    ("blt", lambda: S.blt(3, T, 12)),
    ("blt", lambda: S.blt(2, T, 40, 0.9)),
]


def _stream(strategy, dtype, seed=3, steps=T, noise=None):
    """The streamed rows [steps, d] (the tensors of SHAPES, flattened) and the z drawn, in order."""
    cn = noise or CorrelatedNoise(GaussianNoise(seed=seed), strategy)
    out = []
    for _ in range(steps):
        g = {k: torch.zeros(s, dtype=dtype) for k, s in SHAPES.items()}
        cn.add_(g, 2.0)
        out.append(np.concatenate([g[k].double().numpy().ravel() for k in SHAPES]))
    return np.array(out), cn


def _draws(dtype, seed=3, steps=T):
    ref = GaussianNoise(seed=seed)
    return np.array(
        [
            np.concatenate(
                [ref.sample(s, 2.0, dtype=dtype).double().numpy().ravel() for s in SHAPES.values()]
            )
            for _ in range(steps)
        ]
    )


def _dense(strategy, Z):
    C = np.tril(toeplitz(strategy.toeplitz(len(Z))))
    X = strategy.scale * solve_triangular(C, Z, lower=True)
    bound = np.abs(np.linalg.inv(C)) @ np.abs(C) @ np.abs(X)
    m = strategy.bands if strategy.kind == "bandmf" else len(Z) + 2 * strategy.buffers
    return X, bound, m


@pytest.mark.parametrize("kind,make", STRATEGIES)
def test_stream_equals_dense_inverse_float64(kind, make):
    s = make()
    assert s.kind == kind
    W, _ = _stream(s, torch.float64)
    X, bound, m = _dense(s, _draws(torch.float64))
    assert np.all(np.abs(W - X) <= 2 * m * EPS64 * bound)


@pytest.mark.parametrize("kind,make", STRATEGIES[::2])
def test_stream_float32_within_its_roundoff(kind, make):
    """The run's dtype: the float32 recursion against the dense float64 solve of the same float32
    draws, within the float32 bound."""
    s = make()
    W, _ = _stream(s, torch.float32)
    X, bound, m = _dense(s, _draws(torch.float32))
    assert np.all(np.abs(W - X) <= 2 * m * EPS32 * bound)


@pytest.mark.parametrize("kind,make", STRATEGIES[1::2])
def test_resume_continues_the_same_noise_sequence(kind, make):
    s = make()
    full, _ = _stream(s, torch.float32, steps=60)
    first, cn = _stream(s, torch.float32, steps=25)
    buf = io.BytesIO()  # through torch.save/load, as the checkpoint holds it
    torch.save({"noise": cn.source.state_dict(), "corr": cn.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    src = GaussianNoise(seed=999)
    src.load_state_dict(state["noise"])
    again = CorrelatedNoise(src, s)
    again.load_state_dict(state["corr"], {k: torch.zeros(v) for k, v in SHAPES.items()})
    rest, _ = _stream(s, torch.float32, steps=35, noise=again)
    np.testing.assert_array_equal(np.concatenate([first, rest]), full)  # bit-identical replay


def test_load_refuses_another_strategy():
    cn = CorrelatedNoise(GaussianNoise(seed=1), S.banded(4, 50))
    other = CorrelatedNoise(GaussianNoise(seed=1), S.banded(3, 50))
    with pytest.raises(ValueError, match="strategy differs"):
        other.load_state_dict(cn.state_dict(), {})
    with pytest.raises(ValueError, match="b = 1"):
        CorrelatedNoise(GaussianNoise(seed=1), S.banded(1, 50))


def _step(strategy, seed=0, steps=6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    clip = PerExampleClipper(model, clip_norm=1.0, clipping="per_layer")
    k = len(clip.groups)
    b = 1 if strategy is None else strategy.bands
    event = Cyclic(0.1, 2.0, b, k) if strategy is not None else Poisson(0.1, 2.0, k)
    dp = DPSGD(model, clip, GaussianNoise(seed=seed), Plan(event, 1.0, 10, None, strategy), lr=0.5)
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        dp.step(torch.randn(10, 5, generator=g), torch.randint(0, 3, (10,), generator=g))
    return model, dp


def test_b1_is_algorithm_1_bit_for_bit():
    """privacy.noise=bandmf privacy.bands=1: the same draws, the same ops, the same weights."""
    a, dpa = _step(None)
    b, dpb = _step(S.banded(1, 6))
    assert dpb.correlated is None and dpb.state_dict() == dpa.state_dict()
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # bit-identical: the same computation


def test_the_step_adds_row_t_and_checkpoints_it():
    """b = 4 changes the weights (correlated noise) and its state travels in the optimiser's."""
    a, _ = _step(None)
    b, dp = _step(S.banded(4, 6))
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    st = dp.state_dict()["correlated"]
    assert st["step"] == 6 and set(st["buffers"]) == set(dp.params)
    assert all(v.shape[0] == 3 for v in st["buffers"].values())  # b − 1 = 3 past rows kept


def test_plan_refuses_a_strategy_its_event_does_not_cover():
    with pytest.raises(ValueError, match="not covered"):
        Plan(Cyclic(0.04, 2.0, 2), 1.0, 10, None, S.banded(4, 50))  # 4 bands, cycle of 2
    with pytest.raises(ValueError, match="not covered"):
        Plan(Cyclic(0.04, 2.0, 100), 1.0, 10, None, S.blt(2, 50, 10))  # BLT amplified
    with pytest.raises(ValueError, match="cyclic participation"):
        Plan(Poisson(0.01, 2.0), 1.0, 10, None, S.banded(4, 50))
    with pytest.raises(ValueError, match="cyclic participation"):
        Plan(Cyclic(0.04, 2.0, 4), 1.0, 10, None, None)
    Plan(Cyclic(1.0, 2.0, 100), 1.0, 10, None, S.banded(4, 50))  # min-separation 100 >= 4
