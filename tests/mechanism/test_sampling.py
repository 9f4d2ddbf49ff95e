"""Samplers: the Poisson lot size has mean L (q = L/N); shuffle lots partition each epoch; states
resume."""

import math

import pytest
import torch

from dpsgd.mechanism.sampling import PoissonSampler, ShuffleSampler, make_sampler


def test_poisson_mean_lot_size_is_L():
    N, L = 10_000, 200
    s = PoissonSampler(N, L, torch.Generator().manual_seed(0))
    # q = L/N, one division: pytest's default rel 1e-6
    assert s.q == pytest.approx(L / N) and s.name == "poisson"
    assert s.lots_per_epoch() == round(N / L)
    sizes = torch.tensor([len(idx) for _ in range(8) for idx in s.epoch()], dtype=torch.float64)
    n = len(sizes)
    # |lot| ~ Binomial(N, q): mean L, sd sqrt(N q (1-q)); the mean of n lots within 5 standard
    # errors.
    se = math.sqrt(N * s.q * (1 - s.q) / n)
    assert abs(sizes.mean().item() - L) < 5 * se
    # statistical: a variance from few lots (its SE is ~√(2/lots) relative)
    assert sizes.var().item() == pytest.approx(N * s.q * (1 - s.q), rel=0.3)


def test_poisson_lots_are_sorted_unique_in_range():
    s = PoissonSampler(500, 50, torch.Generator().manual_seed(1))
    for idx in s.epoch():
        assert idx.dtype == torch.int64
        assert bool((idx[1:] > idx[:-1]).all())  # strictly increasing: sorted and unique
        assert len(idx) == 0 or (idx.min() >= 0 and idx.max() < 500)


def test_poisson_charges_every_lot_at_q_sigma():
    s = PoissonSampler(1000, 10, torch.Generator().manual_seed(0))
    assert all(
        (s.release(4.0, i).q, s.release(4.0, i).sigma) == (0.01, 4.0) for i in range(5)
    )  # exact: L/N and σ copied
    assert s.amplification


def test_shuffle_partitions_each_epoch_into_fixed_lots():
    N, L = 1003, 100
    s = ShuffleSampler(N, L, torch.Generator().manual_seed(0))
    lots = list(s.epoch())
    assert len(lots) == N // L and all(len(l) == L for l in lots)
    seen = torch.cat(lots)
    assert len(torch.unique(seen)) == len(seen)  # every example at most once per epoch
    assert s.name == "shuffle" and s.q == 1.0 and not s.amplification


def test_shuffle_charges_one_substitution_mechanism_per_epoch():
    s = ShuffleSampler(1000, 100, torch.Generator().manual_seed(0))
    assert (s.release(4.0, 0).entry()["q"], s.release(4.0, 0).entry()["sigma"]) == (
        1.0,
        2.0,
    )  # q = 1, multiplier σ/2 (sensitivity 2C)
    assert all(s.release(4.0, i) is None for i in range(1, 10))
    assert "substitution" in s.adjacency


@pytest.mark.parametrize("name", ["poisson", "shuffle"])
def test_generator_state_round_trip_gives_identical_lots(name):
    a = make_sampler(name, 300, 30, torch.Generator().manual_seed(7))
    list(a.epoch())
    state = a.state_dict()
    first = [l.clone() for l in a.epoch()]
    b = make_sampler(name, 300, 30, torch.Generator().manual_seed(999))
    b.load_state_dict(state)
    second = list(b.epoch())
    assert len(first) == len(second) and all(torch.equal(x, y) for x, y in zip(first, second))


def test_bad_arguments_refused():
    with pytest.raises(ValueError, match="lot_size"):
        PoissonSampler(10, 11)
    with pytest.raises(ValueError, match="lot_size"):
        ShuffleSampler(10, 0)
    with pytest.raises(ValueError, match="privacy.sampling"):
        make_sampler("uniform", 10, 2)
