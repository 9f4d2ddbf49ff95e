"""dpsgd.PrivateTrainer(noise="bandmf"|"blt"): the command line's mechanism on a user's model: b = 1
is Algorithm 1 bit for bit, the state continues the noise sequence, bad arguments are one line."""

import pytest
import torch
from torch import nn

import dpsgd

X, Y = torch.randn(600, 20, generator=torch.Generator().manual_seed(0)), torch.arange(600) % 2


def _trainer(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 2))
    args = dict(lot_size=60, clip_norm=1.0, target_epsilon=2.0, epochs=3, seed=0, threads=False)
    return model, dpsgd.PrivateTrainer(model, (X, Y), **{**args, **kw})


def test_bands_1_is_algorithm_1():
    m1, t1 = _trainer()
    m2, t2 = _trainer(noise="bandmf", bands=1)
    assert t1.fit() == t2.fit() and t1.steps == t2.steps
    assert t1.plan.sigma == t2.plan.sigma and t1.epsilon == t2.epsilon  # exact: one computation
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # bit-identical: the same draws and ops
    assert t2.sampler.name == "cyclic_poisson" and t2.accountant == t1.accountant


@pytest.mark.parametrize("kw", [{"noise": "bandmf", "bands": 4}, {"noise": "blt"}])
def test_state_dict_continues_the_same_noise(kw):
    m1, t1 = _trainer(**kw)
    t1.fit(1.5)  # a fraction of an epoch runs whole cycles
    assert t1.steps % getattr(t1.sampler, "cycle", 1) == 0
    state = t1.state_dict()
    m2, t2 = _trainer(**kw)
    t2.load_state_dict(state)
    t1.fit(1)
    t2.fit(1)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # bit-identical replay
    assert t1.epsilon == t2.epsilon <= 2.0
    assert "correlated_noise" in t1.statement()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"noise": "bandmf"}, "bands=None"),
        ({"bands": 3}, "bands=3"),
        ({"noise": "blt", "sampling": "shuffle"}, "accounted only under cyclic"),
        ({"noise": "bandmf", "bands": 11}, "b·L <= N"),
        ({"noise": "blt", "epochs": None, "target_epsilon": None, "sigma": 1.0}, "horizon"),
    ],
)
def test_bad_arguments_are_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        _trainer(**kw)
    assert "\n" not in str(e.value)
