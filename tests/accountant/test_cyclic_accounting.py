"""The Cyclic charge of correlated noise (events.Cyclic, ledger "cyclic") against independent
references: the dp_accounting event jax_privacy's ``amplified_bandmf_event`` builds (always, with
the dp-accounting of the test requirements) and jax_privacy itself (when installed: the optional
``mf-reference`` extra of pyproject.toml).

``amplified_bandmf_event(σ, n, num_bands=b, sampling_prob=q')`` is ``SelfComposedDpEvent(
PoissonSampledDpEvent(q', GaussianDpEvent(σ)), ⌈n/b⌉)`` (jax_privacy/experimental/accounting.py,
jax-privacy 2.0.0: "rounds = math.ceil(iterations / num_bands)"): Choquette-Choo et al. 2023 (arXiv
2306.08153) Thm 4 for a b-banded strategy with column norms <= 1 under cyclic Poisson sampling,
q' the rate within the lot's part. Ours: the ledger of n lots of ``CyclicPoissonSampler`` as the
training loop charges them (``record_lots``), composed by our PLD. dp_accounting's PLD discretises
on its own grid; its pessimistic estimate is an upper bound and its optimistic one a lower bound on
the true ε, so ours (an upper bound) must never be below the optimistic one and may exceed the
pessimistic one by at most our own grid's error (``ledger_pld_epsilon_tol``) plus the difference of
the two grids' roundings, which the existing dp_accounting comparison bounds at 0.5 %
(tests/accountant/test_pld.py).
"""

import math

import pytest

from dpsgd.accountant import Ledger
from dpsgd.accountant.events import Cyclic, Poisson, from_entry
from dpsgd.accountant.ledger import EVENTS
from dpsgd.mechanism.cyclic import CyclicPoissonSampler, CyclicSampler
from dpsgd.mechanism.sampling import record_lots
from tolerances import chain_rel_tol, ledger_pld_epsilon_tol

dpa = pytest.importorskip("dp_accounting")
from dp_accounting.pld import PLDAccountant, privacy_loss_distribution  # noqa: E402

DELTA = 1e-5
# (N, L, b, σ, n lots): ≥ 10 schedules; b = 1 is DP-SGD; lots not a multiple of b included
SCHEDULES = [
    (60000, 600, 1, 4.0, 1000),
    (60000, 600, 2, 6.0, 1000),
    (60000, 600, 4, 5.33, 17204),
    (60000, 600, 5, 8.724, 17204),
    (60000, 600, 10, 8.4, 5099),
    (60000, 600, 20, 7.903, 41376),
    (60000, 600, 100, 26.0, 3001),
    (60000, 4096, 3, 10.92, 600),
    (60000, 4096, 5, 7.589, 600),
    (60000, 4096, 14, 12.0, 601),
    (50000, 500, 8, 3.0, 2000),
    (10000, 100, 16, 2.0, 503),
]


def _dpa_event(sigma, n, b, q_part):
    """The event jax_privacy's amplified_bandmf_event builds (read from its source, see above)."""
    rounds = math.ceil(n / b)
    return dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(q_part, dpa.GaussianDpEvent(sigma)), rounds
    )


def _dpa_epsilon(event, pessimistic=True):
    """ε of ``event`` by dp_accounting's PLD: PLDAccountant (pessimistic), or the same PLD built
    with pessimistic_estimate=False (a lower estimate of the true ε)."""
    if pessimistic:
        return PLDAccountant(value_discretization_interval=1e-4).compose(event).get_epsilon(DELTA)
    sampled = event.event
    pl = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sampled.event.noise_multiplier,
        sampling_prob=sampled.sampling_probability,
        pessimistic_estimate=False,
        value_discretization_interval=1e-4,
        use_connect_dots=False,  # connect-the-dots is pessimistic only: privacy buckets
    )
    return pl.self_compose(event.count).get_epsilon_for_delta(DELTA)


def _ours(N, L, b, sigma, n):
    led = Ledger()
    record_lots(led, CyclicPoissonSampler(N, L, bands=b), sigma, n)
    return led


@pytest.mark.parametrize("N,L,b,sigma,n", SCHEDULES)
def test_cyclic_poisson_charge_matches_the_amplified_bandmf_event(N, L, b, sigma, n):
    led = _ours(N, L, b, sigma, n)
    (e,) = led.entries
    assert (e.event, e.count, e.t) == ("cyclic", math.ceil(n / b), b)  # integer
    assert e.q == b * L / N  # exact: the sampler's own rate, the same expression
    ours = led.epsilon(DELTA, "pld")[0]
    event = _dpa_event(sigma, n, b, e.q)
    upper, lower = _dpa_epsilon(event), _dpa_epsilon(event, pessimistic=False)
    assert ours >= lower  # never below the truth's lower estimate
    assert ours == pytest.approx(upper, rel=5e-3, abs=ledger_pld_epsilon_tol(led))


@pytest.mark.parametrize("N,L,b,sigma,n", SCHEDULES[:4])
def test_cyclic_is_composed_as_poisson_by_every_accountant(N, L, b, sigma, n):
    """A cyclic entry is ⌈n/b⌉ Poisson-subsampled Gaussians: the same numbers as a Poisson ledger
    of that count (the same code path: exact)."""
    led = _ours(N, L, b, sigma, n)
    ref = Ledger()
    ref.record(Poisson(b * L / N, sigma), math.ceil(n / b))
    for acc in EVENTS["cyclic"]:
        assert led.epsilon(DELTA, acc) == ref.epsilon(DELTA, acc)  # exact: one computation


def test_b1_charges_equal_poisson_lots():
    """b = 1: every lot charged at q = L/N, the ε of Algorithm 1 bit for bit."""
    led, ref = _ours(60000, 600, 1, 4.0, 777), Ledger()
    ref.record(Poisson(600 / 60000, 4.0), 777)
    for acc in ("moments", "rdp", "pld"):
        assert led.epsilon(DELTA, acc) == ref.epsilon(DELTA, acc)  # exact: the same mechanisms


def test_min_separation_is_one_gaussian_per_epoch():
    """cyclic (no amplification): one Gaussian at σ per epoch; ε of K epochs is the Gaussian
    mechanism at σ/√K (Balle & Wang 2018, exact), which PLD composition reproduces within its
    grid."""
    s = CyclicSampler(60000, 600)
    led = Ledger()
    record_lots(led, s, 30.0, 17204)
    (e,) = led.entries
    assert (e.q, e.count, e.t) == (1.0, 173, 100)  # exact: ⌈17204/100⌉ charges
    mu = math.sqrt(173) / 30.0
    from scipy import optimize, special

    f = lambda x: (  # noqa: E731
        special.ndtr(-x / mu + mu / 2) - math.exp(x) * special.ndtr(-x / mu - mu / 2) - DELTA
    )
    exact = optimize.brentq(f, 0.0, 50.0, xtol=1e-13)
    assert led.epsilon(DELTA, "pld")[0] == pytest.approx(exact, abs=ledger_pld_epsilon_tol(led))
    assert led.epsilon(DELTA, "pld")[0] >= exact * (1 - chain_rel_tol(8))


def test_cyclic_entry_round_trips_and_refuses_conversion():
    led = Ledger()
    led.record(Cyclic(0.04, 5.0, 4, 2), 3, "sgd")
    back = Ledger.from_dict(led.to_dict())
    assert back == led and from_entry(back.entries[0]) == Cyclic(0.04, 5.0, 4, 2)
    with pytest.raises(ValueError, match="no conversion"):
        led.converted("replace_one")
    with pytest.raises(ValueError, match="t >= 1"):
        Ledger().record(Cyclic(0.04, 5.0, 0), 1)


def test_steps_within_counts_charges_of_the_cycle():
    """The budget in charges: after it, one more charge passes the target."""
    ev = Cyclic(0.04, 5.33, 4, 1)
    n = Ledger().steps_within(2.0, DELTA, ev, "pld")
    a, b = Ledger(), Ledger()
    a.record(ev, n)
    b.record(ev, n + 1)
    assert a.epsilon(DELTA, "pld")[0] <= 2.0 < b.epsilon(DELTA, "pld")[0]


# -- jax_privacy itself, when installed (pip install -e '.[mf-reference]') ------------------------


@pytest.mark.parametrize("N,L,b,sigma,n", SCHEDULES)
def test_against_jax_privacy(N, L, b, sigma, n):
    jp = pytest.importorskip("jax_privacy.experimental.accounting")
    q_part = b * L / N
    event = jp.amplified_bandmf_event(sigma, n, num_bands=b, sampling_prob=q_part)
    assert event == _dpa_event(sigma, n, b, q_part)  # the event we rebuild is theirs
    led = _ours(N, L, b, sigma, n)
    ours = led.epsilon(DELTA, "pld")[0]
    assert ours >= _dpa_epsilon(event, pessimistic=False)
    assert ours == pytest.approx(_dpa_epsilon(event), rel=5e-3, abs=ledger_pld_epsilon_tol(led))
