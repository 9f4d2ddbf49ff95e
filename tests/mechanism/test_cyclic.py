"""The cyclic samplers of correlated noise (dpsgd/mechanism/cyclic.py): parts, lots, charges, the
position a resume needs, and which sampler each noise runs under."""

import numpy as np
import pytest
import torch

from dpsgd.accountant.events import Cyclic
from dpsgd.mechanism.cyclic import (
    CyclicPoissonSampler,
    CyclicSampler,
    assignment,
    make_run_sampler,
    participation,
)
from dpsgd.mechanism.sampling import PoissonSampler


def _gen(seed=7):
    return torch.Generator().manual_seed(seed)


def test_b1_draws_the_poisson_samplers_lots():
    a, b = PoissonSampler(3000, 30, _gen()), CyclicPoissonSampler(3000, 30, _gen(), bands=1)
    assert b.q == a.q and b.lots_per_epoch() == a.lots_per_epoch()  # exact: the same expression
    for _ in range(2):
        for x, y in zip(a.epoch(), b.epoch()):
            assert torch.equal(x, y)
    assert torch.equal(a.generator.get_state(), b.generator.get_state())


def test_assignment_is_a_function_of_seed_and_index_only():
    """Adding or removing an example moves no other one: the first N parts of N + 1 examples are
    those of N examples (the add/remove analysis); every part is used."""
    a, b = assignment(1000, 7, 123), assignment(1001, 7, 123)
    assert np.array_equal(a, b[:1000]) and set(a) == set(range(7))
    assert not np.array_equal(a, assignment(1000, 7, 124))
    counts = np.bincount(assignment(70000, 7, 5))
    assert np.all(np.abs(counts - 10000) < 6 * np.sqrt(10000))  # binomial: 6 sd


def test_lot_t_draws_from_part_t_mod_b_at_rate_bL_over_N():
    s = CyclicPoissonSampler(12000, 100, _gen(), bands=4)
    parts = [set(p.tolist()) for p in s.parts]
    assert sum(map(len, parts)) == 12000 and len(set().union(*parts)) == 12000
    assert s.q == 4 * 100 / 12000 and s.lots_per_epoch() == 4 * 30  # exact: whole cycles
    sizes = []
    for i, lot in enumerate(s.epoch()):
        assert set(lot.tolist()) <= parts[i % 4] and torch.all(lot[1:] > lot[:-1])
        sizes.append(len(lot))
    # L in expectation: q·|part| per lot, 120 lots; mean within 6 standard errors
    assert abs(np.mean(sizes) - 100) < 6 * np.sqrt(100 / 120)
    assert s.position == 120


def test_charges_once_per_cycle_and_the_budget_in_whole_cycles():
    s = CyclicPoissonSampler(60000, 600, bands=5)
    assert [s.charged(i) for i in range(6)] == [True, False, False, False, False, True]
    assert s.charges(3.0, 17204) == {Cyclic(0.05, 3.0, 5): 3441}  # ⌈17204/5⌉
    assert s.lots_within(0, 3) == 2 and s.lots_within(2, 0) == 10 and s.lots_within(1, 1) == 9
    m = CyclicSampler(60000, 600)
    assert (m.q, m.cycle, m.lots_per_epoch()) == (1.0, 100, 100)
    assert m.charges(3.0, 250) == {Cyclic(1.0, 3.0, 100): 3}


def test_an_abandoned_lot_does_not_count_and_a_cut_cycle_cannot_continue():
    s = CyclicPoissonSampler(1200, 10, _gen(), bands=3)
    it = s.epoch()
    for _ in range(5):  # lots 0..4 yielded; the loop stops before running lot 4
        next(it)
    assert s.position == 4  # lot 4 was abandoned
    with pytest.raises(ValueError, match="mid-cycle"):
        next(s.epoch())
    state = s.state_dict()
    t = CyclicPoissonSampler(1200, 10, _gen(), bands=3)
    t.load_state_dict(state)
    assert t.position == 4 and not t.aligned
    with pytest.raises(ValueError, match="parts"):
        CyclicPoissonSampler(1200, 10, _gen(8), bands=3).load_state_dict(state)


def test_whole_parts_each_once_per_epoch():
    s = CyclicSampler(1000, 100, _gen())
    lots = list(s.epoch())
    assert len(lots) == 10 and sorted(torch.cat(lots).tolist()) == list(range(1000))


@pytest.mark.parametrize(
    "noise,sampling,want",
    [
        ("independent", "poisson", "poisson"),
        ("bandmf", "poisson", "cyclic_poisson"),
        ("bandmf", "cyclic", "cyclic"),
        ("blt", "poisson", "cyclic"),
        ("blt", "cyclic", "cyclic"),
    ],
)
def test_participation_of_each_noise(noise, sampling, want):
    assert participation(noise, sampling) == want


@pytest.mark.parametrize(
    "noise,sampling,match",
    [
        ("bandmf", "shuffle", "accounted only under cyclic"),
        ("bandmf", "fixed_size", "accounted only under cyclic"),
        ("blt", "cyclic_poisson", "not banded"),
        ("independent", "cyclic_poisson", "correlated noise"),
        ("laplace", "poisson", "must be one of"),
    ],
)
def test_participation_refuses_in_one_line(noise, sampling, match):
    with pytest.raises(ValueError, match=match) as e:
        participation(noise, sampling)
    assert "\n" not in str(e.value)


def test_run_sampler_refuses_more_bands_than_parts_can_hold():
    with pytest.raises(ValueError, match="b·L <= N"):
        make_run_sampler("bandmf", "poisson", 1000, 300, bands=4)
    assert make_run_sampler("bandmf", "poisson", 1000, 250, bands=4).q == 1.0
